#pragma once
// The building blocks of FLUX.1's MMDiT (Diffusers v0.31 transformer_flux.py, embeddings.py,
// normalization.py, attention_processor.py FluxAttnProcessor2_0): 3-axis rotary position
// embeddings, per-head RMSNorm, adaptive layer-norm modulation, the joint (double-stream)
// attention block and the single-stream block. Registered names are Diffusers' state-dict keys.

#include "difftrain/core/forward_hooks.h"
#include "difftrain/models/attention.h"
#include "difftrain/models/linear.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <cstdint>
#include <utility>
#include <vector>

namespace difftrain::models {

/// cos and sin tables of FLUX's rotary embedding, each [N, head_dim] float32.
struct RotaryTables {
  torch::Tensor cos;
  torch::Tensor sin;
};

/// Diffusers' `FluxPosEmbed(theta, axes_dim)`: for every axis a (dims d_a, even), angles
/// ids[:, a] * theta^(-2j/d_a), j = 0..d_a/2-1, in float64, then cos/sin in float32 with every
/// column repeated twice (interleaved pairs), axes concatenated in order. ids: [N, len(axes_dims)]
/// (any dtype; cast to float32 first, as Diffusers does) -> tables [N, sum(axes_dims)].
RotaryTables flux_rotary_tables(const torch::Tensor& ids, const std::vector<int64_t>& axes_dims,
                                double theta = 10000.0);

/// Diffusers' `apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1)`: every
/// pair (x[2m], x[2m+1]) -> (x[2m]·cos − x[2m+1]·sin, x[2m+1]·cos + x[2m]·sin), computed in
/// float32 and cast back to x's dtype. x: [B, N, heads, head_dim], tables [N, head_dim].
torch::Tensor apply_rotary_emb(const torch::Tensor& x, const RotaryTables& rope);

/// Diffusers' `RMSNorm(dim, eps, elementwise_affine=True)`: x * rsqrt(mean(x², -1) + eps) * weight
/// with the variance in float32; for bf16/fp16 weights the normalised value is cast to the
/// weight's dtype before the product. x: [..., dim].
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

/// The modulation of Diffusers' `AdaLayerNormZero` (chunks 6), `AdaLayerNormZeroSingle`
/// (chunks 3) and `AdaLayerNormContinuous` (chunks 2): linear(silu(temb)).chunk(chunks), with
/// child `linear` [chunks·dim, dim]. The parameter-free LayerNorm (eps 1e-6) is flux_modulate().
class AdaLayerNormZeroImpl : public torch::nn::Module {
 public:
  AdaLayerNormZeroImpl(int64_t dim, int64_t chunks);
  /// temb: [B, dim] -> `chunks` tensors [B, dim].
  std::vector<torch::Tensor> forward(const torch::Tensor& temb);

 private:
  int64_t chunks_;
  Linear linear_{nullptr};
};
TORCH_MODULE(AdaLayerNormZero);

/// layer_norm(x, eps 1e-6, no affine) · (1 + scale) + shift, the modulation broadcast over
/// tokens. x: [B, N, D], shift/scale: [B, D].
torch::Tensor flux_modulate(const torch::Tensor& x, const torch::Tensor& shift,
                            const torch::Tensor& scale);

/// Diffusers' `Attention` as FLUX builds it (bias=True, qk_norm="rms_norm", eps 1e-6) with
/// FluxAttnProcessor2_0: to_q/to_k/to_v, norm_q/norm_k (RMSNorm per head, before RoPE); joint
/// (added_kv_proj_dim = dim): add_q_proj/add_k_proj/add_v_proj, norm_added_q/norm_added_k,
/// to_add_out, and to_out.0; pre_only (single blocks): no output projection.
class FluxAttentionImpl : public torch::nn::Module {
 public:
  FluxAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, bool joint);
  /// Joint: x [B, L, D] (image), context [B, S, D] (text), rope over the S + L tokens, text
  /// FIRST -> {to_out.0(o_img) [B, L, D], to_add_out(o_txt) [B, S, D]}.
  /// Not joint: x [B, N, D], context undefined -> {o [B, N, heads·head_dim], undefined}.
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x,
                                                  const torch::Tensor& context,
                                                  const RotaryTables& rope);

 private:
  // x: [B, N, D] through a projection and its per-head RMSNorm -> [B, N, heads, head_dim].
  torch::Tensor heads_of(Linear& proj, RMSNorm* norm, const torch::Tensor& x) const;

  int64_t heads_, head_dim_;
  Linear to_q_{nullptr}, to_k_{nullptr}, to_v_{nullptr};
  RMSNorm norm_q_{nullptr}, norm_k_{nullptr};
  Linear add_q_proj_{nullptr}, add_k_proj_{nullptr}, add_v_proj_{nullptr};
  RMSNorm norm_added_q_{nullptr}, norm_added_k_{nullptr};
  Linear to_add_out_{nullptr}, to_out_0_{nullptr};
};
TORCH_MODULE(FluxAttention);

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
  FluxAttention attn_{nullptr};
  FeedForward ff_{nullptr}, ff_context_{nullptr};
};
TORCH_MODULE(FluxTransformerBlock);

/// Diffusers' `FluxSingleTransformerBlock`: norm (AdaLayerNormZeroSingle), attn (pre_only),
/// proj_mlp [4·dim, dim] (gelu tanh), proj_out [dim, 5·dim] over cat(attention, mlp).
class FluxSingleTransformerBlockImpl : public torch::nn::Module, public core::HookableModule {
 public:
  FluxSingleTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim);
  /// h: [B, S + L, D], temb: [B, D] -> [B, S + L, D].
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& temb,
                        const RotaryTables& rope);
  std::string hook_class_name() const override { return "FluxSingleTransformerBlock"; }

 private:
  AdaLayerNormZero norm_{nullptr};
  Linear proj_mlp_{nullptr}, proj_out_{nullptr};
  FluxAttention attn_{nullptr};
};
TORCH_MODULE(FluxSingleTransformerBlock);

}  // namespace difftrain::models
