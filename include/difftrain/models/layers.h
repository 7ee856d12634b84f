#pragma once
// The UNets' building blocks that are not attention: timestep embeddings, ResnetBlock2D,
// Downsample2D, Upsample2D (Diffusers' embeddings.py, resnet.py, downsampling.py, upsampling.py).
// Registered names are Diffusers' state-dict keys.

#include "difftrain/core/forward_hooks.h"
#include "difftrain/models/linear.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/any.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <optional>
#include <string>

namespace difftrain::models {

/// The activation Diffusers' get_activation() names: "silu"/"swish", "mish", "gelu", "relu".
/// "gelu" is models::gelu().
torch::Tensor activation(const std::string& name, const torch::Tensor& x);

/// GELU, exact (erf; torch's approximate="none") or with the tanh approximation ("tanh", Diffusers'
/// "gelu-approximate", Transformers' gelu_new), with a backward that is correct for any strides:
/// LibTorch 1.13's CPU gelu_backward returns wrong values (even inf/NaN) when the incoming
/// gradient is not contiguous, so it is made contiguous first. Every gelu of the project (GEGLU,
/// FeedForward, CLIP, the UNet activations) goes through this. x: any shape; result: x's shape.
torch::Tensor gelu(const torch::Tensor& x, bool tanh_approximation = false);

/// Sinusoidal timestep features, Diffusers' `get_timestep_embedding` / `Timesteps` module:
/// timesteps [B] (any dtype) -> [B, dim] float32.
torch::Tensor timestep_embedding(const torch::Tensor& timesteps, int64_t dim, bool flip_sin_to_cos,
                                 double downscale_freq_shift, double scale = 1.0,
                                 double max_period = 10000.0);

/// Diffusers' `TimestepEmbedding`: linear_1 -> act -> linear_2 (-> post_act), with an optional
/// bias-free `cond_proj` of a condition added to the input first.
class TimestepEmbeddingImpl : public torch::nn::Module {
 public:
  TimestepEmbeddingImpl(int64_t in_channels, int64_t time_embed_dim, std::string act_fn = "silu",
                        std::optional<std::string> post_act_fn = std::nullopt,
                        std::optional<int64_t> cond_proj_dim = std::nullopt);
  /// sample: [B, in_channels], condition: [B, cond_proj_dim] or undefined -> [B, time_embed_dim]
  torch::Tensor forward(torch::Tensor sample, const torch::Tensor& condition = {});

 private:
  Linear linear_1_{nullptr}, linear_2_{nullptr}, cond_proj_{nullptr};
  std::string act_fn_;
  std::optional<std::string> post_act_fn_;
};
TORCH_MODULE(TimestepEmbedding);

/// Diffusers' `GaussianFourierProjection`: a fixed random `weight` [embedding_size] (saved, not
/// trained). timesteps [B] -> [B, 2 * embedding_size].
class GaussianFourierProjectionImpl : public torch::nn::Module {
 public:
  GaussianFourierProjectionImpl(int64_t embedding_size, double scale, bool log,
                                bool flip_sin_to_cos);
  torch::Tensor forward(const torch::Tensor& timesteps);

 private:
  torch::Tensor weight_;
  bool log_, flip_sin_to_cos_;
};
TORCH_MODULE(GaussianFourierProjection);

/// Diffusers' `Downsample2D` with use_conv=True (a stride-2 3x3 `conv`) or False (2x2 average
/// pooling). padding 0 pads right/bottom by one first, as Diffusers does.
class Downsample2DImpl : public torch::nn::Module {
 public:
  Downsample2DImpl(int64_t channels, bool use_conv, int64_t out_channels, int64_t padding);
  /// x: [B, C, H, W] -> [B, C_out, H/2, W/2]
  torch::Tensor forward(torch::Tensor x);

