#include "difftrain/models/layers.h"

#include "difftrain/core/error.h"
#include "difftrain/models/kernels/fused_ops.h"
#include "difftrain/models/kernels/winograd_conv.h"

#include <torch/autograd.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/padding.h>
#include <torch/nn/functional/pooling.h>
#include <torch/nn/functional/upsampling.h>

#include <cmath>

namespace difftrain::models {

namespace F = torch::nn::functional;

namespace {

// torch's gelu with a backward that hands gelu_backward contiguous operands (see the header).
struct StrideSafeGelu : public torch::autograd::Function<StrideSafeGelu> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               bool tanh_approximation) {
    ctx->save_for_backward({x});
    ctx->saved_data["tanh"] = tanh_approximation;
    return torch::gelu(x, tanh_approximation ? "tanh" : "none");
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const torch::Tensor x = ctx->get_saved_variables()[0];
    const bool tanh_approximation = ctx->saved_data["tanh"].toBool();
    return {torch::gelu_backward(grads[0].contiguous(), x.contiguous(),
                                 tanh_approximation ? "tanh" : "none"),
            torch::Tensor()};
  }
};

}  // namespace

torch::Tensor gelu(const torch::Tensor& x, bool tanh_approximation) {
  if (torch::Tensor y = fused_gelu(x, tanh_approximation); y.defined()) return y;
  return StrideSafeGelu::apply(x, tanh_approximation);
}

torch::Tensor activation(const std::string& name, const torch::Tensor& x) {
  if (name == "silu" || name == "swish") return torch::silu(x);
  if (name == "gelu") return models::gelu(x);
  if (name == "relu") return torch::relu(x);
  if (name == "mish") return torch::mish(x);
  throw Error("unknown activation \"" + name + "\"; supported: silu, swish, mish, gelu, relu");
}

torch::Tensor timestep_embedding(const torch::Tensor& timesteps, int64_t dim, bool flip_sin_to_cos,
                                 double downscale_freq_shift, double scale, double max_period) {
  TORCH_CHECK(timesteps.dim() == 1, "timesteps must be 1-D [B], got ", timesteps.sizes());
  const int64_t half = dim / 2;
  auto f32 = torch::TensorOptions().dtype(torch::kFloat32).device(timesteps.device());
  // Same operation order as Diffusers, all in float32, so the features agree bit for bit.
  torch::Tensor exponent = -std::log(max_period) * torch::arange(0, half, f32);
  exponent = exponent / (static_cast<double>(half) - downscale_freq_shift);
  torch::Tensor emb = torch::exp(exponent);
  emb = timesteps.unsqueeze(1).to(torch::kFloat32) * emb.unsqueeze(0);
  emb = scale * emb;
  emb = torch::cat({torch::sin(emb), torch::cos(emb)}, -1);
  if (flip_sin_to_cos) {
    emb = torch::cat({emb.narrow(1, half, half), emb.narrow(1, 0, half)}, -1);
  }
  if (dim % 2 == 1) emb = F::pad(emb, F::PadFuncOptions({0, 1, 0, 0}));
  return emb;
}

// ------------------------------------------------------------------ TimestepEmbedding

TimestepEmbeddingImpl::TimestepEmbeddingImpl(int64_t in_channels, int64_t time_embed_dim,
                                             std::string act_fn,
                                             std::optional<std::string> post_act_fn,
                                             std::optional<int64_t> cond_proj_dim)
    : act_fn_(std::move(act_fn)), post_act_fn_(std::move(post_act_fn)) {
  linear_1_ = register_module("linear_1", Linear(in_channels, time_embed_dim));
  if (cond_proj_dim) {
    cond_proj_ = register_module(
        "cond_proj", Linear(torch::nn::LinearOptions(*cond_proj_dim, in_channels).bias(false)));
  }
  linear_2_ = register_module("linear_2", Linear(time_embed_dim, time_embed_dim));
}

