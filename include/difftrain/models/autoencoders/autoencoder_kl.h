#pragma once
// Diffusers' `AutoencoderKL` (the Stable Diffusion VAE): Encoder (DownEncoderBlock2D blocks, a
// UNetMidBlock2D with attention), quant_conv, the diagonal Gaussian posterior, post_quant_conv and
// Decoder (UpDecoderBlock2D blocks), with Diffusers' state-dict keys.

#include "difftrain/models/unets/unet_blocks.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::models {

/// The fields of Diffusers' AutoencoderKL config.json (missing fields take Diffusers' defaults).
struct AutoencoderKLConfig {
  int64_t in_channels = 3;
  int64_t out_channels = 3;
  std::vector<std::string> down_block_types{"DownEncoderBlock2D"};  ///< the only type supported
  std::vector<std::string> up_block_types{"UpDecoderBlock2D"};      ///< the only type supported
  std::vector<int64_t> block_out_channels{64};
  int64_t layers_per_block = 1;
  std::string act_fn = "silu";
  int64_t latent_channels = 4;
  int64_t norm_num_groups = 32;
  int64_t sample_size = 32;
  double scaling_factor = 0.18215;
  std::optional<double> shift_factor;  ///< null in SD 1.x/2.x
  bool use_quant_conv = true;
  bool use_post_quant_conv = true;
  bool mid_block_add_attention = true;
  bool force_upcast = true;
  /// The file the config was read from ("" when built in code), for error messages.
  std::string source;
  /// 2^(len(block_out_channels) - 1): image side / latent side.
  int64_t downsample_factor() const { return int64_t{1} << (block_out_channels.size() - 1); }
};

/// Reads an AutoencoderKL config.json. Throws difftrain::Error (one line, naming the file and the
/// field) for a missing file, invalid JSON, wrong types, an unsupported block type or class
/// (listing the supported ones), lengths that disagree, or channels not divisible by
/// norm_num_groups.
AutoencoderKLConfig read_autoencoder_kl_config(const std::string& path);

/// read_autoencoder_kl_config() of config.json text already in memory; `source` names it in
/// errors.
AutoencoderKLConfig parse_autoencoder_kl_config(const std::string& json_text,
                                                const std::string& source);

/// The posterior q(z | x) = N(mean, exp(logvar)) (Diffusers' DiagonalGaussianDistribution).
struct DiagonalGaussian {
  torch::Tensor mean;    ///< [B, latent_channels, h, w]
  torch::Tensor logvar;  ///< clamped to [-30, 20]
  torch::Tensor std;     ///< exp(0.5 * logvar)
  /// mean + std * randn(mean's shape, generator) with the noise drawn on the CPU generator in
  /// float32 (as Diffusers draws it with a CPU generator) and moved to mean's device and dtype.
  torch::Tensor sample(at::Generator generator) const;
  /// The mean (Diffusers' `.mode()`).
  torch::Tensor mode() const { return mean; }
  /// Builds one from quant_conv's output moments [B, 2 * latent_channels, h, w] (mean first).
  static DiagonalGaussian from_moments(const torch::Tensor& moments);
};

/// Diffusers' `Encoder` (double_z): conv_in, down_blocks.i.{resnets.j, downsamplers.0.conv}
/// (stride-2 conv with right/bottom padding), mid_block, conv_norm_out, SiLU, conv_out to
/// 2 * latent_channels.
class VaeEncoderImpl : public torch::nn::Module {
 public:
  explicit VaeEncoderImpl(const AutoencoderKLConfig& config);
  /// x: [B, in_channels, H, W] -> moments [B, 2 * latent_channels, H / f, W / f]
  torch::Tensor forward(const torch::Tensor& x);

 private:
  Conv2d conv_in_{nullptr}, conv_out_{nullptr};
  std::vector<DownBlock> down_blocks_;
  MidBlock mid_block_{nullptr};
  torch::nn::GroupNorm conv_norm_out_{nullptr};
};
TORCH_MODULE(VaeEncoder);

/// Diffusers' `Decoder`: conv_in, mid_block, up_blocks.i.{resnets.j (layers_per_block + 1),
/// upsamplers.0.conv}, conv_norm_out, SiLU, conv_out.
class VaeDecoderImpl : public torch::nn::Module {
 public:
  explicit VaeDecoderImpl(const AutoencoderKLConfig& config);
  /// z: [B, latent_channels, h, w] -> [B, out_channels, h * f, w * f]
  torch::Tensor forward(const torch::Tensor& z);

 private:
  Conv2d conv_in_{nullptr}, conv_out_{nullptr};
  MidBlock mid_block_{nullptr};
  std::vector<UpBlock> up_blocks_;
  torch::nn::GroupNorm conv_norm_out_{nullptr};
};
TORCH_MODULE(VaeDecoder);

/// Diffusers' `AutoencoderKL`: children encoder, decoder, quant_conv, post_quant_conv.
class AutoencoderKLImpl : public torch::nn::Module {
 public:
  explicit AutoencoderKLImpl(const AutoencoderKLConfig& config);
  /// x: [B, in_channels, H, W] in [-1, 1] (H, W multiples of downsample_factor) -> the
  /// posterior over latents [B, latent_channels, H / f, W / f] (`vae.encode(x).latent_dist`).
  DiagonalGaussian encode(const torch::Tensor& x);
  /// z: [B, latent_channels, h, w] (unscaled) -> [B, out_channels, h * f, w * f]
  /// (`vae.decode(z).sample`).
  torch::Tensor decode(const torch::Tensor& z);
  /// What the UNet is trained on: (z - shift_factor) * scaling_factor.
  torch::Tensor scale_latents(const torch::Tensor& z) const;
  /// The inverse, applied before decode: z / scaling_factor + shift_factor.
  torch::Tensor unscale_latents(const torch::Tensor& latents) const;
  const AutoencoderKLConfig& config() const { return config_; }

 private:
  AutoencoderKLConfig config_;
  VaeEncoder encoder_{nullptr};
  VaeDecoder decoder_{nullptr};
  Conv2d quant_conv_{nullptr}, post_quant_conv_{nullptr};
};
TORCH_MODULE(AutoencoderKL);

/// Builds the VAE from `dir`/config.json and loads `dir`'s diffusion_pytorch_model.safetensors
/// (or its variant) strictly by name (models::weights_path, models::load_weights), float32 on
/// the CPU. Diffusers: `AutoencoderKL.from_pretrained(dir)`.
AutoencoderKL load_autoencoder_kl(const std::string& dir, const std::string& variant = "");

}  // namespace difftrain::models
