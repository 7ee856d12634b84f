#include "difftrain/models/fused_ops.h"

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
  const char* isa;
};

KernelTable pick_kernels() {
#if defined(DIFFTRAIN_HAVE_AVX2_KERNELS) && (defined(__x86_64__) || defined(__i386__))
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) {
    return {kernels::avx2::attention_forward, kernels::avx2::attention_backward,
            kernels::avx2::group_norm_forward, kernels::avx2::group_norm_backward, "avx2"};
  }
#endif
  return {kernels::generic::attention_forward, kernels::generic::attention_backward,
          kernels::generic::group_norm_forward, kernels::generic::group_norm_backward, "generic"};
}

const KernelTable& kernel_table() {
  static const KernelTable table = pick_kernels();
  return table;
}

constexpr int64_t kMaxFusedHeadDim = 64;

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

// x viewed as [N, C, L]; channels_last: its memory is [N, L, C].
kernels::GroupNormShape group_norm_shape(const torch::Tensor& x, int64_t groups, double eps,
                                         bool silu, bool channels_last) {
  const int64_t N = x.size(0), C = x.size(1);
  const int64_t L = C == 0 || N == 0 ? 0 : x.numel() / (N * C);
  return {N, C, L, groups, channels_last, static_cast<float>(eps), silu};
}

// weight and bias without affine are empty tensors (autograd::Function takes no undefined input).
const float* data_or_null(const torch::Tensor& t) {
  return t.defined() && t.numel() > 0 ? t.data_ptr<float>() : nullptr;
}

class FusedGroupNorm : public torch::autograd::Function<FusedGroupNorm> {
 public:
  // x: [N, C, *] dense (contiguous or channels-last, said by channels_last)
  static torch::Tensor forward(AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, const torch::Tensor& bias,
                               int64_t groups, double eps, bool silu, bool channels_last) {
    const auto s = group_norm_shape(x, groups, eps, silu, channels_last);
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
    return y;
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    const auto &x = saved[0], &w = saved[1], &b = saved[2], &mean = saved[3], &rstd = saved[4];
    const bool channels_last = ctx->saved_data["channels_last"].toBool();
    const auto s =
        group_norm_shape(x, ctx->saved_data["groups"].toInt(), ctx->saved_data["eps"].toDouble(),
                         ctx->saved_data["silu"].toBool(), channels_last);
    // The incoming gradient in x's memory layout ([N, *, C] memory when channels_last).
    const auto dy_dense =
        channels_last ? grads[0].movedim(1, -1).contiguous().movedim(-1, 1) : grads[0].contiguous();
    auto dx = torch::empty_like(x);
    auto dw = w.numel() > 0 ? torch::empty_like(w) : torch::Tensor();
    auto db = b.numel() > 0 ? torch::empty_like(b) : torch::Tensor();
    kernel_table().group_norm_backward(s, dy_dense.data_ptr<float>(), x.data_ptr<float>(),
                                       mean.data_ptr<float>(), rstd.data_ptr<float>(),
                                       data_or_null(w), data_or_null(b), dx.data_ptr<float>(),
                                       dw.defined() ? dw.data_ptr<float>() : nullptr,
                                       db.defined() ? db.data_ptr<float>() : nullptr);
    return {dx, dw, db, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
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
  if (x.is_contiguous()) return FusedGroupNorm::apply(x, w, b, groups, eps, silu, false);
  if (channels_innermost(x)) return FusedGroupNorm::apply(x, w, b, groups, eps, silu, true);
  return FusedGroupNorm::apply(x.contiguous(), w, b, groups, eps, silu, false);
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
