#pragma once
// Noise schedulers: Diffusers' DDPMScheduler and DDIMScheduler (0.31) — the forward process used
// in training (add_noise, get_velocity, the loss target, SNR and min-SNR weights) and the reverse
// step used in sampling. The tables and the step arithmetic repeat Diffusers' float32 operations
// in the same order, so results match Diffusers to the last bits on the CPU.
//
//     auto config = SchedulerConfig::load("model/scheduler/scheduler_config.json");
//     auto scheduler = make_scheduler(config, "ddpm");          // training: DDPMScheduler
//     torch::Tensor noisy = scheduler->add_noise(latents, noise, timesteps);
//     torch::Tensor target = scheduler->training_target(latents, noise, timesteps);
//
//     scheduler->set_timesteps(50);                             // sampling
//     for (int64_t t : timesteps_as_vector) x = scheduler->step(unet(x, t), t, x, gen).prev_sample;

#include "difftrain/diffusion/scheduler_config.h"

#include <ATen/core/Generator.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace difftrain::diffusion {

/// What one reverse step returns. Diffusers: `DDPMSchedulerOutput` / `DDIMSchedulerOutput`.
struct SchedulerOutput {
  /// x_{t-1}, the next sample of the sampling loop; model_output's shape, sample's dtype.
  torch::Tensor prev_sample;
  /// The predicted x_0 (after clipping or thresholding); sample's shape.
  torch::Tensor pred_original_sample;
};

/// The inference timesteps Diffusers' `set_timesteps(n)` makes for `spacing`: int64 [n], in
/// descending order. "leading": i * (T // n) + steps_offset; "trailing": round(arange(T, 0, -T/n))
/// - 1; "linspace": round(linspace(0, T - 1, n)); numpy's round-half-to-even throughout.
/// Throws difftrain::Error when n is not in [1, T] or a timestep falls outside [0, T - 1]
/// (leading with a steps_offset that pushes the last timestep to T or beyond).
torch::Tensor make_inference_timesteps(int64_t num_train_timesteps, int64_t num_inference_steps,
                                       TimestepSpacing spacing, int64_t steps_offset);

/// The betas Diffusers builds from `config` (before rescale_betas_zero_snr): float32 [T].
/// Diffusers: the beta table of the scheduler constructors, `betas_for_alpha_bar`.
torch::Tensor make_betas(const SchedulerConfig& config);

/// Betas rescaled to a zero terminal SNR, float32 [T]. Diffusers: `rescale_zero_terminal_snr`.
torch::Tensor rescale_zero_terminal_snr(const torch::Tensor& betas);

/// The min-SNR-gamma loss weight per example (arXiv 2303.09556, Diffusers' train_text_to_image.py
/// `--snr_gamma`): min(snr, gamma) / snr for epsilon, min(snr, gamma) / (snr + 1) for
/// v_prediction, min(snr, gamma) for sample. snr: [B] (any float dtype), result: the same. One
/// deviation: Diffusers' epsilon weight is 0/0 = NaN where snr == 0 (the last timestep of a
/// zero-terminal-SNR schedule); here it is the limit, 1. gamma must be finite and > 0.
torch::Tensor min_snr_weights(const torch::Tensor& snr, double gamma,
                              PredictionType prediction_type);

/// The common part of DDPMScheduler and DDIMScheduler: the beta tables, the forward process, and
/// the inference timesteps. Diffusers: `SchedulerMixin` plus the methods both classes share.
class NoiseScheduler {
 public:
  virtual ~NoiseScheduler() = default;
  NoiseScheduler(const NoiseScheduler&) = delete;
  NoiseScheduler& operator=(const NoiseScheduler&) = delete;

  /// "DDPMScheduler" or "DDIMScheduler" (Diffusers' class name).
  virtual std::string class_name() const = 0;

  /// The configuration, with class_name set to this class (what `scheduler.config` holds, and
  /// what `config().to_json()` saves as scheduler_config.json).
  const SchedulerConfig& config() const { return config_; }
  /// T (`config.num_train_timesteps`, `len(scheduler)`).
  int64_t num_train_timesteps() const { return config_.num_train_timesteps; }

