// The reverse steps of DDPMScheduler and DDIMScheduler (Diffusers 0.31). The alpha-bars are 0-dim
// float32 tensors and every formula keeps Diffusers' operation order, so a step matches Diffusers'
// float32 result to the last bit on the CPU.

#include "difftrain/diffusion/noise_scheduler.h"

#include "difftrain/core/error.h"

#include <torch/torch.h>

#include <cmath>
#include <sstream>
#include <string>
#include <utility>

namespace difftrain::diffusion {

namespace {

torch::Tensor one() { return torch::scalar_tensor(1.0, torch::kFloat32); }

std::string number(double value) {
  std::ostringstream os;
  os << value;
  return os.str();
}

}  // namespace

// ------------------------------------------------------------------ DDPMScheduler

DDPMScheduler::DDPMScheduler(SchedulerConfig config)
    : NoiseScheduler(std::move(config), "DDPMScheduler") {
  if (config_.variance_type == VarianceType::kFixedLargeLog) {
    throw Error(
        "DDPMScheduler: variance_type 'fixed_large_log' is not supported (Diffusers' step takes "
        "the square root of the log variance there and returns NaN); use 'fixed_large', the same "
        "variance, or 'fixed_small'");
  }
}

int64_t DDPMScheduler::previous_timestep(int64_t timestep) const {
  const int64_t n = num_inference_steps_.value_or(num_train_timesteps());
  return timestep - num_train_timesteps() / n;
}

// Diffusers' _get_variance: the posterior variance of formulas 6-7 of the DDPM paper, in the form
// the variance type asks for (a log variance for fixed_small_log's exp and learned_range).
torch::Tensor DDPMScheduler::get_variance(int64_t timestep,
                                          const torch::Tensor& predicted_variance) const {
  const int64_t prev_t = previous_timestep(timestep);
  const torch::Tensor alpha_prod_t = alpha_prod_at(timestep, "timestep");
  const torch::Tensor alpha_prod_t_prev = prev_t >= 0 ? alphas_cumprod_[prev_t] : one();
  const torch::Tensor current_beta_t = 1 - alpha_prod_t / alpha_prod_t_prev;
  torch::Tensor variance = (1 - alpha_prod_t_prev) / (1 - alpha_prod_t) * current_beta_t;
  // Always clamped: some variance types take its log.
  variance = torch::clamp_min(variance, 1e-20);
  switch (config_.variance_type) {
    case VarianceType::kFixedSmall: return variance;
    case VarianceType::kFixedSmallLog: return torch::exp(0.5 * torch::log(variance));
    case VarianceType::kFixedLarge: return current_beta_t;
    case VarianceType::kLearned: return predicted_variance;
    case VarianceType::kLearnedRange: {
      const torch::Tensor min_log = torch::log(variance);
      const torch::Tensor max_log = torch::log(current_beta_t);
      const torch::Tensor frac = (predicted_variance + 1) / 2;
      return frac * max_log + (1 - frac) * min_log;
    }
    case VarianceType::kFixedLargeLog: break;  // refused by the constructor
  }
  throw Error("DDPMScheduler: invalid variance_type");
}

SchedulerOutput DDPMScheduler::step(const torch::Tensor& model_output_in, int64_t timestep,
                                    const torch::Tensor& sample,
                                    std::optional<at::Generator> generator) {
  torch::Tensor model_output = model_output_in;
  torch::Tensor predicted_variance;
  const VarianceType vt = config_.variance_type;
  if (vt == VarianceType::kLearned || vt == VarianceType::kLearnedRange) {
    // The model predicts [noise, variance] stacked on the channel dim.
    if (!model_output.defined() || !sample.defined() || model_output.dim() < 2 ||
        sample.dim() < 2 || model_output.size(1) != 2 * sample.size(1)) {
      throw Error("DDPMScheduler::step: variance_type '" + to_string(vt) +
                  "' needs a model_output with twice the sample's channels (the prediction, then "
                  "the variance); use a model trained for it or variance_type 'fixed_small'");
    }
    auto halves = torch::split(model_output, sample.size(1), 1);
    model_output = halves[0];
    predicted_variance = halves[1];
  }
  check_step_inputs(model_output, sample);

  // 1. alphas and betas of t and of the previous timestep.
  const int64_t t = timestep;
  const int64_t prev_t = previous_timestep(t);
  const torch::Tensor alpha_prod_t = alpha_prod_at(t, "timestep");
  const torch::Tensor alpha_prod_t_prev = prev_t >= 0 ? alphas_cumprod_[prev_t] : one();
  const torch::Tensor beta_prod_t = 1 - alpha_prod_t;
  const torch::Tensor beta_prod_t_prev = 1 - alpha_prod_t_prev;
  const torch::Tensor current_alpha_t = alpha_prod_t / alpha_prod_t_prev;
  const torch::Tensor current_beta_t = 1 - current_alpha_t;

  // 2. the predicted x_0 (formula 15 of the DDPM paper for epsilon).
  torch::Tensor pred_original_sample;
  switch (config_.prediction_type) {
    case PredictionType::kEpsilon:
      pred_original_sample = (sample - beta_prod_t.pow(0.5) * model_output) / alpha_prod_t.pow(0.5);
      break;
    case PredictionType::kSample: pred_original_sample = model_output; break;
    case PredictionType::kVPrediction:
      pred_original_sample = alpha_prod_t.pow(0.5) * sample - beta_prod_t.pow(0.5) * model_output;
      break;
  }

  // 3. clip or threshold it.
  pred_original_sample = clip_or_threshold(pred_original_sample);

  // 4-5. the posterior mean (formula 7).
  const torch::Tensor pred_original_sample_coeff =
      (alpha_prod_t_prev.pow(0.5) * current_beta_t) / beta_prod_t;
  const torch::Tensor current_sample_coeff =
      current_alpha_t.pow(0.5) * beta_prod_t_prev / beta_prod_t;
  torch::Tensor pred_prev_sample =
      pred_original_sample_coeff * pred_original_sample + current_sample_coeff * sample;

  // 6. noise, except at the last step.
  if (t > 0) {
    const torch::Tensor variance_noise = draw_noise(model_output, generator);
    const torch::Tensor variance = get_variance(t, predicted_variance);
    torch::Tensor scaled;
    if (vt == VarianceType::kFixedSmallLog) {
      scaled = variance * variance_noise;  // already a standard deviation
    } else if (vt == VarianceType::kLearnedRange) {
      scaled = torch::exp(0.5 * variance) * variance_noise;
    } else {
      scaled = variance.pow(0.5) * variance_noise;
    }
    pred_prev_sample = pred_prev_sample + scaled;
  }
  return {pred_prev_sample, pred_original_sample};
}

// ------------------------------------------------------------------ DDIMScheduler

DDIMScheduler::DDIMScheduler(SchedulerConfig config)
    : NoiseScheduler(std::move(config), "DDIMScheduler") {
  if (config_.beta_schedule == BetaSchedule::kSigmoid && !config_.trained_betas) {
    throw Error(
        "DDIMScheduler: beta_schedule 'sigmoid' is not supported (Diffusers' DDIMScheduler has "
        "no sigmoid schedule); use linear, scaled_linear or squaredcos_cap_v2, or DDPMScheduler");
  }
  // The alpha-bar "before" timestep 0, used by the last step.
  final_alpha_cumprod_ = config_.set_alpha_to_one ? one() : alphas_cumprod_[0].clone();
}

SchedulerOutput DDIMScheduler::step(const torch::Tensor& model_output, int64_t timestep,
                                    const torch::Tensor& sample,
                                    std::optional<at::Generator> generator) {
  return step(model_output, timestep, sample, 0.0, false, std::move(generator));
}

SchedulerOutput DDIMScheduler::step(const torch::Tensor& model_output, int64_t timestep,
                                    const torch::Tensor& sample, double eta,
                                    bool use_clipped_model_output,
                                    std::optional<at::Generator> generator) {
  if (!num_inference_steps_) {
    throw Error(
        "DDIMScheduler::step: call set_timesteps(num_inference_steps) first; the step from t to "
        "t - T // n needs n");
  }
  if (!(eta >= 0) || !std::isfinite(eta)) {
    throw Error("DDIMScheduler::step: eta is " + number(eta) +
                "; it must be a finite number >= 0 (0: deterministic DDIM, 1: DDPM-like noise)");
  }
  check_step_inputs(model_output, sample);

  // 1-2. the previous timestep and the alpha-bars (formulas 12 and 16 of the DDIM paper).
  const int64_t prev_timestep = timestep - num_train_timesteps() / *num_inference_steps_;
  const torch::Tensor alpha_prod_t = alpha_prod_at(timestep, "timestep");
  const torch::Tensor alpha_prod_t_prev =
      prev_timestep >= 0 ? alphas_cumprod_[prev_timestep] : final_alpha_cumprod_;
  const torch::Tensor beta_prod_t = 1 - alpha_prod_t;

  // 3. the predicted x_0 and epsilon.
  torch::Tensor pred_original_sample;
  torch::Tensor pred_epsilon;
  switch (config_.prediction_type) {
    case PredictionType::kEpsilon:
      pred_original_sample = (sample - beta_prod_t.pow(0.5) * model_output) / alpha_prod_t.pow(0.5);
      pred_epsilon = model_output;
      break;
    case PredictionType::kSample:
      pred_original_sample = model_output;
      pred_epsilon = (sample - alpha_prod_t.pow(0.5) * pred_original_sample) / beta_prod_t.pow(0.5);
      break;
    case PredictionType::kVPrediction:
      pred_original_sample = alpha_prod_t.pow(0.5) * sample - beta_prod_t.pow(0.5) * model_output;
      pred_epsilon = alpha_prod_t.pow(0.5) * model_output + beta_prod_t.pow(0.5) * sample;
      break;
  }

  // 4. clip or threshold x_0.
  pred_original_sample = clip_or_threshold(pred_original_sample);

  // 5. sigma_t(eta) of formula 16.
  const torch::Tensor beta_prod_t_prev = 1 - alpha_prod_t_prev;
  const torch::Tensor variance =
      (beta_prod_t_prev / beta_prod_t) * (1 - alpha_prod_t / alpha_prod_t_prev);
  const torch::Tensor std_dev_t = variance.pow(0.5) * eta;

  if (use_clipped_model_output) {
    // Glide re-derives epsilon from the clipped x_0.
    pred_epsilon = (sample - alpha_prod_t.pow(0.5) * pred_original_sample) / beta_prod_t.pow(0.5);
  }

  // 6-7. the direction pointing to x_t, and x_{t-1} without noise.
  const torch::Tensor pred_sample_direction =
      (1 - alpha_prod_t_prev - std_dev_t.pow(2)).pow(0.5) * pred_epsilon;
  torch::Tensor prev_sample =
      alpha_prod_t_prev.pow(0.5) * pred_original_sample + pred_sample_direction;

  if (eta > 0) {
    const torch::Tensor variance_noise = draw_noise(model_output, generator);
    prev_sample = prev_sample + std_dev_t * variance_noise;
  }
  return {prev_sample, pred_original_sample};
}

}  // namespace difftrain::diffusion
