// The shared half of the noise schedulers: beta tables, inference timesteps, the forward process,
// SNR weights and the factory. Every table is built with the float32 (or, where Diffusers uses
// Python floats, double) operations Diffusers 0.31 uses, in the same order.

#include "difftrain/diffusion/noise_scheduler.h"

#include "difftrain/core/error.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::diffusion {

namespace {

constexpr double kPi = 3.141592653589793;  // Python's math.pi
constexpr double kMaxBeta = 0.999;         // betas_for_alpha_bar's max_beta

std::string shape_of(const torch::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string s = "[";
  for (int64_t d = 0; d < t.dim(); ++d) s += (d ? ", " : "") + std::to_string(t.size(d));
  return s + "]";
}

// `timesteps` as int64 on `device`, checked: integer, B values (or one), all in [0, T - 1].
// batch < 0: any number of values.
torch::Tensor checked_timesteps(const torch::Tensor& timesteps, int64_t batch, int64_t T,
                                const torch::Device& device, const char* fn) {
  if (!timesteps.defined() || !c10::isIntegralType(timesteps.scalar_type(), false)) {
    throw Error(std::string(fn) + ": timesteps must be an integer tensor (int64 [B]), got " +
                (timesteps.defined() ? std::string(c10::toString(timesteps.scalar_type())) + " " +
                                           shape_of(timesteps)
                                     : "an undefined tensor"));
  }
  if (batch >= 0 && timesteps.numel() != batch && timesteps.numel() != 1) {
    throw Error(std::string(fn) + ": timesteps " + shape_of(timesteps) + " has " +
                std::to_string(timesteps.numel()) + " values for a batch of " +
                std::to_string(batch) + "; give one timestep per example (or one for all)");
  }
  if (timesteps.numel() > 0) {
    const int64_t lo = timesteps.min().item<int64_t>();
    const int64_t hi = timesteps.max().item<int64_t>();
    if (lo < 0 || hi >= T) {
      throw Error(std::string(fn) + ": timestep " + std::to_string(lo < 0 ? lo : hi) +
                  " is outside [0, " + std::to_string(T - 1) + "] (num_train_timesteps " +
                  std::to_string(T) + ")");
    }
  }
  return timesteps.to(device, torch::kLong);
}

// sqrt(a_t) and sqrt(1 - a_t) for each timestep, shaped [B, 1, ...] to broadcast over `like`,
// in like's dtype: Diffusers' add_noise / get_velocity preamble.
std::pair<torch::Tensor, torch::Tensor> noise_coefficients(const torch::Tensor& alphas_cumprod,
                                                           const torch::Tensor& timesteps,
                                                           const torch::Tensor& like) {
  const torch::Tensor ac = alphas_cumprod.to(like.device()).to(like.scalar_type());
  const torch::Tensor a_t = ac.index({timesteps});
  torch::Tensor sqrt_alpha_prod = a_t.pow(0.5).flatten();
  torch::Tensor sqrt_one_minus_alpha_prod = (1 - a_t).pow(0.5).flatten();
  while (sqrt_alpha_prod.dim() < like.dim()) sqrt_alpha_prod = sqrt_alpha_prod.unsqueeze(-1);
  while (sqrt_one_minus_alpha_prod.dim() < like.dim()) {
    sqrt_one_minus_alpha_prod = sqrt_one_minus_alpha_prod.unsqueeze(-1);
  }
  return {sqrt_alpha_prod, sqrt_one_minus_alpha_prod};
}

void check_pair(const torch::Tensor& a, const char* a_name, const torch::Tensor& b,
                const char* b_name, const char* fn) {
  if (!a.defined() || !b.defined() || a.dim() < 1 || a.sizes() != b.sizes()) {
    throw Error(std::string(fn) + ": " + a_name + " " + shape_of(a) + " and " + b_name + " " +
                shape_of(b) + " must be defined and of one shape [B, ...]");
  }
}

// Glide's cosine alpha-bar, in double as Python's math module computes it.
double alpha_bar_cosine(double t) { return std::pow(std::cos((t + 0.008) / 1.008 * kPi / 2), 2.0); }

}  // namespace

// ------------------------------------------------------------------ tables

