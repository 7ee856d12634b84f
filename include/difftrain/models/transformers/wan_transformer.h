#pragma once
// Diffusers' `WanTransformer3DModel` (Wan 2.1 text-to-video and image-to-video, Wan 2.2's experts
// and its 5B text-image-to-video model): a Conv3d patch embedding of the latent video, blocks of
// self-attention with 3-D rotary positions (frame, row, column) and q/k RMS norms across the
// heads, cross-attention to the UMT5 caption (and, for 2.1 I2V, to CLIP image features through
// added key/value projections), a GELU feed-forward, each modulated by the timestep through a
// learned scale/shift table, and the unpatchify back to [B, C, F, H, W]. Registered names are
// Diffusers' state-dict keys. As `from_pretrained(torch_dtype=bf16)` leaves them, the modules of
// `_keep_in_fp32_modules` (time_embedder, the scale/shift tables, norm2's affine) stay float32 in
// a reduced-precision model, and the modulation is computed in float32.

#include "difftrain/core/forward_hooks.h"
#include "difftrain/core/no_split_modules.h"
#include "difftrain/models/block_swap.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/linear.h"
#include "difftrain/models/transformers/dit_blocks.h"

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::models {

struct WanTransformerOptions {
  std::array<int64_t, 3> patch_size = {1, 2, 2};
  int64_t num_attention_heads = 40;
  int64_t attention_head_dim = 128;
  int64_t in_channels = 16;
  int64_t out_channels = 16;
  int64_t text_dim = 4096;
  int64_t freq_dim = 256;
  int64_t ffn_dim = 13824;
  int64_t num_layers = 40;
  bool cross_attn_norm = true;
  double eps = 1e-6;
  std::optional<int64_t> image_dim;          ///< 2.1 I2V: CLIP vision features' width
  std::optional<int64_t> added_kv_proj_dim;  ///< 2.1 I2V: the image branch's key/value input
  int64_t rope_max_seq_len = 1024;
  std::optional<int64_t> pos_embed_seq_len;  ///< FLF2V: a learned position table of the images

  int64_t inner_dim() const { return num_attention_heads * attention_head_dim; }
  /// The 3-D RoPE split of a head: frames, rows, columns (rows = columns = 2 (d / 6)).
  std::array<int64_t, 3> rope_dims() const;
  static WanTransformerOptions load(const std::string& path);
  static WanTransformerOptions parse(const nlohmann::json& j, const std::string& source);
};

/// Diffusers' `WanAttention` with `WanAttnProcessor`: to_q/k/v, norm_q/norm_k (RMS across the
/// heads), RoPE on self-attention, and with added_kv_proj_dim the image branch (add_k_proj,
/// add_v_proj, norm_added_k) over the first S - 512 context tokens, added to the text branch.
class WanAttentionImpl : public torch::nn::Module {
 public:
  WanAttentionImpl(int64_t dim, int64_t heads, double eps, std::optional<int64_t> added_kv_dim);
  /// x [B, N, dim]; context [B, S, dim] or undefined (self-attention); rope for self-attention.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context,
                        const RotaryTables* rope);

 private:
  int64_t heads_;
  Linear to_q_{nullptr}, to_k_{nullptr}, to_v_{nullptr}, to_out_{nullptr};
  Linear add_k_proj_{nullptr}, add_v_proj_{nullptr};
  RMSNorm norm_q_{nullptr}, norm_k_{nullptr}, norm_added_k_{nullptr};
};
TORCH_MODULE(WanAttention);

class WanTransformerBlockImpl : public torch::nn::Module, public core::HookableModule {
 public:
  explicit WanTransformerBlockImpl(const WanTransformerOptions& o);
  /// x [B, N, D], context [B, S, D], timestep_proj [B, 6, D] or [B, N, 6, D] (float32 or the
  /// model's dtype), rope over the N tokens.
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context,
                        const torch::Tensor& timestep_proj, const RotaryTables& rope);
  std::string hook_class_name() const override { return "WanTransformerBlock"; }

 private:
  double eps_;
  WanAttention attn1_{nullptr}, attn2_{nullptr};
  torch::Tensor norm2_weight_, norm2_bias_;  ///< cross_attn_norm's affine (float32)
  Linear ffn_in_{nullptr}, ffn_out_{nullptr};
  torch::Tensor scale_shift_table_;  ///< [1, 6, D] float32
};
TORCH_MODULE(WanTransformerBlock);