torch::Tensor TimestepEmbeddingImpl::forward(torch::Tensor sample, const torch::Tensor& condition) {
  if (condition.defined()) {
    TORCH_CHECK(!cond_proj_.is_empty(),
                "a timestep condition was given but the model has no "
                "time_cond_proj_dim");
    sample = sample + cond_proj_(condition);
  }
  sample = activation(act_fn_, linear_1_(sample));
  sample = linear_2_(sample);
  if (post_act_fn_) sample = activation(*post_act_fn_, sample);
  return sample;
}

// ------------------------------------------------------------------ GaussianFourierProjection

GaussianFourierProjectionImpl::GaussianFourierProjectionImpl(int64_t embedding_size, double scale,
                                                             bool log, bool flip_sin_to_cos)
    : log_(log), flip_sin_to_cos_(flip_sin_to_cos) {
  weight_ = register_parameter("weight", torch::randn({embedding_size}) * scale,
                               /*requires_grad=*/false);
}

torch::Tensor GaussianFourierProjectionImpl::forward(const torch::Tensor& timesteps) {
  torch::Tensor x = timesteps.to(weight_.dtype());
  if (log_) x = torch::log(x);
  torch::Tensor proj = x.unsqueeze(1) * weight_.unsqueeze(0) * 2 * M_PI;
  if (flip_sin_to_cos_) return torch::cat({torch::cos(proj), torch::sin(proj)}, -1);
  return torch::cat({torch::sin(proj), torch::cos(proj)}, -1);
}

// ------------------------------------------------------------------ Downsample2D / Upsample2D

Downsample2DImpl::Downsample2DImpl(int64_t channels, bool use_conv, int64_t out_channels,
                                   int64_t padding)
    : padding_(padding) {
  if (use_conv) {
    conv_ = register_module(
        "conv",
        Conv2d(torch::nn::Conv2dOptions(channels, out_channels, 3).stride(2).padding(padding)));
  } else {
    TORCH_CHECK(channels == out_channels, "Downsample2D without a conv keeps the channel count");
  }
}

torch::Tensor Downsample2DImpl::forward(torch::Tensor x) {
  if (conv_.is_empty()) {
    return F::avg_pool2d(x, F::AvgPool2dFuncOptions(2).stride(2));
  }
  if (padding_ == 0) {
    x = F::pad(x, F::PadFuncOptions({0, 1, 0, 1}).mode(torch::kConstant).value(0));
  }
  return conv_(x);
}

Upsample2DImpl::Upsample2DImpl(int64_t channels, bool use_conv, int64_t out_channels) {
  if (use_conv) {
    conv_ = register_module("conv",
                            Conv2d(torch::nn::Conv2dOptions(channels, out_channels, 3).padding(1)));
  }
}

torch::Tensor Upsample2DImpl::forward(torch::Tensor x, const std::vector<int64_t>& output_size) {
  const auto dtype = x.scalar_type();
  // Nearest upsampling has no bfloat16 kernel in older LibTorch; Diffusers upcasts the same way.
  if (dtype == torch::kBFloat16) x = x.to(torch::kFloat32);
  if (x.size(0) >= 64) x = x.contiguous();
  auto opts = F::InterpolateFuncOptions().mode(torch::kNearest);
  if (output_size.empty()) {
    opts.scale_factor(std::vector<double>{2.0, 2.0});
  } else {
    opts.size(output_size);
  }
  x = F::interpolate(x, opts);
  if (dtype == torch::kBFloat16) x = x.to(dtype);
  if (!conv_.is_empty()) x = conv_(x);
  return x;
}

// ------------------------------------------------------------------ ResnetBlock2D

