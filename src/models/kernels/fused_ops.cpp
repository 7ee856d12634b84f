#include "difftrain/models/kernels/fused_ops.h"

#include "difftrain/core/env.h"

#include "difftrain/models/layers.h"
#include "fused_kernels.h"

#include <torch/autograd.h>
#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/normalization.h>

#include <cstdlib>
#include <cstring>

namespace difftrain::models {

namespace {

struct KernelTable {
  decltype(&kernels::generic::attention_forward) attention_forward;
  decltype(&kernels::generic::attention_backward) attention_backward;
  decltype(&kernels::generic::group_norm_forward) group_norm_forward;
  decltype(&kernels::generic::group_norm_backward) group_norm_backward;
  decltype(&kernels::generic::small_conv_forward) small_conv_forward;
  decltype(&kernels::generic::small_conv_backward_data) small_conv_backward_data;
  decltype(&kernels::generic::small_conv_backward_weights) small_conv_backward_weights;
  decltype(&kernels::generic::gelu_forward) gelu_forward;
  decltype(&kernels::generic::gelu_backward) gelu_backward;
  decltype(&kernels::generic::attention_softmax_bf16) attention_softmax_bf16;
  decltype(&kernels::generic::attention_softmax_backward_bf16) attention_softmax_backward_bf16;
  const char* isa;
};

KernelTable pick_kernels() {
#if defined(DIFFTRAIN_HAVE_AVX2_KERNELS) && (defined(__x86_64__) || defined(__i386__))
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return {kernels::avx2::attention_forward,
            kernels::avx2::attention_backward,
            kernels::avx2::group_norm_forward,
            kernels::avx2::group_norm_backward,
            kernels::avx2::small_conv_forward,
            kernels::avx2::small_conv_backward_data,
            kernels::avx2::small_conv_backward_weights,
            kernels::avx2::gelu_forward,
            kernels::avx2::gelu_backward,
            kernels::avx2::attention_softmax_bf16,
            kernels::avx2::attention_softmax_backward_bf16,
            "avx2"};
  }
#endif
  return {kernels::generic::attention_forward,
          kernels::generic::attention_backward,
          kernels::generic::group_norm_forward,
          kernels::generic::group_norm_backward,
          kernels::generic::small_conv_forward,
          kernels::generic::small_conv_backward_data,
          kernels::generic::small_conv_backward_weights,
          kernels::generic::gelu_forward,
          kernels::generic::gelu_backward,
          kernels::generic::attention_softmax_bf16,
          kernels::generic::attention_softmax_backward_bf16,
          "generic"};
}

const KernelTable& kernel_table() {
  static const KernelTable table = pick_kernels();
  return table;
}

constexpr int64_t kMaxFusedHeadDim = 64;
constexpr int64_t kChannelBlock = 16;
// Up to a latent's 4 channels; measured on AVX-512 (oneDNN 2.6), oneDNN's direct convolution is
// faster again from 16 output channels.
constexpr int64_t kSmallConvMaxOutChannels = 4;

// -1: not read yet; 0 off; 1 on
EnvSwitch g_enabled("DIFFTRAIN_FUSED_KERNELS", true);

bool fusable(const torch::Tensor& t) {
  return t.defined() && t.device().is_cpu() && t.scalar_type() == torch::kFloat32 &&
         t.layout() == torch::kStrided;
}

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

kernels::AttentionShape attention_shape(const torch::Tensor& q, const torch::Tensor& k,
                                        int64_t heads, double scale) {
  return {q.size(0), q.size(1), k.size(1), heads, q.size(2) / heads, static_cast<float>(scale)};
}

class FusedAttention : public torch::autograd::Function<FusedAttention> {
 public:
  // q: [B, N, h*d], k, v: [B, S, h*d] (contiguous) -> [B, N, h*d]
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& q, const torch::Tensor& k,
                               const torch::Tensor& v, int64_t heads, double scale) {
    const auto s = attention_shape(q, k, heads, scale);
    auto out = torch::empty_like(q);
    auto lse = torch::empty({s.batch, heads, s.queries}, q.options());
    kernel_table().attention_forward(s, q.data_ptr<float>(), k.data_ptr<float>(),
                                     v.data_ptr<float>(), out.data_ptr<float>(),
                                     lse.data_ptr<float>());
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["heads"] = heads;
    ctx->saved_data["scale"] = scale;
    return out;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &out = saved[3], &lse = saved[4];
    const int64_t heads = ctx->saved_data["heads"].toInt();
    const auto s = attention_shape(q, k, heads, ctx->saved_data["scale"].toDouble());
    const auto dout = grads[0].contiguous();
    auto dq = torch::empty_like(q), dk = torch::empty_like(k), dv = torch::empty_like(v);
    kernel_table().attention_backward(
        s, q.data_ptr<float>(), k.data_ptr<float>(), v.data_ptr<float>(), out.data_ptr<float>(),
        lse.data_ptr<float>(), dout.data_ptr<float>(), dq.data_ptr<float>(), dk.data_ptr<float>(),
        dv.data_ptr<float>());
    return {dq, dk, dv, torch::Tensor(), torch::Tensor()};
  }
};

