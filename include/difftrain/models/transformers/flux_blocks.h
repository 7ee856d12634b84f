#pragma once
// The blocks of FLUX.1's MMDiT (Diffusers v0.31 transformer_flux.py): the joint (double-stream)
// block and the single-stream block, made of the shared DiT blocks (dit_blocks.h: 3-axis rotary
// position embeddings, per-head RMSNorm, adaptive layer-norm modulation, joint attention).
// Registered names are Diffusers' state-dict keys.

#include "difftrain/core/forward_hooks.h"
#include "difftrain/models/attention.h"
#include "difftrain/models/linear.h"
#include "difftrain/models/transformers/dit_blocks.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace difftrain::models {

/// Diffusers' `FluxTransformerBlock` (double stream): norm1 / norm1_context (AdaLayerNormZero),
/// joint attention `attn`, ff / ff_context (FeedForward, gelu tanh, inner 4·dim).
class FluxTransformerBlockImpl : public torch::nn::Module, public core::HookableModule {
 public:
  FluxTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim);
  /// img: [B, L, D], txt: [B, S, D], temb: [B, D], rope over S + L tokens (text first)
  /// -> {img', txt'} (Diffusers returns (encoder_hidden_states, hidden_states)).
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& img,
                                                  const torch::Tensor& txt,
                                                  const torch::Tensor& temb,
                                                  const RotaryTables& rope);
  std::string hook_class_name() const override { return "FluxTransformerBlock"; }

 private:
  AdaLayerNormZero norm1_{nullptr}, norm1_context_{nullptr};
  DiTAttention attn_{nullptr};
  FeedForward ff_{nullptr}, ff_context_{nullptr};
};
TORCH_MODULE(FluxTransformerBlock);

/// Diffusers' `FluxSingleTransformerBlock`: norm (AdaLayerNormZeroSingle), attn (pre_only),
/// proj_mlp [4·dim, dim] (gelu tanh), proj_out [dim, 5·dim] over cat(attention, mlp).
class FluxSingleTransformerBlockImpl : public torch::nn::Module, public core::HookableModule {
 public:
  FluxSingleTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim);
  /// h: [B, S + L, D], temb: [B, D] -> [B, S + L, D]; with keep_from > 0 only the rows from
  /// keep_from on, [B, S + L − keep_from, D] (the last block, whose text rows the model drops:
  /// their queries, MLP and output projection are never computed; the kept rows are the same).
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& temb, const RotaryTables& rope,
                        int64_t keep_from = 0);
  std::string hook_class_name() const override { return "FluxSingleTransformerBlock"; }

 private:
  AdaLayerNormZero norm_{nullptr};
  Linear proj_mlp_{nullptr}, proj_out_{nullptr};
  DiTAttention attn_{nullptr};
};
TORCH_MODULE(FluxSingleTransformerBlock);

}  // namespace difftrain::models