ResnetBlock2DImpl::ResnetBlock2DImpl(const ResnetBlock2DOptions& o) : options(o) {
  const int64_t in = o.in_channels(), out = o.out_channels();
  norm1_ = register_module(
      "norm1", torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.groups(), in).eps(o.eps())));
  conv1_ = register_module("conv1", Conv2d(torch::nn::Conv2dOptions(in, out, 3).padding(1)));
  if (o.temb_channels() > 0) {
    const int64_t proj = o.time_embedding_norm() == "scale_shift" ? 2 * out : out;
    time_emb_proj_ = register_module("time_emb_proj", Linear(o.temb_channels(), proj));
  }
  norm2_ = register_module(
      "norm2", torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.groups(), out).eps(o.eps())));
  conv2_ = register_module("conv2", Conv2d(torch::nn::Conv2dOptions(out, out, 3).padding(1)));
  if (in != out) {
    conv_shortcut_ = register_module("conv_shortcut", Conv2d(torch::nn::Conv2dOptions(in, out, 1)));
  }
}

// A float32 CPU training step through Winograd convolutions computes in oneDNN's blocked layout
// nChw16c; a plain tensor is converted into it before each convolution (and its backwards) and
// back after, about 15% of the default UNet's step. Here the whole block runs in that layout: the
// input is converted once, then norm1, conv1, the time embedding's add, norm2, conv2, the 1x1
// conv_shortcut (oneDNN's direct kernel) and the residual add stay blocked, and the sum is
// converted back once: two conversions per block each way instead of four (six with a shortcut,
// whose LibTorch convolution converts its own input and output) (docs/PERFORMANCE.md). Same maths
// as forward_impl, to float rounding (GroupNorm sums in another order).
bool ResnetBlock2DImpl::blocked_applies(const torch::Tensor& x_in, torch::IntArrayRef sizes) const {
  const auto& o = options;
  const std::string& act = o.non_linearity();
  const bool silu = act == "silu" || act == "swish";
  if (!silu || o.up() || o.down() || o.time_embedding_norm() == "scale_shift" ||
      (o.dropout() > 0 && is_training()) || !winograd_blocked_layout_enabled() ||
      !fused_kernels_enabled() || x_in.dim() != 4 || !x_in.device().is_cpu() ||
      x_in.scalar_type() != torch::kFloat32 || use_channels_last(x_in)) {
    return false;
  }
  if (sizes.size() != 4) return false;
  const int64_t n = sizes[0], out = o.out_channels(), H = sizes[2], W = sizes[3];
  return conv1_->blocked_applies(sizes) && conv2_->blocked_applies({n, out, H, W}) &&
         (conv_shortcut_.is_empty() ? sizes[1] == out : conv_shortcut_->blocked_applies(sizes));
}

torch::Tensor ResnetBlock2DImpl::forward_blocked(const torch::Tensor& xb,
                                                 const torch::Tensor& temb) {
  const auto& o = options;
  const std::string& act = o.non_linearity();
  const int64_t out = o.out_channels();
  constexpr int64_t kBlock = 16;  // winograd_conv2d's blocks (both channel counts divide)
  const auto& gn1 = norm1_->options;
  // xb feeds norm1 and the residual (or the shortcut): the residual takes norm1's pass-through,
  // so norm1's backward adds both gradients in its last pass.
  auto [h, xb_residual] = group_norm_silu_blocked_pass_input(xb, gn1.num_groups(), norm1_->weight,
                                                             norm1_->bias, gn1.eps(), true);
  if (!h.defined()) throw Error("ResnetBlock2D: the fused GroupNorm declined a blocked input");
  h = conv1_->forward_blocked(h, /*x_blocked=*/true, /*y_blocked=*/true);
  if (!time_emb_proj_.is_empty() && temb.defined()) {
    torch::Tensor t = o.skip_time_act() ? temb : activation(act, temb);
    t = time_emb_proj_(t);
    h.add_(t.reshape({t.size(0), out / kBlock, 1, 1, kBlock}));  // (conv1 keeps no output)
  }
  const auto& gn2 = norm2_->options;
  h = group_norm_silu_blocked(h, gn2.num_groups(), norm2_->weight, norm2_->bias, gn2.eps(), true);
  if (!h.defined()) throw Error("ResnetBlock2D: the fused GroupNorm declined a blocked input");
  h = conv2_->forward_blocked(h, /*x_blocked=*/true, /*y_blocked=*/true);
  const torch::Tensor input =
      conv_shortcut_.is_empty()
          ? xb_residual
          : conv_shortcut_->forward_blocked(xb_residual, /*x_blocked=*/true, /*y_blocked=*/true);
  // In place: nothing keeps conv2's output for its backward, and a fresh 4 MB result costs its
  // first-touch writes.
  h.add_(input);
  if (o.output_scale_factor() != 1.0) h.div_(o.output_scale_factor());
  return from_channel_blocks(h);
}