// GELU in one pass each way over a dense float32 or bf16 tensor (computed in float32, rounded
// once); the backward reads x and the incoming gradient only.
class FusedGelu : public torch::autograd::Function<FusedGelu> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               bool tanh_approximation) {
    const auto xc = x.contiguous();
    auto y = torch::empty_like(xc);
    kernel_table().gelu_forward(xc.data_ptr(), y.data_ptr(), xc.numel(),
                                xc.scalar_type() == torch::kBFloat16, tanh_approximation);
    ctx->save_for_backward({xc});
    ctx->saved_data["tanh"] = tanh_approximation;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto x = ctx->get_saved_variables()[0];
    const auto dy = grads[0].to(x.scalar_type()).contiguous();
    auto dx = torch::empty_like(x);
    kernel_table().gelu_backward(dy.data_ptr(), x.data_ptr(), dx.data_ptr(), x.numel(),
                                 x.scalar_type() == torch::kBFloat16,
                                 ctx->saved_data["tanh"].toBool());
    return {dx, torch::Tensor()};
  }
};

// x viewed as [N, C, L]; channels_last: its memory is [N, L, C]; block > 0: x is
// [N, C / block, *, block].
kernels::GroupNormShape group_norm_shape(const torch::Tensor& x, int64_t groups, double eps,
                                         bool silu, bool channels_last, int64_t block) {
  const int64_t N = x.size(0), C = block > 0 ? x.size(1) * block : x.size(1);
  const int64_t L = C == 0 || N == 0 ? 0 : x.numel() / (N * C);
  return {N, C, L, groups, channels_last, static_cast<float>(eps), silu, block};
}

// weight and bias without affine are empty tensors (autograd::Function takes no undefined input).
const float* data_or_null(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<float>() : nullptr;
}

// The fused GroupNorm (+ SiLU) forward and backward, shared by the two Functions below.
// x: [N, C, *] dense (contiguous or channels-last, said by channels_last), or with block > 0
// [N, C / block, *, block] contiguous
torch::Tensor group_norm_forward_saving(AutogradContext* ctx, const torch::Tensor& x,
                                        const torch::Tensor& weight, const torch::Tensor& bias,
                                        int64_t groups, double eps, bool silu, bool channels_last,
                                        int64_t block) {
  const auto s = group_norm_shape(x, groups, eps, silu, channels_last, block);
  auto y = torch::empty_like(x);  // keeps x's strides (dense either way)
  auto mean = torch::empty({s.batch, groups}, x.options());
  auto rstd = torch::empty({s.batch, groups}, x.options());
  auto w = weight.contiguous();
  auto b = bias.contiguous();
  kernel_table().group_norm_forward(s, x.data_ptr<float>(), data_or_null(w), data_or_null(b),
                                    y.data_ptr<float>(), mean.data_ptr<float>(),
                                    rstd.data_ptr<float>());
  ctx->save_for_backward({x, w, b, mean, rstd});
  ctx->saved_data["groups"] = groups;
  ctx->saved_data["eps"] = eps;
  ctx->saved_data["silu"] = silu;
  ctx->saved_data["channels_last"] = channels_last;
  ctx->saved_data["block"] = block;
  return y;
}