class WanTransformer3DModelImpl : public torch::nn::Module,
                                  public core::HookableModule,
                                  public core::NoSplitModules {
 public:
  explicit WanTransformer3DModelImpl(const WanTransformerOptions& options);

  /// Diffusers' forward: hidden_states [B, in_channels, F, H, W] (F, H, W multiples of the
  /// patch), timestep [B] (or [B, N] per token: Wan 2.2's expand_timesteps), encoder_hidden_states
  /// [B, S, text_dim], encoder_hidden_states_image [B, T, image_dim] (2.1 I2V only) ->
  /// [B, out_channels, F, H, W].
  torch::Tensor forward(const torch::Tensor& hidden_states, const torch::Tensor& timestep,
                        const torch::Tensor& encoder_hidden_states,
                        const torch::Tensor& encoder_hidden_states_image = {});

  std::string hook_class_name() const override { return "WanTransformer3DModel"; }
  std::vector<std::string> no_split_modules() const override { return {"WanTransformerBlock"}; }
  const WanTransformerOptions& options() const { return options_; }
  /// The compute dtype: proj_out's bias (never quantized, not kept in float32).
  torch::Dtype dtype() const { return proj_out_->bias.scalar_type(); }
  /// Casts the whole model to `dtype`, then returns the `_keep_in_fp32_modules` to float32.
  void to_dtype(torch::Dtype dtype);
  void set_gradient_checkpointing(bool on) { gradient_checkpointing_ = on; }
  /// kohya's / musubi-tuner's `--blocks_to_swap n` (models/block_swap.h): the frozen weights of
  /// the last n blocks in host memory, staged per block; 0 turns it off. Call once the model is
  /// on its device, its adapters attached and its base stored as it trains. Throws
  /// difftrain::Error for n >= the block count or a swapped block whose parameters train.
  void enable_block_swap(int64_t n);
  /// The swap, or nullptr.
  const BlockSwap* block_swap() const { return block_swap_.get(); }
  bool gradient_checkpointing() const { return gradient_checkpointing_; }

 private:
  WanTransformerOptions options_;
  bool gradient_checkpointing_ = false;
  std::shared_ptr<BlockSwap> block_swap_;
  torch::Tensor patch_weight_, patch_bias_;
  TimestepEmbedding time_embedder_{nullptr};
  Linear time_proj_{nullptr}, text_linear_1_{nullptr}, text_linear_2_{nullptr};
  // 2.1 I2V's image_embedder: norm1 (affine), ff (net.0.proj, net.2), norm2 (affine).
  torch::Tensor img_norm1_weight_, img_norm1_bias_, img_norm2_weight_, img_norm2_bias_;
  torch::Tensor img_pos_embed_;
  Linear img_ff_in_{nullptr}, img_ff_out_{nullptr};
  std::vector<WanTransformerBlock> blocks_;
  Linear proj_out_{nullptr};
  torch::Tensor scale_shift_table_;  ///< [1, 2, D] float32
};
TORCH_MODULE(WanTransformer3DModel);

/// Whether WanTransformer3DModel keeps parameter `name` in float32 under a lower precision
/// (Diffusers' `_keep_in_fp32_modules`: rope, time_embedder, scale_shift_table, norm1-3, matched
/// as substrings as from_pretrained matches them).
bool wan_keeps_in_fp32(const std::string& name);

/// A Diffusers WanTransformer3DModel folder (config.json + diffusion_pytorch_model*.safetensors)
/// in `dtype` (the _keep_in_fp32_modules in float32), on the CPU.
WanTransformer3DModel load_wan_transformer(const std::string& dir,
                                           torch::Dtype dtype = torch::kFloat32,
                                           const std::string& variant = "");

}  // namespace difftrain::models
