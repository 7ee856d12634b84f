// Sigma tables of the sigma-based samplers, in the dtypes Diffusers 0.31 uses (see the header).

#include "sigma_schedule.h"

#include "difftrain/core/error.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace difftrain::diffusion::detail {

std::vector<float> sigmas_from_alphas_cumprod(const torch::Tensor& alphas_cumprod) {
  const torch::Tensor ac = alphas_cumprod.to(torch::kCPU, torch::kFloat32).contiguous();
  // torch: ((1 - ac) / ac) ** 0.5, three float32 kernels.
  const torch::Tensor sigmas = ((1 - ac) / ac).pow(0.5).contiguous();
  const float* p = sigmas.data_ptr<float>();
  return std::vector<float>(p, p + sigmas.numel());
}

std::vector<float> log_float32(const std::vector<float>& values) {
  std::vector<float> out(values.size());
  for (size_t i = 0; i < values.size(); ++i) out[i] = std::log(values[i]);
  return out;
}

std::vector<double> linspace(double start, double stop, int64_t n) {
  std::vector<double> out;
  if (n <= 0) return out;
  out.resize(static_cast<size_t>(n));
  if (n == 1) {
    out[0] = start;
    return out;
  }
  const double step = (stop - start) / static_cast<double>(n - 1);
  for (int64_t i = 0; i < n; ++i) out[static_cast<size_t>(i)] = static_cast<double>(i) * step + start;
  out.back() = stop;
  return out;
}

std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int64_t n) {
  constexpr double kRho = 7.0;
  const std::vector<double> ramp = linspace(0.0, 1.0, n);
  const double min_inv_rho = std::pow(sigma_min, 1.0 / kRho);
  const double max_inv_rho = std::pow(sigma_max, 1.0 / kRho);
  std::vector<double> out(ramp.size());
  for (size_t i = 0; i < ramp.size(); ++i) {
    out[i] = std::pow(max_inv_rho + ramp[i] * (min_inv_rho - max_inv_rho), kRho);
  }
  return out;
}

double sigma_to_t(double sigma, const std::vector<float>& log_sigmas) {
  const int64_t n = static_cast<int64_t>(log_sigmas.size());
  if (n < 2) throw Error("sigma_to_t: needs at least 2 training timesteps");
  const double log_sigma = std::log(std::max(sigma, 1e-10));
  // argmax of cumsum(dists >= 0): the last index whose log sigma is <= log(sigma) (the first of
  // equal maxima, as argmax picks), 0 when none is; clipped to n - 2.
  int64_t count = 0, best = 0, low_idx = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (log_sigma - static_cast<double>(log_sigmas[static_cast<size_t>(i)]) >= 0) ++count;
    if (count > best) {
      best = count;
      low_idx = i;
    }
  }
  low_idx = std::min(low_idx, n - 2);
  const int64_t high_idx = low_idx + 1;
  const float low = log_sigmas[static_cast<size_t>(low_idx)];
  const float high = log_sigmas[static_cast<size_t>(high_idx)];
  // (low - log_sigma) is float64; (low - high) is float32 (both operands float32 in numpy).
  const float low_minus_high = low - high;
  double w = (static_cast<double>(low) - log_sigma) / static_cast<double>(low_minus_high);
  w = std::clamp(w, 0.0, 1.0);
  return (1 - w) * static_cast<double>(low_idx) + w * static_cast<double>(high_idx);
}

std::vector<double> interp_on_index(const std::vector<double>& x, const std::vector<float>& fp) {
  const int64_t n = static_cast<int64_t>(fp.size());
  std::vector<double> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    const double xi = x[i];
    if (n == 0) throw Error("interp: empty table");
    if (!(xi > 0)) {
      out[i] = fp.front();
    } else if (xi >= static_cast<double>(n - 1)) {
      out[i] = fp.back();
    } else {
      const auto j = static_cast<int64_t>(std::floor(xi));
      const double lo = fp[static_cast<size_t>(j)], hi = fp[static_cast<size_t>(j + 1)];
      // numpy: slope * (x - xp[j]) + fp[j], slope = (fp[j+1] - fp[j]) / (xp[j+1] - xp[j]).
      const double slope = hi - lo;
      out[i] = slope * (xi - static_cast<double>(j)) + lo;
      if (xi == static_cast<double>(j)) out[i] = lo;
    }
  }
  return out;
}

}  // namespace difftrain::diffusion::detail