  /// float32 [T] tables on the CPU: `betas`, `alphas` = 1 - betas, `alphas_cumprod` (alpha-bar).
  const torch::Tensor& betas() const { return betas_; }
  const torch::Tensor& alphas() const { return alphas_; }
  const torch::Tensor& alphas_cumprod() const { return alphas_cumprod_; }

  /// The forward process q(x_t | x_0): sqrt(a_t) * x0 + sqrt(1 - a_t) * noise with a =
  /// alphas_cumprod in x0's dtype. x0, noise: [B, ...]; timesteps: integer [B] (or one value for
  /// all), each in [0, T - 1]; the coefficients broadcast over the trailing dims. Result on x0's
  /// device, in x0's dtype. Diffusers: `add_noise(original_samples, noise, timesteps)`.
  torch::Tensor add_noise(const torch::Tensor& x0, const torch::Tensor& noise,
                          const torch::Tensor& timesteps) const;

  /// The velocity sqrt(a_t) * noise - sqrt(1 - a_t) * sample; shapes and dtypes as add_noise.
  /// Diffusers: `get_velocity(sample, noise, timesteps)`.
  torch::Tensor get_velocity(const torch::Tensor& sample, const torch::Tensor& noise,
                             const torch::Tensor& timesteps) const;

  /// The loss target for config().prediction_type: noise (epsilon), get_velocity(x0, noise,
  /// timesteps) (v_prediction) or x0 (sample). Shapes as add_noise. Diffusers' training scripts:
  /// the `target = ...` lines of train_text_to_image.py / train_unconditional.py.
  torch::Tensor training_target(const torch::Tensor& x0, const torch::Tensor& noise,
                                const torch::Tensor& timesteps) const;

  /// Signal-to-noise ratio (sqrt(a_t) / sqrt(1 - a_t))^2, float32 with timesteps' shape [B], on
  /// timesteps' device. Diffusers: `diffusers.training_utils.compute_snr(scheduler, timesteps)`.
  torch::Tensor snr(const torch::Tensor& timesteps) const;

  /// Chooses the n inference timesteps (see make_inference_timesteps) for the config's spacing.
  /// Diffusers: `set_timesteps(num_inference_steps)`.
  void set_timesteps(int64_t num_inference_steps);
  /// int64 [n] on the CPU, descending: the last set_timesteps(), else T - 1, ..., 0 (Diffusers'
  /// initial `scheduler.timesteps`).
  const torch::Tensor& timesteps() const { return timesteps_; }
  /// n of the last set_timesteps(), or nullopt (`scheduler.num_inference_steps`).
  std::optional<int64_t> num_inference_steps() const { return num_inference_steps_; }

  /// One reverse step from `sample` (x_t) at `timestep` t given the model's output, with the
  /// class's default options (DDIM: eta 0). model_output, sample: [B, C, ...]. Noise, if any, is
  /// drawn with at::randn from `generator` (Python: torch.Generator; LibTorch's CPU generator with
  /// the same seed yields the same numbers), or the default generator. Diffusers: `step(...)`.
  virtual SchedulerOutput step(const torch::Tensor& model_output, int64_t timestep,
                               const torch::Tensor& sample,
                               std::optional<at::Generator> generator = std::nullopt) = 0;

 protected:
  /// Builds the tables from `config` (validated first) and records `class_name` in the config.
  NoiseScheduler(SchedulerConfig config, const std::string& class_name);

  /// The x_0 prediction clamped to ±clip_sample_range, or dynamically thresholded when
  /// config.thresholding (Diffusers: `_threshold_sample`); unchanged when neither is on.
  torch::Tensor clip_or_threshold(const torch::Tensor& pred_original_sample) const;

  /// `alphas_cumprod[t]` as a 0-dim float32 tensor; throws for t outside [0, T - 1].
  torch::Tensor alpha_prod_at(int64_t timestep, const char* what) const;

  /// Standard normal noise of like's shape and dtype, drawn as Diffusers' `randn_tensor`: on the
  /// generator's device (the default generator: like's device), then moved to like's device.
  static torch::Tensor draw_noise(const torch::Tensor& like,
                                  const std::optional<at::Generator>& generator);