// {dx, dweight, dbias}; dx_add (undefined, or a gradient in x's layout) is added to dx.
variable_list group_norm_backward_saved(AutogradContext* ctx, const torch::Tensor& dy,
                                        const torch::Tensor& dx_add) {
  const auto saved = ctx->get_saved_variables();
  const auto &x = saved[0], &w = saved[1], &b = saved[2], &mean = saved[3], &rstd = saved[4];
  const bool channels_last = ctx->saved_data["channels_last"].toBool();
  const auto s = group_norm_shape(
      x, ctx->saved_data["groups"].toInt(), ctx->saved_data["eps"].toDouble(),
      ctx->saved_data["silu"].toBool(), channels_last, ctx->saved_data["block"].toInt());
  // The incoming gradients in x's memory layout ([N, *, C] memory when channels_last).
  const auto dense = [&](const torch::Tensor& g) {
    return channels_last ? g.movedim(1, -1).contiguous().movedim(-1, 1) : g.contiguous();
  };
  const auto dy_dense = dense(dy.defined() ? dy : torch::zeros_like(x));
  const auto add_dense = dx_add.defined() ? dense(dx_add) : torch::Tensor();
  auto dx = torch::empty_like(x);
  auto dw = w.numel() > 0 ? torch::empty_like(w) : torch::Tensor();
  auto db = b.numel() > 0 ? torch::empty_like(b) : torch::Tensor();
  kernel_table().group_norm_backward(
      s, dy_dense.data_ptr<float>(), x.data_ptr<float>(), mean.data_ptr<float>(),
      rstd.data_ptr<float>(), data_or_null(w), data_or_null(b), dx.data_ptr<float>(),
      dw.defined() ? dw.data_ptr<float>() : nullptr, db.defined() ? db.data_ptr<float>() : nullptr,
      add_dense.defined() ? add_dense.data_ptr<float>() : nullptr);
  return {dx, dw, db};
}

class FusedGroupNorm : public torch::autograd::Function<FusedGroupNorm> {
 public:
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               int64_t groups, double eps, bool silu, bool channels_last,
                               int64_t block) {
    return group_norm_forward_saving(ctx, x, weight, bias, groups, eps, silu, channels_last, block);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = group_norm_backward_saved(ctx, grads[0], torch::Tensor());
    g.resize(8);  // groups, eps, silu, channels_last, block: no gradient
    return g;
  }
};

// The same GroupNorm on a blocked x, also handing x on as a second output: when x's other
// consumer (a residual add, a shortcut convolution) takes that output, both gradients come back
// to this node and the backward adds them in its last pass. Otherwise autograd would add them
// itself: a separate read of both and a new tensor per ResnetBlock2D.
class FusedGroupNormPassInput : public torch::autograd::Function<FusedGroupNormPassInput> {
 public:
  static variable_list forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               int64_t groups, double eps, bool silu, int64_t block) {
    auto y = group_norm_forward_saving(ctx, x, weight, bias, groups, eps, silu, false, block);
    return {y, x};  // (autograd hands x on as a view with this node's history)
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto g = group_norm_backward_saved(ctx, grads[0], grads[1]);
    g.resize(7);  // groups, eps, silu, block: no gradient
    return g;
  }
};

// x.contiguous() whose gradient goes back in channels-last memory, so that a channels-last network
// also runs its backward in channels-last (the loss's gradient arrives contiguous).
class ContiguousChannelsLastGrad : public torch::autograd::Function<ContiguousChannelsLastGrad> {
 public:
  static torch::Tensor forward(AutogradContext*, const torch::Tensor& x) { return x.contiguous(); }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0].contiguous(at::MemoryFormat::ChannelsLast)};
  }
};