torch::Tensor make_betas(const SchedulerConfig& c) {
  const int64_t T = c.num_train_timesteps;
  const auto f32 = torch::TensorOptions().dtype(torch::kFloat32);
  if (c.trained_betas) {
    return torch::tensor(*c.trained_betas, torch::TensorOptions().dtype(torch::kFloat64))
        .to(torch::kFloat32);
  }
  switch (c.beta_schedule) {
    case BetaSchedule::kLinear: return torch::linspace(c.beta_start, c.beta_end, T, f32);
    case BetaSchedule::kScaledLinear:
      // Latent diffusion's schedule: the square roots are Python floats, the square is float32.
      return torch::linspace(std::pow(c.beta_start, 0.5), std::pow(c.beta_end, 0.5), T, f32).pow(2);
    case BetaSchedule::kSquaredcosCapV2: {
      std::vector<double> betas(static_cast<size_t>(T));
      for (int64_t i = 0; i < T; ++i) {
        const double t1 = static_cast<double>(i) / static_cast<double>(T);
        const double t2 = static_cast<double>(i + 1) / static_cast<double>(T);
        betas[static_cast<size_t>(i)] =
            std::min(1 - alpha_bar_cosine(t2) / alpha_bar_cosine(t1), kMaxBeta);
      }
      return torch::tensor(betas, torch::TensorOptions().dtype(torch::kFloat64))
          .to(torch::kFloat32);
    }
    case BetaSchedule::kSigmoid:
      return torch::sigmoid(torch::linspace(-6, 6, T, f32)) * (c.beta_end - c.beta_start) +
             c.beta_start;
  }
  throw Error("make_betas: invalid beta_schedule");
}

torch::Tensor rescale_zero_terminal_snr(const torch::Tensor& betas) {
  const torch::Tensor alphas = 1.0 - betas;
  const torch::Tensor alphas_cumprod = torch::cumprod(alphas, 0);
  torch::Tensor alphas_bar_sqrt = alphas_cumprod.sqrt();
  const torch::Tensor first = alphas_bar_sqrt[0].clone();
  const torch::Tensor last = alphas_bar_sqrt[-1].clone();
  // Shift so the last timestep is zero, then scale so the first is back to its old value.
  alphas_bar_sqrt -= last;
  alphas_bar_sqrt *= first / (first - last);
  const torch::Tensor alphas_bar = alphas_bar_sqrt.pow(2);
  const int64_t T = alphas_bar.size(0);
  const torch::Tensor ratios = alphas_bar.slice(0, 1, T) / alphas_bar.slice(0, 0, T - 1);
  return 1 - torch::cat({alphas_bar.slice(0, 0, 1), ratios});
}

torch::Tensor make_inference_timesteps(int64_t T, int64_t n, TimestepSpacing spacing,
                                       int64_t steps_offset) {
  if (n < 1 || n > T) {
    throw Error("set_timesteps: num_inference_steps is " + std::to_string(n) +
                "; it must be in [1, num_train_timesteps = " + std::to_string(T) + "]");
  }
  std::vector<int64_t> ts;  // ascending, reversed at the end (Diffusers' [::-1])
  switch (spacing) {
    case TimestepSpacing::kLeading: {
      const int64_t ratio = T / n;
      for (int64_t i = 0; i < n; ++i) ts.push_back(i * ratio + steps_offset);
      break;
    }
    case TimestepSpacing::kTrailing: {
      // np.round(np.arange(T, 0, -T / n)) - 1, with numpy's float arange: the length is
      // ceil(-T / -ratio), element i is start + i * (second - start), rounded half to even.
      const double ratio = static_cast<double>(T) / static_cast<double>(n);
      const double start = static_cast<double>(T);
      const auto length = static_cast<int64_t>(std::ceil(-start / -ratio));
      const double delta = (start + -ratio) - start;
      std::vector<int64_t> descending;
      for (int64_t i = 0; i < length; ++i) {
        const double value = i == 0 ? start : (i == 1 ? start + -ratio : start + i * delta);
        descending.push_back(static_cast<int64_t>(std::nearbyint(value)) - 1);
      }
      ts.assign(descending.rbegin(), descending.rend());
      break;
    }
    case TimestepSpacing::kLinspace: {
      // np.linspace(0, T - 1, n).round(): i * ((T - 1) / (n - 1)), the last one exactly T - 1.
      const double stop = static_cast<double>(T - 1);
      for (int64_t i = 0; i < n; ++i) {
        double value = 0;
        if (n > 1) value = (i == n - 1) ? stop : static_cast<double>(i) * (stop / (n - 1));
        ts.push_back(static_cast<int64_t>(std::nearbyint(value)));
      }
      break;
    }
  }
  for (int64_t t : ts) {
    if (t < 0 || t >= T) {
      throw Error("set_timesteps: timestep_spacing '" + to_string(spacing) + "' with " +
                  std::to_string(n) + " steps and steps_offset " + std::to_string(steps_offset) +
                  " gives timestep " + std::to_string(t) + ", outside [0, " +
                  std::to_string(T - 1) + "]; use fewer steps or a smaller steps_offset");
    }
  }
  std::reverse(ts.begin(), ts.end());
  return torch::tensor(ts, torch::TensorOptions().dtype(torch::kLong));
}

