#pragma once
// Diffusers' QwenImageTransformer2DModel (transformer_qwenimage.py): the dual-stream MMDiT of
// Qwen-Image and its Edit models. Image tokens (2x2 latent patches, packed) and text tokens (the
// Qwen2.5-VL encoder's last hidden states) keep their own weights and meet in one joint attention
// with a padding mask on the text keys; positions are 3-axis RoPE (frame, height, width) centred
// on the image, with the text placed after the image's largest half-extent.

#include "difftrain/core/forward_hooks.h"
#include "difftrain/core/no_split_modules.h"
#include "difftrain/models/block_swap.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/linear.h"
#include "difftrain/models/transformers/dit_blocks.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/embedding.h>
#include <nlohmann/json_fwd.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::models {

struct QwenImageTransformerOptions {
  int64_t patch_size = 2;
  int64_t in_channels = 64;
  std::optional<int64_t> out_channels = 16;
  int64_t num_layers = 60;
  int64_t attention_head_dim = 128;
  int64_t num_attention_heads = 24;
  int64_t joint_attention_dim = 3584;
  std::vector<int64_t> axes_dims_rope = {16, 56, 56};
  bool zero_cond_t = false;            ///< Edit-2511: reference tokens modulated as at t = 0
  bool use_additional_t_cond = false;  ///< Layered: a learned embedding of a 0/1 flag added
  bool use_layer3d_rope = false;       ///< Layered: the last image is the condition (frame -1)

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  int64_t output_channels() const { return out_channels.value_or(in_channels); }
  static QwenImageTransformerOptions load(const std::string& path);
  static QwenImageTransformerOptions parse(const nlohmann::json& j, const std::string& source);
};

/// The (frame, height, width) grids of one sample's images in packed-patch units, in token order
/// (the target first, then any reference images), as Diffusers' `img_shapes[b]`.
using QwenImageGrids = std::vector<std::array<int64_t, 3>>;

/// Rotary factors of Diffusers' QwenEmbedRope / QwenEmbedLayer3DRope for `grids` and `text_len`
/// text tokens: cos/sin [N_img, head_dim] and [text_len, head_dim] (interleaved pairs), the
/// angles in float32 as torch.polar's inputs.
std::pair<RotaryTables, RotaryTables> qwen_image_rope(const QwenImageGrids& grids, int64_t text_len,
                                                      const std::vector<int64_t>& axes_dims,
                                                      bool layer3d = false);

class QwenImageTransformerBlockImpl : public torch::nn::Module, public core::HookableModule {
 public:
  QwenImageTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim, bool zero_cond_t);
  /// img [B, N, D], txt [B, S, D], temb [B, D] (or [2B, D] under zero_cond_t, the second half
  /// the t = 0 rows), rope over [txt; img], key_mask [B, S + N] bool or undefined,
  /// modulate_index [B, N] (0: the first half of temb, 1: the second) or undefined.
  /// Returns {img, txt}.
  std::pair<torch::Tensor, torch::Tensor> forward(
      const torch::Tensor& img, const torch::Tensor& txt, const torch::Tensor& temb,
      const RotaryTables& rope, const torch::Tensor& key_mask, const torch::Tensor& modulate_index);
  std::string hook_class_name() const override { return "QwenImageTransformerBlock"; }

 private:
  bool zero_cond_t_;
  Linear img_mod_{nullptr}, txt_mod_{nullptr};
  DiTAttention attn_{nullptr};
  FeedForward img_mlp_{nullptr}, txt_mlp_{nullptr};
};
TORCH_MODULE(QwenImageTransformerBlock);

class QwenImageTransformer2DModelImpl : public torch::nn::Module,
                                        public core::HookableModule,
                                        public core::NoSplitModules {
 public:
  explicit QwenImageTransformer2DModelImpl(const QwenImageTransformerOptions& options);

  /// Diffusers' forward: hidden_states [B, N, in_channels] (packed latents, every image of
  /// `img_shapes[b]` in order), encoder_hidden_states [B, S, joint_attention_dim],
  /// encoder_hidden_states_mask [B, S] (nonzero: a real token) or undefined (every token),
  /// timestep [B] in [0, 1] (the pipelines pass t / 1000), img_shapes one grid list per sample
  /// (RoPE uses the first sample's, as Diffusers does), additional_t_cond [B] int64 (only with
  /// use_additional_t_cond). Returns [B, N, patch_size^2 * out_channels].
  torch::Tensor forward(const torch::Tensor& hidden_states,
                        const torch::Tensor& encoder_hidden_states,
                        const torch::Tensor& encoder_hidden_states_mask,
                        const torch::Tensor& timestep,
                        const std::vector<QwenImageGrids>& img_shapes,
                        const torch::Tensor& additional_t_cond = {});

  std::string hook_class_name() const override { return "QwenImageTransformer2DModel"; }
  std::vector<std::string> no_split_modules() const override {
    return {"QwenImageTransformerBlock"};
  }
  const QwenImageTransformerOptions& options() const { return options_; }
  // The RMSNorm weight: never quantized (an 8-bit base stores the Linear weights in int8).
  torch::Dtype dtype() const { return txt_norm_->weight.scalar_type(); }
  void set_gradient_checkpointing(bool on) { gradient_checkpointing_ = on; }
  /// kohya's / musubi-tuner's `--blocks_to_swap n` (models/block_swap.h): the frozen weights of
  /// the last n transformer blocks in host memory, staged per block; 0 turns it off. Call once the
  /// model is on its device, its adapters attached and its base stored as it trains. Throws
  /// difftrain::Error for n >= the block count or a swapped block whose parameters train.
  void enable_block_swap(int64_t n);
  /// The swap, or nullptr.
  const BlockSwap* block_swap() const { return block_swap_.get(); }
  bool gradient_checkpointing() const { return gradient_checkpointing_; }

 private:
  QwenImageTransformerOptions options_;
  bool gradient_checkpointing_ = false;
  std::shared_ptr<BlockSwap> block_swap_;
  TimestepEmbedding timestep_embedder_{nullptr};
  torch::nn::Embedding addition_t_embedding_{nullptr};
  RMSNorm txt_norm_{nullptr};
  Linear img_in_{nullptr}, txt_in_{nullptr};
  std::vector<QwenImageTransformerBlock> blocks_;
  Linear norm_out_linear_{nullptr}, proj_out_{nullptr};
};
TORCH_MODULE(QwenImageTransformer2DModel);

QwenImageTransformer2DModel load_qwen_image_transformer(const std::string& dir,
                                                        torch::Dtype dtype = torch::kFloat32,
                                                        const std::string& variant = "");

}  // namespace difftrain::models