  /// Throws unless model_output and sample are defined with one shape [B, C, ...].
  void check_step_inputs(const torch::Tensor& model_output, const torch::Tensor& sample) const;

  SchedulerConfig config_;
  torch::Tensor betas_, alphas_, alphas_cumprod_;
  torch::Tensor timesteps_;
  std::optional<int64_t> num_inference_steps_;
};

/// Denoising diffusion probabilistic models: the scheduler Diffusers' training scripts use for
/// the forward process, and DDPMPipeline's sampler. Diffusers: `DDPMScheduler`. Refuses
/// variance_type "fixed_large_log" (Diffusers' step takes the square root of a log variance there
/// and returns NaN).
class DDPMScheduler : public NoiseScheduler {
 public:
  explicit DDPMScheduler(SchedulerConfig config = {});
  std::string class_name() const override { return "DDPMScheduler"; }

  /// The previous timestep of the chain: t - T // n (n = num_inference_steps, or T before
  /// set_timesteps). Diffusers: `previous_timestep(timestep)`.
  int64_t previous_timestep(int64_t timestep) const;

  /// Posterior mean of x_{t-1} (formula 7 of the DDPM paper) from the predicted x_0, plus
  /// sqrt(variance) * noise when t > 0, the noise drawn as at::randn(model_output's shape,
  /// generator) in model_output's dtype. model_output: [B, C, ...], or [B, 2C, ...] for the
  /// learned variance types (the second half is the variance); sample: [B, C, ...].
  SchedulerOutput step(const torch::Tensor& model_output, int64_t timestep,
                       const torch::Tensor& sample,
                       std::optional<at::Generator> generator = std::nullopt) override;

 private:
  torch::Tensor get_variance(int64_t timestep, const torch::Tensor& predicted_variance) const;
};

/// Denoising diffusion implicit models. Diffusers: `DDIMScheduler` (DDIMPipeline's sampler).
/// Refuses beta_schedule "sigmoid", which Diffusers' DDIMScheduler does not have.
class DDIMScheduler : public NoiseScheduler {
 public:
  explicit DDIMScheduler(SchedulerConfig config = {});
  std::string class_name() const override { return "DDIMScheduler"; }

  /// The alpha-bar used "before" timestep 0: 1 when set_alpha_to_one, else alphas_cumprod[0];
  /// 0-dim float32. Diffusers: `final_alpha_cumprod`.
  const torch::Tensor& final_alpha_cumprod() const { return final_alpha_cumprod_; }

  /// step() with eta 0 and use_clipped_model_output false (Diffusers' defaults): deterministic.
  SchedulerOutput step(const torch::Tensor& model_output, int64_t timestep,
                       const torch::Tensor& sample,
                       std::optional<at::Generator> generator = std::nullopt) override;

  /// Formula 12 of the DDIM paper from x_t to x_{t - T//n}; needs set_timesteps() first. eta >= 0
  /// weighs the noise (0: DDIM, 1: DDPM-like); noise is drawn only when eta > 0, as
  /// at::randn(model_output's shape, generator) in model_output's dtype.
  /// use_clipped_model_output re-derives epsilon from the clipped x_0 (Glide). model_output,
  /// sample: [B, C, ...].
  SchedulerOutput step(const torch::Tensor& model_output, int64_t timestep,
                       const torch::Tensor& sample, double eta,
                       bool use_clipped_model_output = false,
                       std::optional<at::Generator> generator = std::nullopt);

 private:
  torch::Tensor final_alpha_cumprod_;
};

/// A scheduler of `kind`: "ddpm" (DDPMScheduler), "ddim" (DDIMScheduler) or "" for the config's
/// class_name ("DDPMScheduler" or "DDIMScheduler"). Like Diffusers' `DDPMScheduler.from_config`,
/// an explicit kind accepts any config, whatever its class_name. Anything else throws
/// difftrain::Error listing the supported kinds.
std::unique_ptr<NoiseScheduler> make_scheduler(const SchedulerConfig& config,
                                               const std::string& kind = "");

}  // namespace difftrain::diffusion