torch::Tensor min_snr_weights(const torch::Tensor& snr, double gamma,
                              PredictionType prediction_type) {
  if (!(gamma > 0) || !std::isfinite(gamma)) {
    std::ostringstream shown;
    shown << gamma;
    throw Error("min_snr_weights: snr_gamma is " + shown.str() +
                "; it must be a finite number > 0 (the paper and Diffusers' scripts use 5)");
  }
  if (!snr.defined() || !snr.is_floating_point()) {
    throw Error("min_snr_weights: snr must be a floating-point tensor [B], as snr() returns");
  }
  // Diffusers: torch.stack([snr, gamma * ones]).min(dim=1): the same values as clamp_max.
  const torch::Tensor clipped = torch::clamp_max(snr, gamma);
  switch (prediction_type) {
    case PredictionType::kEpsilon: {
      const torch::Tensor weights = clipped / snr;
      return torch::where(snr == 0, torch::ones_like(weights), weights);
    }
    case PredictionType::kVPrediction: return clipped / (snr + 1);
    case PredictionType::kSample: return clipped;
  }
  throw Error("min_snr_weights: invalid prediction_type");
}

// ------------------------------------------------------------------ NoiseScheduler

NoiseScheduler::NoiseScheduler(SchedulerConfig config, const std::string& class_name)
    : config_(std::move(config)) {
  config_.validate();
  config_.class_name = class_name;
  betas_ = make_betas(config_);
  if (config_.rescale_betas_zero_snr) betas_ = rescale_zero_terminal_snr(betas_);
  alphas_ = 1.0 - betas_;
  alphas_cumprod_ = torch::cumprod(alphas_, 0);
  const int64_t T = config_.num_train_timesteps;
  timesteps_ = torch::arange(T - 1, -1, -1, torch::TensorOptions().dtype(torch::kLong));
}

torch::Tensor NoiseScheduler::add_noise(const torch::Tensor& x0, const torch::Tensor& noise,
                                        const torch::Tensor& timesteps) const {
  check_pair(x0, "x0", noise, "noise", "add_noise");
  const torch::Tensor t =
      checked_timesteps(timesteps, x0.size(0), num_train_timesteps(), x0.device(), "add_noise");
  const auto [sqrt_alpha_prod, sqrt_one_minus_alpha_prod] =
      noise_coefficients(alphas_cumprod_, t, x0);
  return sqrt_alpha_prod * x0 + sqrt_one_minus_alpha_prod * noise;
}

torch::Tensor NoiseScheduler::get_velocity(const torch::Tensor& sample, const torch::Tensor& noise,
                                           const torch::Tensor& timesteps) const {
  check_pair(sample, "sample", noise, "noise", "get_velocity");
  const torch::Tensor t = checked_timesteps(timesteps, sample.size(0), num_train_timesteps(),
                                            sample.device(), "get_velocity");
  const auto [sqrt_alpha_prod, sqrt_one_minus_alpha_prod] =
      noise_coefficients(alphas_cumprod_, t, sample);
  return sqrt_alpha_prod * noise - sqrt_one_minus_alpha_prod * sample;
}

torch::Tensor NoiseScheduler::training_target(const torch::Tensor& x0, const torch::Tensor& noise,
                                              const torch::Tensor& timesteps) const {
  switch (config_.prediction_type) {
    case PredictionType::kEpsilon:
      check_pair(x0, "x0", noise, "noise", "training_target");
      return noise;
    case PredictionType::kVPrediction: return get_velocity(x0, noise, timesteps);
    case PredictionType::kSample:
      check_pair(x0, "x0", noise, "noise", "training_target");
      return x0;
  }
  throw Error("training_target: invalid prediction_type");
}