 private:
  Conv2d conv_{nullptr};
  int64_t padding_;
};
TORCH_MODULE(Downsample2D);

/// Diffusers' `Upsample2D` (nearest 2x, or to `output_size`, then an optional 3x3 `conv`).
class Upsample2DImpl : public torch::nn::Module {
 public:
  Upsample2DImpl(int64_t channels, bool use_conv, int64_t out_channels);
  /// x: [B, C, H, W] -> [B, C_out, 2H, 2W] (or output_size = {H', W'} when given)
  torch::Tensor forward(torch::Tensor x, const std::vector<int64_t>& output_size = {});

 private:
  Conv2d conv_{nullptr};
};
TORCH_MODULE(Upsample2D);

/// Options of ResnetBlock2D (Diffusers' constructor arguments).
struct ResnetBlock2DOptions {
  ResnetBlock2DOptions(int64_t in_channels, int64_t out_channels)
      : in_channels_(in_channels), out_channels_(out_channels) {}
  TORCH_ARG(int64_t, in_channels);
  TORCH_ARG(int64_t, out_channels);
  /// 0 = no time embedding input.
  TORCH_ARG(int64_t, temb_channels) = 512;
  TORCH_ARG(int64_t, groups) = 32;
  TORCH_ARG(double, eps) = 1e-6;
  TORCH_ARG(double, dropout) = 0.0;
  /// "default" (add) or "scale_shift" (h * (1 + scale) + shift after norm2).
  TORCH_ARG(std::string, time_embedding_norm) = "default";
  TORCH_ARG(std::string, non_linearity) = "silu";
  TORCH_ARG(double, output_scale_factor) = 1.0;
  TORCH_ARG(bool, skip_time_act) = false;
  /// Resample inside the block (Diffusers' up=True / down=True with kernel None).
  TORCH_ARG(bool, up) = false;
  TORCH_ARG(bool, down) = false;
};

/// Diffusers' `ResnetBlock2D`: norm1 -> act -> conv1 (+ time_emb_proj) -> norm2 -> act ->
/// dropout -> conv2, plus the input (through a 1x1 conv_shortcut when channels change).
class ResnetBlock2DImpl : public torch::nn::Module, public core::HookableModule {
 public:
  explicit ResnetBlock2DImpl(const ResnetBlock2DOptions& options);
  /// x: [B, C_in, H, W], temb: [B, temb_channels] or undefined -> [B, C_out, H', W']
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& temb);
  /// forward(torch::cat({x, skip}, 1), temb), as a UNet's up block calls it; in the blocked
  /// layout (a float32 CPU training step) the two parts are converted straight into the blocked
  /// input, and the plain concatenation is never written.
  torch::Tensor forward_cat(const torch::Tensor& x, const torch::Tensor& skip,
                            const torch::Tensor& temb);
  std::string hook_class_name() const override { return "ResnetBlock2D"; }
  /// Whether the last forward ran between its convolutions in oneDNN's blocked layout (a float32
  /// CPU training step with the Winograd path and fused kernels on; layers.cpp). For tests.
  bool last_forward_blocked() const { return last_forward_blocked_; }

  ResnetBlock2DOptions options;

 private:
  torch::Tensor forward_impl(const torch::Tensor& x, const torch::Tensor& temb);
  // Whether the whole block can run in oneDNN's blocked layout for a plain input of these sizes
  // with x's dtype and device (layers.cpp).
  bool blocked_applies(const torch::Tensor& x, torch::IntArrayRef sizes) const;
  // The block on its input already in the blocked layout ([B, C_in / 16, H, W, 16]), returning a
  // plain output; only where blocked_applies said so.
  torch::Tensor forward_blocked(const torch::Tensor& xb, const torch::Tensor& temb);
  torch::nn::GroupNorm norm1_{nullptr}, norm2_{nullptr};
  Conv2d conv1_{nullptr}, conv2_{nullptr}, conv_shortcut_{nullptr};
  Linear time_emb_proj_{nullptr};
  bool last_forward_blocked_ = false;
};
TORCH_MODULE(ResnetBlock2D);

}  // namespace difftrain::models
