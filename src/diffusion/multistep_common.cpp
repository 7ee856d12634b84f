// Tables and conversions shared by DPM-Solver and UniPC (see multistep_common.h).

#include "multistep_common.h"

#include "difftrain/core/error.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace difftrain::diffusion::detail {

std::vector<int64_t> multistep_timesteps(int64_t num_train_timesteps, int64_t last_timestep,
                                         int64_t n, const std::string& spacing,
                                         int64_t steps_offset) {
  std::vector<int64_t> out;  // descending
  if (spacing == "linspace") {
    const std::vector<double> lin = linspace(0.0, static_cast<double>(last_timestep - 1), n + 1);
    for (int64_t i = n; i >= 1; --i) {
      out.push_back(static_cast<int64_t>(std::nearbyint(lin[static_cast<size_t>(i)])));
    }
  } else if (spacing == "leading") {
    const int64_t ratio = last_timestep / (n + 1);  // Python // on non-negative ints
    for (int64_t i = n; i >= 1; --i) out.push_back(i * ratio + steps_offset);
  } else if (spacing == "trailing") {
    // np.arange(last, 0, -T / n): length ceil((0 - last) / -ratio); numpy fills element i >= 2
    // as start + i * (x[1] - x[0]), which can differ from start - i * ratio in the last bit.
    const double ratio = static_cast<double>(num_train_timesteps) / static_cast<double>(n);
    const double start = static_cast<double>(last_timestep);
    const double length = std::ceil((0.0 - start) / -ratio);
    const double second = start + -ratio;
    const double delta = second - start;
    for (int64_t i = 0; i < static_cast<int64_t>(length); ++i) {
      const double value =
          i == 0 ? start : (i == 1 ? second : start + static_cast<double>(i) * delta);
      out.push_back(static_cast<int64_t>(std::nearbyint(value)) - 1);
    }
  } else {
    throw Error("timestep_spacing '" + spacing +
                "' is not supported; choose one of 'linspace', 'leading' or 'trailing'");
  }
  return out;
}

void multistep_sigmas(SigmaSpacing spacing, int64_t n, const std::vector<float>& train_sigmas,
                      std::vector<int64_t>& timesteps, std::vector<double>& sigmas) {
  const std::vector<float> log_sigmas = log_float32(train_sigmas);
  const auto from_sigmas = [&] {
    timesteps.clear();
    for (double s : sigmas) {
      timesteps.push_back(static_cast<int64_t>(std::nearbyint(sigma_to_t(s, log_sigmas))));
    }
  };
  switch (spacing) {
    case SigmaSpacing::kInterp: {
      std::vector<double> x(timesteps.begin(), timesteps.end());
      sigmas = interp_on_index(x, train_sigmas);
      return;
    }
    case SigmaSpacing::kKarras:
      // in_sigmas = flip(sigmas): sigma_min = sigmas[0], sigma_max = sigmas[-1] (float32 values).
      sigmas = karras_sigmas(train_sigmas.front(), train_sigmas.back(), n);
      from_sigmas();
      return;
    case SigmaSpacing::kLu: {
      // _convert_to_lu with rho = 1 over flip(log_sigmas): lambda_min = log_sigmas[0],
      // lambda_max = log_sigmas[-1] (Diffusers' names), then sigmas = exp(lambdas).
      const double lo = log_sigmas.front(), hi = log_sigmas.back();
      const std::vector<double> ramp = linspace(0.0, 1.0, n);
      sigmas.clear();
      for (double r : ramp) sigmas.push_back(std::exp(hi + r * (lo - hi)));
      from_sigmas();
      return;
    }
  }
}

std::pair<torch::Tensor, torch::Tensor> sigma_to_alpha_sigma_t(const torch::Tensor& sigma) {
  // Python's `1 / x` on a tensor is x.reciprocal() * 1.
  const torch::Tensor alpha_t = torch::reciprocal(torch::pow(torch::pow(sigma, 2) + 1, 0.5)) * 1;
  const torch::Tensor sigma_t = sigma * alpha_t;
  return {alpha_t, sigma_t};
}

torch::Tensor lambda_of(const torch::Tensor& alpha_t, const torch::Tensor& sigma_t) {
  return torch::log(alpha_t) - torch::log(sigma_t);
}

torch::Tensor threshold_sample(const torch::Tensor& sample, double ratio, double max_value,
                               const std::string& who) {
  if (sample.dim() < 2) {
    throw Error(who + ": thresholding needs samples of shape [B, C, ...], got " +
                std::to_string(sample.dim()) + " dims");
  }
  const auto dtype = sample.scalar_type();
  torch::Tensor x = sample;
  // quantile needs float32/float64, and clamp has no CPU half kernel.
  if (dtype != torch::kFloat32 && dtype != torch::kFloat64) x = x.to(torch::kFloat32);
  x = x.reshape({x.size(0), -1});
  torch::Tensor s = at::quantile(x.abs(), ratio, 1);
  s = torch::clamp(s, 1, max_value).unsqueeze(1);
  x = torch::clamp(x, -s, s) / s;
  return x.reshape(sample.sizes()).to(dtype);
}

int64_t index_for_timestep(const torch::Tensor& timesteps, double timestep) {
  const torch::Tensor ts = timesteps.to(torch::kCPU, torch::kFloat64).contiguous();
  const double* p = ts.data_ptr<double>();
  std::vector<int64_t> hits;
  for (int64_t i = 0; i < ts.numel(); ++i) {
    if (p[i] == timestep) hits.push_back(i);
  }
  if (hits.empty()) return ts.numel() - 1;
  return hits.size() > 1 ? hits[1] : hits[0];
}

torch::Tensor draw_step_noise(at::IntArrayRef shape, const torch::Device& device,
                              const std::optional<at::Generator>& generator) {
  c10::optional<at::Generator> gen;
  torch::Device draw_on = device;
  if (generator) {
    gen = *generator;
    if (generator->device().type() == torch::kCPU) draw_on = torch::kCPU;
  }
  const auto options = torch::TensorOptions().dtype(torch::kFloat32).device(draw_on);
  return at::randn(shape, gen, options).to(device);
}

void put_beta_fields(const ConfigReader& reader, const SchedulerConfig& betas,
                     nlohmann::json& out) {
  out["num_train_timesteps"] = betas.num_train_timesteps;
  out["beta_start"] = betas.beta_start;
  out["beta_end"] = betas.beta_end;
  out["beta_schedule"] = to_string(betas.beta_schedule);
  const nlohmann::json& in = reader.json();
  out["trained_betas"] = in.contains("trained_betas") ? in["trained_betas"] : nlohmann::json();
  out["rescale_betas_zero_snr"] = betas.rescale_betas_zero_snr;
}

const std::vector<BetaSchedule>& multistep_beta_schedules() {
  static const std::vector<BetaSchedule> kAllowed = {
      BetaSchedule::kLinear, BetaSchedule::kScaledLinear, BetaSchedule::kSquaredcosCapV2};
  return kAllowed;
}

void check_num_inference_steps(int64_t n, const std::string& who) {
  if (n < 1) {
    throw Error(who + ": num_inference_steps is " + std::to_string(n) + "; it must be >= 1");
  }
}

}  // namespace difftrain::diffusion::detail
