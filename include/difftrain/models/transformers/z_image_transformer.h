#pragma once
// Diffusers' `ZImageTransformer2DModel` (Z-Image Turbo and Base): a single-stream DiT over
// [image tokens, caption tokens]. Image latents are patchified per sample and refined alone
// (`noise_refiner`, modulated by the timestep), the Qwen3 caption features likewise without
// modulation (`context_refiner`); each stream is padded to a multiple of 32 with a learned pad
// token; then `layers` run over the joint sequence with 3-axis RoPE, and the final layer and
// unpatchify give the velocity (x0 - noise). Parameter names are Diffusers' keys.

#include "difftrain/models/block_swap.h"
#include "difftrain/models/linear.h"
#include "difftrain/models/transformers/dit_blocks.h"

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::models {

/// The fields of a ZImageTransformer2DModel config.json (Diffusers' defaults when absent).
struct ZImageTransformerOptions {
  std::vector<int64_t> all_patch_size = {2};
  std::vector<int64_t> all_f_patch_size = {1};
  int64_t in_channels = 16;
  int64_t dim = 3840;
  int64_t n_layers = 30;
  int64_t n_refiner_layers = 2;
  int64_t n_heads = 30;
  /// Accepted and unused, as in Diffusers (keys and values have n_heads heads).
  int64_t n_kv_heads = 30;
  double norm_eps = 1e-5;
  bool qk_norm = true;
  int64_t cap_feat_dim = 2560;
  double rope_theta = 256.0;
  double t_scale = 1000.0;
  std::vector<int64_t> axes_dims = {32, 48, 48};
  std::vector<int64_t> axes_lens = {1024, 512, 512};

  int64_t head_dim() const { return dim / n_heads; }
  /// min(dim, 256): the width of the timestep embedding (ADALN_EMBED_DIM).
  int64_t adaln_dim() const { return dim < 256 ? dim : 256; }
  /// Reads a Diffusers config.json; errors name the file and the field (a dim not divisible by
  /// n_heads, axes_dims not summing to the head dim or odd, patch lists of different lengths,
  /// siglip_feat_dim set: Z-Image-Omni's image conditioning is not supported).
  static ZImageTransformerOptions load(const std::string& path);
};

/// One `ZImageTransformerBlock`: attention (to_q, to_k, to_v, to_out.0 without bias; norm_q,
/// norm_k per head with eps 1e-5), feed_forward (w1, w2, w3), the sandwich norms
/// attention_norm1/2 and ffn_norm1/2, and with modulation `adaLN_modulation.0` (scale and tanh
/// gate for attention and MLP, no shift, no SiLU before it).
class ZImageTransformerBlockImpl : public torch::nn::Module {
 public:
  ZImageTransformerBlockImpl(const ZImageTransformerOptions& o, bool modulation);
  /// x: [B, S, dim]; cos, sin: [B, S, head_dim / 2] float32 (interleaved-pair RoPE factors);
  /// key_mask: [B, S] bool or undefined (all real); adaln: [B, adaln_dim] or undefined without
  /// modulation -> [B, S, dim].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& key_mask, const torch::Tensor& adaln);

 private:
  ZImageTransformerOptions options_;
  bool modulation_;
  Linear to_q_{nullptr}, to_k_{nullptr}, to_v_{nullptr}, to_out_{nullptr};
  RMSNorm norm_q_{nullptr}, norm_k_{nullptr};
  GatedFeedForward feed_forward_{nullptr};
  RMSNorm attention_norm1_{nullptr}, attention_norm2_{nullptr}, ffn_norm1_{nullptr},
      ffn_norm2_{nullptr};
  Linear ada_{nullptr};
};
TORCH_MODULE(ZImageTransformerBlock);

/// Diffusers' `ZImageTransformer2DModel` (without the Omni SigLIP path).
class ZImageTransformer2DModelImpl : public torch::nn::Module {
 public:
  explicit ZImageTransformer2DModelImpl(const ZImageTransformerOptions& options);
  /// Diffusers' forward(x, t, cap_feats, patch_size, f_patch_size): x: B latents [C, F, H, W]
  /// (H, W divisible by the patch size, F by the frame patch size), t: [B] in [0, 1] (1 = clean;
  /// the pipeline passes 1 - sigma), cap_feats: B caption features [L_i, cap_feat_dim] (L_i >= 1)
  /// -> B outputs [C, F, H, W]: x0 - noise.
  std::vector<torch::Tensor> forward(const std::vector<torch::Tensor>& x, const torch::Tensor& t,
                                     const std::vector<torch::Tensor>& cap_feats,
                                     int64_t patch_size = 2, int64_t f_patch_size = 1);
  const ZImageTransformerOptions& options() const { return options_; }
  /// The compute dtype: the pad tokens' (never stored in 8 bits, unlike a frozen Linear's weight).
  torch::Dtype dtype() const { return x_pad_token_.scalar_type(); }
  /// Diffusers' enable_gradient_checkpointing(): in training with grad enabled, every block
  /// (refiners and layers) keeps only its inputs and runs again in backward.
  void set_gradient_checkpointing(bool on) { gradient_checkpointing_ = on; }
  /// kohya's / musubi-tuner's `--blocks_to_swap n` (models/block_swap.h): the frozen weights of
  /// the last n main layers (not the refiners) in host memory, staged per block; 0 turns it off.
  /// Call once the model is on its device, its adapters attached and its base stored as it trains.
  /// Throws difftrain::Error for n >= the block count or a swapped block whose parameters train.
  void enable_block_swap(int64_t n);
  /// The swap, or nullptr.
  const BlockSwap* block_swap() const { return block_swap_.get(); }
  bool gradient_checkpointing() const { return gradient_checkpointing_; }

 private:
  ZImageTransformerOptions options_;
  bool gradient_checkpointing_ = false;
  std::shared_ptr<BlockSwap> block_swap_;
  /// all_x_embedder / all_final_layer children by "<patch>-<f_patch>".
  std::map<std::string, Linear> x_embedders_;
  std::map<std::string, std::shared_ptr<torch::nn::Module>> final_layers_;
  Linear t_mlp0_{nullptr}, t_mlp2_{nullptr};
  RMSNorm cap_norm_{nullptr};
  Linear cap_linear_{nullptr};
  torch::Tensor x_pad_token_, cap_pad_token_;
  std::vector<ZImageTransformerBlock> noise_refiner_, context_refiner_, layers_;
};
TORCH_MODULE(ZImageTransformer2DModel);

/// Builds the model from `dir`/config.json and loads diffusion_pytorch_model[.variant]
/// .safetensors (or its shards) strictly by name, in `dtype`, on the CPU. Diffusers:
/// `ZImageTransformer2DModel.from_pretrained(dir, torch_dtype=dtype)`.
ZImageTransformer2DModel load_z_image_transformer(const std::string& dir,
                                                  torch::Dtype dtype = torch::kFloat32,
                                                  const std::string& variant = "");

}  // namespace difftrain::models