kernels::SmallConvShape small_conv_shape(const torch::Tensor& x, const torch::Tensor& weight,
                                         int64_t padding) {
  return {x.size(0), x.size(1), weight.size(0), x.size(2), x.size(3), padding};
}

class SmallConv : public torch::autograd::Function<SmallConv> {
 public:
  // x: [N, C, H, W], weight: [O, C, 3, 3], bias: [O] or [0] (none), all contiguous
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               int64_t padding) {
    const auto s = small_conv_shape(x, weight, padding);
    auto y = torch::empty(
        {s.batch, s.out_channels, s.height + 2 * padding - 2, s.width + 2 * padding - 2},
        x.options());
    kernel_table().small_conv_forward(s, x.data_ptr<float>(), weight.data_ptr<float>(),
                                      data_or_null(bias), y.data_ptr<float>());
    // The input only for the weight and bias gradients (frozen layers do not keep it).
    const bool needs_x = weight.requires_grad() || (bias.numel() > 0 && bias.requires_grad());
    ctx->save_for_backward({needs_x ? x : torch::Tensor(), weight});
    ctx->saved_data["padding"] = padding;
    ctx->saved_data["x_sizes"] = x.sizes().vec();
    ctx->saved_data["bias"] = bias.numel() > 0;
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &weight = saved[1];
    const auto xs = ctx->saved_data["x_sizes"].toIntVector();
    const int64_t padding = ctx->saved_data["padding"].toInt();
    const kernels::SmallConvShape s{xs[0], xs[1], weight.size(0), xs[2], xs[3], padding};
    const auto gy = grads[0].contiguous();
    torch::Tensor gx, gw, gb;
    if (ctx->needs_input_grad(0)) {
      gx = torch::empty(xs, weight.options());
      kernel_table().small_conv_backward_data(s, gy.data_ptr<float>(), weight.data_ptr<float>(),
                                              gx.data_ptr<float>());
    }
    const bool has_bias = ctx->saved_data["bias"].toBool();
    if (ctx->needs_input_grad(1) || (has_bias && ctx->needs_input_grad(2))) {
      gw = torch::empty_like(weight);
      if (has_bias) gb = torch::empty({weight.size(0)}, weight.options());
      kernel_table().small_conv_backward_weights(s, gy.data_ptr<float>(), x.data_ptr<float>(),
                                                 gw.data_ptr<float>(),
                                                 gb.defined() ? gb.data_ptr<float>() : nullptr);
      if (!ctx->needs_input_grad(1)) gw = torch::Tensor();
    }
    return {gx, gw, gb, torch::Tensor()};
  }
};

// Whether x ([N, C, *]) is dense with channels innermost: [N, *, C] memory.
bool channels_innermost(const torch::Tensor& x) {
  return x.dim() >= 3 && x.movedim(1, -1).is_contiguous();
}

}  // namespace

bool fused_kernels_enabled() { return g_enabled.get(); }

void set_fused_kernels_enabled(bool enabled) { g_enabled.set(enabled); }

std::string fused_kernels_isa() { return kernel_table().isa; }

torch::Tensor fused_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, int64_t heads, double scale) {
  if (!fused_kernels_enabled() || !fusable(q) || !fusable(k) || !fusable(v)) return {};
  if (q.dim() != 3 || k.dim() != 3 || v.sizes() != k.sizes() || q.size(0) != k.size(0) ||
      q.size(2) != k.size(2) || heads <= 0 || q.size(2) % heads != 0 || k.size(1) == 0) {
    return {};
  }
  // Row by row over keys transposed per head, the kernel beats batched GEMMs + softmax while a
  // head's keys stay in cache; wide heads (the VAE's single 512-wide head) go to the GEMMs.
  if (q.size(2) / heads > kMaxFusedHeadDim) return {};
  return FusedAttention::apply(q.contiguous(), k.contiguous(), v.contiguous(), heads, scale);
}

torch::Tensor fused_gelu(const torch::Tensor& x, bool tanh_approximation) {
  if (!fused_kernels_enabled() || !x.defined() || !x.device().is_cpu() ||
      x.layout() != torch::kStrided || x.scalar_type() != torch::kBFloat16 || x.numel() == 0) {
    return {};
  }
  return FusedGelu::apply(x, tanh_approximation);
}