torch::Tensor NoiseScheduler::snr(const torch::Tensor& timesteps) const {
  const torch::Tensor t =
      checked_timesteps(timesteps, -1, num_train_timesteps(), timesteps.device(), "snr");
  // compute_snr: the square roots of the whole table, then indexed, then (alpha / sigma) ** 2.
  const torch::Tensor sqrt_alphas_cumprod = alphas_cumprod_.pow(0.5);
  const torch::Tensor sqrt_one_minus_alphas_cumprod = (1.0 - alphas_cumprod_).pow(0.5);
  const torch::Tensor alpha =
      sqrt_alphas_cumprod.to(t.device()).index({t}).to(torch::kFloat32).expand(t.sizes());
  const torch::Tensor sigma =
      sqrt_one_minus_alphas_cumprod.to(t.device()).index({t}).to(torch::kFloat32).expand(t.sizes());
  return (alpha / sigma).pow(2);
}

void NoiseScheduler::set_timesteps(int64_t num_inference_steps) {
  timesteps_ = make_inference_timesteps(num_train_timesteps(), num_inference_steps,
                                        config_.timestep_spacing, config_.steps_offset);
  num_inference_steps_ = num_inference_steps;
}

torch::Tensor NoiseScheduler::alpha_prod_at(int64_t timestep, const char* what) const {
  if (timestep < 0 || timestep >= num_train_timesteps()) {
    throw Error(class_name() + "::step: " + what + " " + std::to_string(timestep) +
                " is outside [0, " + std::to_string(num_train_timesteps() - 1) + "]");
  }
  return alphas_cumprod_[timestep];
}

torch::Tensor NoiseScheduler::clip_or_threshold(const torch::Tensor& x0) const {
  if (config_.thresholding) {
    // Imagen's dynamic thresholding, per example: s = the ratio-quantile of |x0|, clamped to
    // [1, sample_max_value]; x0 is clamped to [-s, s] and divided by s.
    if (x0.dim() < 2) {
      throw Error(class_name() + ": thresholding needs samples of shape [B, C, ...], got " +
                  shape_of(x0));
    }
    const auto dtype = x0.scalar_type();
    torch::Tensor x = x0;
    // quantile needs float32/float64, and clamp has no CPU half kernel.
    if (dtype != torch::kFloat32 && dtype != torch::kFloat64) x = x.to(torch::kFloat32);
    const int64_t batch = x.size(0);
    x = x.reshape({batch, -1});
    torch::Tensor s = at::quantile(x.abs(), config_.dynamic_thresholding_ratio, 1);
    s = torch::clamp(s, 1, config_.sample_max_value).unsqueeze(1);
    x = torch::clamp(x, -s, s) / s;
    return x.reshape(x0.sizes()).to(dtype);
  }
  if (config_.clip_sample) {
    return x0.clamp(-config_.clip_sample_range, config_.clip_sample_range);
  }
  return x0;
}

torch::Tensor NoiseScheduler::draw_noise(const torch::Tensor& like,
                                         const std::optional<at::Generator>& generator) {
  c10::optional<at::Generator> gen;
  if (generator) gen = *generator;
  const torch::Device device = generator ? generator->device() : like.device();
  return at::randn(like.sizes(), gen, like.options().device(device)).to(like.device());
}

void NoiseScheduler::check_step_inputs(const torch::Tensor& model_output,
                                       const torch::Tensor& sample) const {
  if (!model_output.defined() || !sample.defined() || sample.dim() < 1 ||
      model_output.sizes() != sample.sizes()) {
    throw Error(class_name() + "::step: model_output " + shape_of(model_output) + " and sample " +
                shape_of(sample) + " must be defined and of one shape [B, C, ...]");
  }
}

// ------------------------------------------------------------------ factory

std::unique_ptr<NoiseScheduler> make_scheduler(const SchedulerConfig& config,
                                               const std::string& kind) {
  if (kind == "ddpm") return std::make_unique<DDPMScheduler>(config);
  if (kind == "ddim") return std::make_unique<DDIMScheduler>(config);
  if (!kind.empty()) {
    throw Error("unknown scheduler kind '" + kind +
                "'; supported: ddpm, ddim, or \"\" for the config's _class_name");
  }
  if (config.class_name == "DDPMScheduler") return std::make_unique<DDPMScheduler>(config);
  if (config.class_name == "DDIMScheduler") return std::make_unique<DDIMScheduler>(config);
  throw Error("scheduler config _class_name '" + config.class_name +
              "' is not supported; supported: DDPMScheduler, DDIMScheduler (or pass kind "
              "\"ddpm\" or \"ddim\" to use this config with one of them)");
}

}  // namespace difftrain::diffusion
