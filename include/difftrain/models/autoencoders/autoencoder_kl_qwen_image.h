#pragma once
// Diffusers' AutoencoderKLQwenImage (autoencoder_kl_qwenimage.py): the causal 3-D VAE of
// Qwen-Image, which is Wan 2.1's VAE design (AutoencoderKLWan without its 2.2 options): causal 3-D
// convolutions (time padded on the past side only) with a feature cache, so a clip is encoded as
// its first frame then chunks of 4 frames, and decoded one latent frame at a time; RMS norms over
// channels; 8x spatial and (for video) 4x temporal compression; latents normalised with per-channel
// latents_mean / latents_std by the pipelines. An image is a clip of one frame.

#include "difftrain/models/autoencoders/autoencoder_kl.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::models {

struct AutoencoderKLQwenImageConfig {
  int64_t base_dim = 96;
  int64_t z_dim = 16;
  std::vector<int64_t> dim_mult = {1, 2, 4, 4};
  int64_t num_res_blocks = 2;
  std::vector<double> attn_scales;
  std::vector<bool> temperal_downsample = {false, true, true};
  int64_t input_channels = 3;
  std::vector<double> latents_mean;  ///< z_dim values (Qwen-Image's defaults when absent)
  std::vector<double> latents_std;   ///< z_dim values
  /// AutoencoderKLWan (Wan 2.1's folders): the same model, whose tiled decode is clamped to
  /// [-1, 1] as its plain decode is (AutoencoderKLQwenImage's tiled decode is not).
  bool wan = false;
  /// Wan 2.2's 48-channel VAE (AutoencoderKLWan with is_residual, patch_size 2): pixels
  /// patchified 2 x 2 into input_channels = 12 channels before the encoder (and back after the
  /// decoder), residual down / up blocks with averaged / duplicated shortcuts, the decoder
  /// `decoder_base_dim` wide; 16x spatial compression.
  bool is_residual = false;
  int64_t patch_size = 1;
  int64_t decoder_base_dim = 0;  ///< 0: base_dim
  std::string source;

  /// The encoder's own downsampling, 2 ** len(temperal_downsample).
  int64_t encoder_compression_ratio() const {
    return int64_t{1} << static_cast<int64_t>(temperal_downsample.size());
  }
  /// Pixels per latent side, with the patchify: the pipelines' vae_scale_factor_spatial (8 for
  /// Qwen-Image and Wan 2.1, 16 for Wan 2.2's VAE).
  int64_t spatial_compression_ratio() const { return patch_size * encoder_compression_ratio(); }
  /// The channels of the pixels encode() takes and decode() returns (3).
  int64_t image_channels() const { return input_channels / (patch_size * patch_size); }
  /// 2 ** (downsamples that also act on time): 4 for Qwen-Image / Wan 2.1.
  int64_t temporal_compression_ratio() const;
  static AutoencoderKLQwenImageConfig parse(const std::string& json_text,
                                            const std::string& source);
  static AutoencoderKLQwenImageConfig load(const std::string& path);
};

/// Tiled encode/decode (Diffusers' enable_tiling): sizes in pixels; a sample larger than the
/// minimum on either side is cut into tiles at the stride and blended linearly over the overlap.
struct QwenImageVaeTiling {
  int64_t tile_sample_min_height = 256;
  int64_t tile_sample_min_width = 256;
  int64_t tile_sample_stride_height = 192;
  int64_t tile_sample_stride_width = 192;
};

class AutoencoderKLQwenImageImpl : public torch::nn::Module {
 public:
  explicit AutoencoderKLQwenImageImpl(const AutoencoderKLQwenImageConfig& config);
  ~AutoencoderKLQwenImageImpl() override;

  /// x: [B, C, T, H, W] in [-1, 1] (T = 1 + 4k for video) -> the posterior over
  /// [B, z_dim, 1 + k, H / r, W / r], r = spatial_compression_ratio() (unnormalised: the pipelines
  /// normalise with latents_mean/std).
  DiagonalGaussian encode(const torch::Tensor& x);
  /// z: [B, z_dim, t, h, w] -> [B, C, 1 + 4 (t - 1), r h, r w], clamped to [-1, 1] (a tiled
  /// decode of AutoencoderKLQwenImage is not clamped, as in Diffusers; AutoencoderKLWan's is).
  torch::Tensor decode(const torch::Tensor& z);

  void enable_tiling(const QwenImageVaeTiling& tiling = {});
  void disable_tiling() { tiling_ = false; }
  bool tiling() const { return tiling_; }

  /// (mean - latents_mean) / latents_std, per channel of [B, z_dim, ...] (the training scripts'
  /// and Edit pipelines' normalisation), and its inverse (before decode).
  torch::Tensor normalize_latents(const torch::Tensor& z) const;
  torch::Tensor denormalize_latents(const torch::Tensor& latents) const;

  const AutoencoderKLQwenImageConfig& config() const { return config_; }

  struct Parts;

 private:
  torch::Tensor encode_moments(const torch::Tensor& x);
  torch::Tensor tiled_encode(const torch::Tensor& x);
  torch::Tensor tiled_decode(const torch::Tensor& z);

  AutoencoderKLQwenImageConfig config_;
  std::shared_ptr<Parts> parts_;
  bool tiling_ = false;
  QwenImageVaeTiling tile_;
};
TORCH_MODULE(AutoencoderKLQwenImage);

AutoencoderKLQwenImage load_autoencoder_kl_qwen_image(const std::string& dir,
                                                      torch::Dtype dtype = torch::kFloat32,
                                                      const std::string& variant = "");

}  // namespace difftrain::models