namespace {

// The kernels' shape for bf16 scores [n, rows, S] and a mask [n or 1, 1, S] (bool) or undefined;
// `mask_bytes` keeps the mask's uint8 copy alive.
kernels::AttentionSoftmaxShape attention_softmax_shape(const torch::Tensor& scores, double scale,
                                                       const torch::Tensor& masked,
                                                       torch::Tensor& mask_bytes) {
  kernels::AttentionSoftmaxShape s{
      scores.size(0), scores.size(1), scores.size(2), static_cast<float>(scale), nullptr, 0};
  if (masked.defined()) {
    mask_bytes = masked.to(torch::kUInt8).contiguous();
    s.mask = mask_bytes.data_ptr<uint8_t>();
    s.mask_head_stride = mask_bytes.size(0) == 1 ? 0 : s.cols;
  }
  return s;
}

bool attention_softmax_applies(const torch::Tensor& scores, const torch::Tensor& masked) {
  return fused_kernels_enabled() && scores.device().is_cpu() && scores.dim() == 3 &&
         scores.scalar_type() == torch::kBFloat16 && scores.is_contiguous() && scores.numel() > 0 &&
         (!masked.defined() ||
          (masked.dim() == 3 && masked.size(1) == 1 && masked.size(2) == scores.size(2) &&
           (masked.size(0) == 1 || masked.size(0) == scores.size(0))));
}

uint16_t* bits(const torch::Tensor& t) { return static_cast<uint16_t*>(t.data_ptr()); }

}  // namespace

torch::Tensor attention_softmax_bf16(const torch::Tensor& scores, double scale,
                                     const torch::Tensor& masked) {
  if (!attention_softmax_applies(scores, masked)) return {};
  torch::Tensor mask_bytes;
  const auto s = attention_softmax_shape(scores, scale, masked, mask_bytes);
  auto probs = torch::empty_like(scores);
  kernel_table().attention_softmax_bf16(s, bits(scores), bits(probs));
  return probs;
}

std::pair<torch::Tensor, torch::Tensor> attention_softmax_backward_bf16(
    const torch::Tensor& scores, const torch::Tensor& dprobs, double scale,
    const torch::Tensor& masked) {
  if (!attention_softmax_applies(scores, masked) || !dprobs.defined() ||
      dprobs.sizes() != scores.sizes() || dprobs.scalar_type() != torch::kBFloat16 ||
      !dprobs.device().is_cpu()) {
    return {};
  }
  torch::Tensor mask_bytes;
  const auto s = attention_softmax_shape(scores, scale, masked, mask_bytes);
  const auto dp = dprobs.contiguous();
  auto probs = torch::empty_like(scores), ds = torch::empty_like(scores);
  kernel_table().attention_softmax_backward_bf16(s, bits(scores), bits(dp), bits(probs), bits(ds));
  return {probs, ds};
}

torch::Tensor group_norm_silu(const torch::Tensor& x, int64_t groups, const torch::Tensor& weight,
                              const torch::Tensor& bias, double eps, bool silu) {
  const bool fuse = fused_kernels_enabled() && fusable(x) && x.dim() >= 2 && groups > 0 &&
                    x.size(1) % groups == 0 && (!weight.defined() || fusable(weight)) &&
                    (!bias.defined() || fusable(bias));
  if (!fuse) {
    auto y = torch::group_norm(x, groups, weight, bias, eps);
    return silu ? torch::silu(y) : y;
  }
  const auto none = torch::empty({0}, x.options());
  const auto& w = weight.defined() ? weight : none;
  const auto& b = bias.defined() ? bias : none;
  if (x.is_contiguous()) return FusedGroupNorm::apply(x, w, b, groups, eps, silu, false, 0);
  if (channels_innermost(x)) return FusedGroupNorm::apply(x, w, b, groups, eps, silu, true, 0);
  return FusedGroupNorm::apply(x.contiguous(), w, b, groups, eps, silu, false, 0);
}