torch::Tensor ResnetBlock2DImpl::forward_impl(const torch::Tensor& x, const torch::Tensor& temb) {
  // (An attention block's output is channels-last memory: to_channel_blocks reads either.)
  last_forward_blocked_ = blocked_applies(x, x.sizes());
  if (last_forward_blocked_) return forward_blocked(to_channel_blocks(x.contiguous()), temb);
  const std::string& act = options.non_linearity();
  torch::Tensor input = x;
  torch::Tensor h = group_norm_act(*norm1_, act, x);
  if (options.up()) {
    if (h.size(0) >= 64) {
      input = input.contiguous();
      h = h.contiguous();
    }
    auto opts = F::InterpolateFuncOptions()
                    .mode(torch::kNearest)
                    .scale_factor(std::vector<double>{2.0, 2.0});
    input = F::interpolate(input, opts);
    h = F::interpolate(h, opts);
  } else if (options.down()) {
    input = F::avg_pool2d(input, F::AvgPool2dFuncOptions(2).stride(2));
    h = F::avg_pool2d(h, F::AvgPool2dFuncOptions(2).stride(2));
  }
  h = conv1_(h);
  torch::Tensor t;
  if (!time_emb_proj_.is_empty() && temb.defined()) {
    t = options.skip_time_act() ? temb : activation(act, temb);
    t = time_emb_proj_(t).unsqueeze(-1).unsqueeze(-1);
  }
  if (options.time_embedding_norm() == "scale_shift") {
    TORCH_CHECK(t.defined(), "ResnetBlock2D with scale_shift needs a time embedding");
    auto chunks = t.chunk(2, 1);
    h = group_norm_act(*norm2_, "", h);
    h = activation(act, h * (1 + chunks[0]) + chunks[1]);
  } else {
    if (t.defined()) h = h + t;
    h = group_norm_act(*norm2_, act, h);
  }
  if (options.dropout() > 0)
    h = F::dropout(h, F::DropoutFuncOptions().p(options.dropout()).training(is_training()));
  h = conv2_(h);
  if (!conv_shortcut_.is_empty()) input = conv_shortcut_(input);
  torch::Tensor out = input + h;
  if (options.output_scale_factor() != 1.0) out = out / options.output_scale_factor();
  return out;
}

torch::Tensor ResnetBlock2DImpl::forward(const torch::Tensor& x, const torch::Tensor& temb) {
  core::ForwardScope scope(*this);
  return scope.output(forward_impl(x, temb));
}

torch::Tensor ResnetBlock2DImpl::forward_cat(const torch::Tensor& x, const torch::Tensor& skip,
                                             const torch::Tensor& temb) {
  const bool parts_fit = x.dim() == 4 && skip.dim() == 4 && x.size(0) == skip.size(0) &&
                         x.size(2) == skip.size(2) && x.size(3) == skip.size(3) &&
                         x.size(1) % 16 == 0 && skip.size(1) % 16 == 0 &&
                         x.scalar_type() == skip.scalar_type() && x.device() == skip.device();
  if (!parts_fit ||
      !blocked_applies(x, {x.size(0), x.size(1) + skip.size(1), x.size(2), x.size(3)})) {
    return forward(torch::cat({x, skip}, 1), temb);
  }
  core::ForwardScope scope(*this);
  last_forward_blocked_ = true;
  return scope.output(forward_blocked(cat_to_channel_blocks(x, skip), temb));
}

}  // namespace difftrain::models
