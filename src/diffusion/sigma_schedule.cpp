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
  for (int64_t i = 0; i < n; ++i)
    out[static_cast<size_t>(i)] = static_cast<double>(i) * step + start;
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
  // numpy 1.x value-based casting: log_sigma is a float64 *scalar* and log_sigmas a float32
  // array, so dists = log_sigma - log_sigmas[:, None] and low - log_sigma are float32 ops with
  // log_sigma rounded to float32 first (what Diffusers' fixtures were made with).
  const auto log_sigma32 = static_cast<float>(log_sigma);
  // argmax of cumsum(dists >= 0): the last index whose log sigma is <= log(sigma) (the first of
  // equal maxima, as argmax picks), 0 when none is; clipped to n - 2.
  int64_t count = 0, best = 0, low_idx = 0;
  for (int64_t i = 0; i < n; ++i) {
    if (log_sigma32 - log_sigmas[static_cast<size_t>(i)] >= 0.0f) ++count;
    if (count > best) {
      best = count;
      low_idx = i;
    }
  }
  low_idx = std::min(low_idx, n - 2);
  const int64_t high_idx = low_idx + 1;
  const float low = log_sigmas[static_cast<size_t>(low_idx)];
  const float high = log_sigmas[static_cast<size_t>(high_idx)];
  float w = (low - log_sigma32) / (low - high);
  w = std::clamp(w, 0.0f, 1.0f);
  // (1 - w) is float32; times the int64 index arrays it becomes float64.
  const float one_minus_w = 1.0f - w;
  return static_cast<double>(one_minus_w) * static_cast<double>(low_idx) +
         static_cast<double>(w) * static_cast<double>(high_idx);
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

std::vector<float> spaced_float_timesteps(int64_t T, int64_t n, TimestepSpacing spacing,
                                          int64_t steps_offset, const std::string& who) {
  if (n < 1) {
    throw Error(who + ": num_inference_steps is " + std::to_string(n) + "; it must be at least 1");
  }
  std::vector<float> out;
  switch (spacing) {
    case TimestepSpacing::kLinspace: {
      const std::vector<double> values = linspace(0.0, static_cast<double>(T - 1), n);
      for (auto it = values.rbegin(); it != values.rend(); ++it)
        out.push_back(static_cast<float>(*it));
      break;
    }
    case TimestepSpacing::kLeading: {
      if (n > T) {
        throw Error(who + ": num_inference_steps is " + std::to_string(n) +
                    ", more than num_train_timesteps = " + std::to_string(T) +
                    "; \"leading\" spacing needs at most that many steps (use fewer steps)");
      }
      const int64_t ratio = T / n;
      for (int64_t i = n - 1; i >= 0; --i) {
        // float32 timesteps += steps_offset (exact for these integers)
        out.push_back(static_cast<float>(i * ratio) + static_cast<float>(steps_offset));
      }
      break;
    }
    case TimestepSpacing::kTrailing: {
      // numpy's float arange(T, 0, -ratio): length ceil(-T / -ratio), element i (i >= 2) is
      // start + i * (second - start); rounded half to even, cast to float32, then minus 1.
      const double ratio = static_cast<double>(T) / static_cast<double>(n);
      const double start = static_cast<double>(T);
      const auto length = static_cast<int64_t>(std::ceil(-start / -ratio));
      const double second = start + -ratio;
      const double delta = second - start;
      for (int64_t i = 0; i < length; ++i) {
        const double value =
            i == 0 ? start : (i == 1 ? second : start + static_cast<double>(i) * delta);
        out.push_back(static_cast<float>(std::nearbyint(value)) - 1.0f);
      }
      break;
    }
  }
  return out;
}

int64_t index_for_timestep(const torch::Tensor& timesteps, double timestep,
                           const std::string& who) {
  const torch::Tensor values = timesteps.to(torch::kCPU, torch::kFloat64).contiguous();
  const double* p = values.data_ptr<double>();
  std::vector<int64_t> matches;
  for (int64_t i = 0; i < values.numel(); ++i) {
    if (p[i] == timestep) matches.push_back(i);
  }
  if (matches.empty()) {
    throw Error(who + ": timestep " + std::to_string(timestep) +
                " is not one of the sampler's timesteps; pass timesteps()[i] of the current "
                "set_timesteps()");
  }
  return matches.size() > 1 ? matches[1] : matches[0];
}

torch::Tensor step_noise(const torch::Tensor& like, const std::optional<at::Generator>& generator) {
  torch::Tensor noise;
  if (generator) {
    noise = at::randn(like.sizes(), *generator,
                      torch::TensorOptions().dtype(torch::kFloat32).device(generator->device()));
  } else {
    noise = at::randn(like.sizes(),
                      torch::TensorOptions().dtype(torch::kFloat32).device(like.device()));
  }
  return noise.to(like.device(), like.scalar_type());
}

}  // namespace difftrain::diffusion::detail