namespace {
bool group_norm_silu_blocked_applies(const torch::Tensor& x, int64_t groups,
                                     const torch::Tensor& weight, const torch::Tensor& bias) {
  return fused_kernels_enabled() && fusable(x) && x.dim() >= 3 && x.size(-1) == kChannelBlock &&
         groups > 0 && (x.size(1) * kChannelBlock) % groups == 0 &&
         (!weight.defined() || (fusable(weight) && weight.numel() == x.size(1) * kChannelBlock)) &&
         (!bias.defined() || (fusable(bias) && bias.numel() == x.size(1) * kChannelBlock));
}
}  // namespace

torch::Tensor group_norm_silu_blocked(const torch::Tensor& x, int64_t groups,
                                      const torch::Tensor& weight, const torch::Tensor& bias,
                                      double eps, bool silu) {
  if (!group_norm_silu_blocked_applies(x, groups, weight, bias)) return {};
  const auto none = torch::empty({0}, x.options());
  return FusedGroupNorm::apply(x.contiguous(), weight.defined() ? weight : none,
                               bias.defined() ? bias : none, groups, eps, silu, false,
                               kChannelBlock);
}

std::pair<torch::Tensor, torch::Tensor> group_norm_silu_blocked_pass_input(
    const torch::Tensor& x, int64_t groups, const torch::Tensor& weight, const torch::Tensor& bias,
    double eps, bool silu) {
  if (!group_norm_silu_blocked_applies(x, groups, weight, bias)) return {};
  const auto none = torch::empty({0}, x.options());
  auto out = FusedGroupNormPassInput::apply(x.contiguous(), weight.defined() ? weight : none,
                                            bias.defined() ? bias : none, groups, eps, silu,
                                            kChannelBlock);
  return {out[0], out[1]};
}

torch::Tensor small_out_conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias, int64_t padding) {
  if (!fused_kernels_enabled() || !fusable(x) || !fusable(weight) || x.dim() != 4 ||
      weight.dim() != 4 || weight.size(0) > kSmallConvMaxOutChannels || weight.size(2) != 3 ||
      weight.size(3) != 3 || weight.size(1) != x.size(1) || (padding != 0 && padding != 1) ||
      x.size(2) + 2 * padding < 3 || x.size(3) + 2 * padding < 3 || x.numel() == 0 ||
      weight.numel() == 0) {
    return {};
  }
  if (bias.defined() && (!fusable(bias) || bias.dim() != 1 || bias.size(0) != weight.size(0))) {
    return {};
  }
  const auto b = bias.defined() ? bias.contiguous() : torch::empty({0}, weight.options());
  return SmallConv::apply(x.contiguous(), weight.contiguous(), b, padding);
}

torch::Tensor group_norm_act(const torch::nn::GroupNormImpl& norm, const std::string& act,
                             const torch::Tensor& x) {
  const auto& o = norm.options;
  const bool silu = act == "silu" || act == "swish";
  auto y = group_norm_silu(x, o.num_groups(), norm.weight, norm.bias, o.eps(), silu);
  return silu || act.empty() ? y : activation(act, y);
}

torch::Tensor leave_channels_last(const torch::Tensor& x) {
  if (!torch::GradMode::is_enabled() || !x.requires_grad()) return x.contiguous();
  return ContiguousChannelsLastGrad::apply(x);
}

bool use_channels_last(const torch::Tensor& sample) {
  // Opt-in (DIFFTRAIN_CHANNELS_LAST=1): measured on LibTorch 1.13 + oneDNN 2.6 it did not speed
  // up the default UNet's step (docs/PERFORMANCE.md), though the layout is supported end to end.
  static const bool wanted = [] {
    const char* env = std::getenv("DIFFTRAIN_CHANNELS_LAST");
    return env != nullptr && std::strcmp(env, "1") == 0;
  }();
  return wanted && fused_kernels_enabled() && sample.dim() == 4 && fusable(sample);
}

}  // namespace difftrain::models
