// Compiled with -fno-math-errno (see CMakeLists.txt) so that sqrt vectorises, and without the
// precompiled header (its flags differ).
#include "kernels.h"

#include "difftrain/optim/quantize.h"

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/types.h>

#include <algorithm>
#include <cmath>

namespace difftrain::optim::detail {
namespace {

constexpr int64_t kGrain = 1 << 15;  // elements per task: well above thread start-up cost

template <typename M>
struct Scalars {
  M decay;        // 1 − lr·wd
  M lerp_weight;  // 1 − β1
  M beta2;
  M one_minus_beta2;
  M bc2_sqrt;
  M eps;
  M neg_step_size;  // −lr / (1 − β1^t)
};

template <typename M>
Scalars<M> scalars_of(const Segment& s, const Betas& b) {
  return {static_cast<M>(1.0 - s.lr * s.weight_decay),
          static_cast<M>(1.0 - b.beta1),
          static_cast<M>(b.beta2),
          static_cast<M>(1.0 - b.beta2),
          static_cast<M>(s.bias_correction2_sqrt),
          static_cast<M>(b.eps),
          static_cast<M>(-(s.lr / s.bias_correction1))};
}

// The element-wise update, in torch.optim.AdamW's operation order (single-tensor path):
// mul_, lerp_, mul_().addcmul_(), sqrt()/c2 + eps, addcdiv_. torch's lerp switches formula
// at weight 0.5; `high_weight` selects the second form.
template <typename P, typename M, bool kAmsgrad>
__attribute__((always_inline)) inline void adamw_span(P* __restrict p, const P* __restrict g,
                                                      M* __restrict m, M* __restrict v,
                                                      M* __restrict vmax, int64_t n,
                                                      const Scalars<M>& s, bool high_weight) {
  for (int64_t i = 0; i < n; ++i) {
    const M gi = static_cast<M>(g[i]);
    const M pi = static_cast<M>(p[i]) * s.decay;
    const M mi = high_weight ? gi - (gi - m[i]) * (M(1) - s.lerp_weight)
                             : m[i] + s.lerp_weight * (gi - m[i]);
    const M vi = v[i] * s.beta2 + s.one_minus_beta2 * gi * gi;
    m[i] = mi;
    v[i] = vi;
    M vd = vi;
    if constexpr (kAmsgrad) {
      vd = vmax[i] > vi ? vmax[i] : vi;
      vmax[i] = vd;
    }
    const M denom = std::sqrt(vd) / s.bc2_sqrt + s.eps;
    p[i] = static_cast<P>(pi + s.neg_step_size * (mi / denom));
  }
}

// The fp32 loops get an AVX2 clone chosen at load time; the default clone runs anywhere.
__attribute__((target_clones("avx2", "default"))) void adamw_f32(float* p, const float* g, float* m,
                                                                 float* v, int64_t n,
                                                                 const Scalars<float>& s, bool hw) {
  adamw_span<float, float, false>(p, g, m, v, nullptr, n, s, hw);
}

__attribute__((target_clones("avx2", "default"))) void adamw_f32_amsgrad(float* p, const float* g,
                                                                         float* m, float* v,
                                                                         float* vmax, int64_t n,
                                                                         const Scalars<float>& s,
                                                                         bool hw) {
  adamw_span<float, float, true>(p, g, m, v, vmax, n, s, hw);
}

template <typename P, typename M>
void adamw_typed(const torch::Tensor& params, const torch::Tensor& exp_avg,
                 const torch::Tensor& exp_avg_sq, const torch::Tensor& max_exp_avg_sq,
                 const std::vector<Segment>& segments, const Betas& betas) {
  if (segments.empty()) return;
  P* p = static_cast<P*>(params.data_ptr());
  M* m = static_cast<M*>(exp_avg.data_ptr());
  M* v = static_cast<M*>(exp_avg_sq.data_ptr());
  M* vmax = max_exp_avg_sq.defined() ? static_cast<M*>(max_exp_avg_sq.data_ptr()) : nullptr;
  const bool high_weight = (1.0 - betas.beta1) >= 0.5;
  std::vector<int64_t> begins;
  begins.reserve(segments.size());
  for (const auto& s : segments) begins.push_back(s.begin);
  const int64_t total_begin = segments.front().begin, total_end = segments.back().end;
  at::parallel_for(total_begin, total_end, kGrain, [&](int64_t lo, int64_t hi) {
    // The segment containing `lo` (skipped parameters leave holes; they are jumped over).
    size_t k =
        static_cast<size_t>(std::upper_bound(begins.begin(), begins.end(), lo) - begins.begin());
    k = k == 0 ? 0 : k - 1;
    for (; k < segments.size() && segments[k].begin < hi; ++k) {
      const Segment& s = segments[k];
      const int64_t a = std::max(lo, s.begin), b = std::min(hi, s.end);
      if (a >= b) continue;
      const int64_t state = s.state_begin + (a - s.begin);
      const P* g = static_cast<const P*>(s.grad) + (a - s.begin);
      const auto sc = scalars_of<M>(s, betas);
      if constexpr (std::is_same_v<P, float>) {
        if (vmax) {
          adamw_f32_amsgrad(p + a, g, m + state, v + state, vmax + state, b - a, sc, high_weight);
        } else {
          adamw_f32(p + a, g, m + state, v + state, b - a, sc, high_weight);
        }
      } else if (vmax) {
        adamw_span<P, M, true>(p + a, g, m + state, v + state, vmax + state, b - a, sc,
                               high_weight);
      } else {
        adamw_span<P, M, false>(p + a, g, m + state, v + state, nullptr, b - a, sc, high_weight);
      }
    }
  });
}

}  // namespace

void adamw_cpu(const torch::Tensor& params, const torch::Tensor& exp_avg,
               const torch::Tensor& exp_avg_sq, const torch::Tensor& max_exp_avg_sq,
               const std::vector<Segment>& segments, const Betas& betas) {
  switch (params.scalar_type()) {
    case torch::kFloat32:
      return adamw_typed<float, float>(params, exp_avg, exp_avg_sq, max_exp_avg_sq, segments,
                                       betas);
    case torch::kFloat64:
      return adamw_typed<double, double>(params, exp_avg, exp_avg_sq, max_exp_avg_sq, segments,
                                         betas);
    case torch::kBFloat16:
      return adamw_typed<c10::BFloat16, float>(params, exp_avg, exp_avg_sq, max_exp_avg_sq,
                                               segments, betas);
    case torch::kFloat16:
      return adamw_typed<c10::Half, float>(params, exp_avg, exp_avg_sq, max_exp_avg_sq, segments,
                                           betas);
    default:
      TORCH_CHECK(false, "AdamW: parameters of dtype ", params.scalar_type(),
                  " cannot be optimised; use a floating-point dtype");
  }
}

void adamw_reference(const torch::Tensor& params, const torch::Tensor& exp_avg,
                     const torch::Tensor& exp_avg_sq, const torch::Tensor& max_exp_avg_sq,
                     const std::vector<Segment>& segments, const Betas& betas) {
  torch::NoGradGuard no_grad;
  for (const auto& s : segments) {
    const int64_t n = s.end - s.begin;
    auto p = params.narrow(0, s.begin, n);
    auto m = exp_avg.narrow(0, s.state_begin, n);
    auto v = exp_avg_sq.narrow(0, s.state_begin, n);
    auto g =
        torch::from_blob(const_cast<void*>(s.grad), {n},
                         torch::TensorOptions().dtype(params.scalar_type()).device(params.device()))
            .to(m.scalar_type());
    auto pm = p.to(m.scalar_type());
    pm.mul_(1.0 - s.lr * s.weight_decay);
    m.lerp_(g, 1.0 - betas.beta1);
    v.mul_(betas.beta2).addcmul_(g, g, 1.0 - betas.beta2);
    torch::Tensor denom;
    if (max_exp_avg_sq.defined()) {
      auto vmax = max_exp_avg_sq.narrow(0, s.state_begin, n);
      torch::maximum_out(vmax, vmax, v);
      denom = (vmax.sqrt() / s.bias_correction2_sqrt).add_(betas.eps);
    } else {
      denom = (v.sqrt() / s.bias_correction2_sqrt).add_(betas.eps);
    }
    pm.addcdiv_(m, denom, -(s.lr / s.bias_correction1));
    p.copy_(pm);
  }
}

namespace {

template <typename P>
void adamw8bit_typed(const torch::Tensor& params, const torch::Tensor& codes1,
                     const torch::Tensor& absmax1, const torch::Tensor& codes2,
                     const torch::Tensor& absmax2, const std::vector<Segment>& segments,
                     const Betas& betas, int64_t block) {
  if (segments.empty()) return;
  P* p = static_cast<P*>(params.data_ptr());
  uint8_t* c1 = codes1.data_ptr<uint8_t>();
  uint8_t* c2 = codes2.data_ptr<uint8_t>();
  float* a1 = absmax1.data_ptr<float>();
  float* a2 = absmax2.data_ptr<float>();
  const auto& map1 = dynamic_code_map(true);
  const auto& map2 = dynamic_code_map(false);
  const uint8_t zero1 = quantize_nearest(0.0f, true), zero2 = quantize_nearest(0.0f, false);
  // Tasks are (segment, block) pairs, numbered through all segments.
  std::vector<int64_t> first_task{0};
  for (const auto& s : segments)
    first_task.push_back(first_task.back() + (s.end - s.begin + block - 1) / block);
  const float beta1 = static_cast<float>(betas.beta1), beta2 = static_cast<float>(betas.beta2);
  at::parallel_for(
      0, first_task.back(), std::max<int64_t>(1, kGrain / block), [&](int64_t t0, int64_t t1) {
        std::vector<float> s1(block), s2(block);
        for (int64_t t = t0; t < t1; ++t) {
          const size_t k = static_cast<size_t>(
              std::upper_bound(first_task.begin(), first_task.end(), t) - first_task.begin() - 1);
          const Segment& s = segments[k];
          const int64_t blk = t - first_task[k];
          const int64_t off = blk * block, n = std::min(block, s.end - s.begin - off);
          const int64_t q = s.block_begin + blk;
          P* pp = p + s.begin + off;
          const P* g = static_cast<const P*>(s.grad) + off;
          uint8_t* q1 = c1 + s.state_begin + off;
          uint8_t* q2 = c2 + s.state_begin + off;
          const float old1 = a1[q], old2 = a2[q];
          const float c2s = static_cast<float>(s.bias_correction2_sqrt);
          const float step_size =
              static_cast<float>(-s.lr * s.bias_correction2_sqrt / s.bias_correction1);
          const float decay = static_cast<float>(1.0 - s.lr * s.weight_decay);
          const float eps = static_cast<float>(betas.eps) * c2s;
          float new1 = 0.0f, new2 = 0.0f;
          for (int64_t i = 0; i < n; ++i) {
            const float gi = static_cast<float>(g[i]);
            const float m = map1[q1[i]] * old1 * beta1 + (1.0f - beta1) * gi;
            const float v = map2[q2[i]] * old2 * beta2 + (1.0f - beta2) * gi * gi;
            s1[i] = m;
            s2[i] = v;
            new1 = std::max(new1, std::fabs(m));
            new2 = std::max(new2, v);
            float pi = static_cast<float>(pp[i]);
            if (s.weight_decay > 0) pi *= decay;
            pp[i] = static_cast<P>(pi + step_size * (m / (std::sqrt(v) + eps)));
          }
          a1[q] = new1;
          a2[q] = new2;
          const float inv1 = new1 > 0 ? 1.0f / new1 : 0.0f, inv2 = new2 > 0 ? 1.0f / new2 : 0.0f;
          for (int64_t i = 0; i < n; ++i) {
            q1[i] = new1 > 0 ? quantize_nearest(s1[i] * inv1, true) : zero1;
            q2[i] = new2 > 0 ? quantize_nearest(s2[i] * inv2, false) : zero2;
          }
        }
      });
}

}  // namespace

void adamw8bit_cpu(const torch::Tensor& params, const torch::Tensor& codes1,
                   const torch::Tensor& absmax1, const torch::Tensor& codes2,
                   const torch::Tensor& absmax2, const std::vector<Segment>& segments,
                   const Betas& betas, int64_t block) {
  switch (params.scalar_type()) {
    case torch::kFloat32:
      return adamw8bit_typed<float>(params, codes1, absmax1, codes2, absmax2, segments, betas,
                                    block);
    case torch::kBFloat16:
      return adamw8bit_typed<c10::BFloat16>(params, codes1, absmax1, codes2, absmax2, segments,
                                            betas, block);
    case torch::kFloat16:
      return adamw8bit_typed<c10::Half>(params, codes1, absmax1, codes2, absmax2, segments, betas,
                                        block);
    default:
      TORCH_CHECK(false, "AdamW8bit: parameters of dtype ", params.scalar_type(),
                  " are not supported; use float32, bfloat16 or float16");
  }
}

}  // namespace difftrain::optim::detail
