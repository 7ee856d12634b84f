#pragma once
// The training objective of a diffusion model, apart from the model: draw each sample's noise and
// noise level, make the noisy input, the regression target and the loss weight; the loss is the
// squared error averaged over every non-batch dimension. A model family's training task composes
// an objective with a Denoiser (denoiser.h):
//
//   auto noised = objective.noise(x0, keys, epoch, device);     // per-sample random streams
//   auto pred = denoiser.denoise(noised.model_input, noised.timesteps, cond);
//   auto per_sample = objective.losses(pred, noised);            // [B]
//
// DdpmObjective is Diffusers' DDPM training (train_unconditional.py, train_text_to_image.py:
// integer timesteps, epsilon / v_prediction / sample targets, min-SNR-gamma weights, noise offset,
// input perturbation). A flow-matching objective (continuous sigma in [0, 1], timestep-sampling
// schemes, target = noise - x0) is another implementation, with no change to the trainer.

#include "difftrain/diffusion/noise_scheduler.h"

#include <ATen/core/Generator.h>

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::diffusion {

/// A batch ready for the denoiser and the loss.
struct NoisedBatch {
  torch::Tensor model_input;  ///< [B, ...] the noisy input, x0's shape, dtype and device
  torch::Tensor timesteps;    ///< [B] what the denoiser is given as t (int64 for DDPM)
  torch::Tensor target;       ///< [B, ...] float32, what the denoiser should predict
  torch::Tensor weights;      ///< [B] float32 per-sample loss weights; undefined = all 1
  /// [B] float32 each sample's Huber threshold c (LossOptions: huber and smooth_l1 only).
  torch::Tensor huber_c;
};

/// The element-wise loss and its Huber schedule, kohya's sd-scripts names (train_util's
/// conditional_loss and get_huber_threshold_if_needed; Diffusers' scheduled-Huber research
/// script is the same formula), for every objective.
struct LossOptions {
  /// --loss_type: l2 (the squared error) | l1 | huber (2 c (sqrt(d^2 + c^2) - c)) | smooth_l1
  /// (2 (sqrt(d^2 + c^2) - c)), d = prediction - target.
  std::string loss_type = "l2";
  /// --huber_schedule: constant (c = huber_c x huber_scale) | exponential (c = exp(-alpha t) x
  /// huber_scale, alpha = -ln(huber_c) / T, t the timestep in 0..T) | snr (c = (1 - huber_c) /
  /// (1 + sigma)^2 + huber_c, sigma = sqrt((1 - alpha_bar_t) / alpha_bar_t): DDPM only).
  std::string huber_schedule = "snr";
  double huber_c = 0.1;      ///< --huber_c
  double huber_scale = 1.0;  ///< --huber_scale
  bool huber() const { return loss_type == "huber" || loss_type == "smooth_l1"; }
};

/// The loss types and Huber schedules LossOptions takes (for messages and --help).
const std::vector<std::string>& loss_types();
const std::vector<std::string>& huber_schedules();

/// The element-wise loss of `prediction` against `target` (both [B, ...]; computed in float32)
/// by options.loss_type, with `huber_c` [B] for huber and smooth_l1 (kohya's conditional_loss
/// with reduction "none").
torch::Tensor elementwise_loss(const torch::Tensor& prediction, const torch::Tensor& target,
                               const LossOptions& options, const torch::Tensor& huber_c);

/// kohya's masked loss (custom_train_functions.apply_masked_loss): `mask` [B, 1, H, W] (or
/// [B, 1, F, H, W] for clips) in [0, 1] at any resolution, resized to `loss`'s spatial grid with
/// area interpolation (frame by frame for clips), then multiplied in. `loss`: [B, C, h, w] or
/// [B, C, F, h, w].
torch::Tensor apply_loss_mask(const torch::Tensor& loss, const torch::Tensor& mask);

/// "Draw a noise level, make the noisy input, the target and the loss weight".
class TrainingObjective {
 public:
  virtual ~TrainingObjective() = default;
  /// For logs and run_info ("ddpm epsilon", "flow matching").
  virtual std::string name() const = 0;
  /// x0: [B, ...] clean samples (latents or pixels) on `device`. Sample i's random draws come
  /// from its own streams, keyed by (seed, epoch, keys[i]) (data/sample_rng.h), so a sample gets
  /// the same noise on any number of ranks and after a resume.
  virtual NoisedBatch noise(const torch::Tensor& x0, const std::vector<int64_t>& keys,
                            int64_t epoch, torch::Device device) const = 0;
  /// The per-sample loss [B] float32: the element-wise loss (loss_options(): the squared error
  /// by default) of `prediction` against batch.target, times `mask` when given
  /// (apply_loss_mask(): kohya's --masked_loss), averaged over every non-batch dimension (as
  /// kohya normalises: the mean over every element, masked ones counted as 0), times
  /// batch.weights when defined.
  torch::Tensor losses(const torch::Tensor& prediction, const NoisedBatch& batch,
                       const torch::Tensor& mask = {}) const;

  /// The element-wise loss; noise() fills NoisedBatch::huber_c by its schedule. Throws
  /// difftrain::Error for an unknown type or schedule, huber_c outside (0, 1], or a schedule
  /// the objective cannot compute (snr under flow matching).
  virtual void set_loss_options(LossOptions options);
  const LossOptions& loss_options() const { return loss_; }

 protected:
  LossOptions loss_;
};

/// Options of Diffusers' DDPM training scripts.
struct DdpmObjectiveOptions {
  std::optional<double> snr_gamma;  ///< min-SNR-gamma loss weights (--snr_gamma)
  double noise_offset = 0.0;        ///< per-channel offset noise (--noise_offset)
  double input_perturbation = 0.0;  ///< --input_perturbation
  /// kohya's multi-resolution ("pyramid") noise: --multires_noise_iterations (0: none) and
  /// --multires_noise_discount (pyramid_noise()).
  int64_t multires_noise_iterations = 0;
  double multires_noise_discount = 0.3;
  LossOptions loss;   ///< the element-wise loss (set_loss_options())
  uint64_t seed = 0;  ///< the per-sample streams
};

/// kohya's pyramid_noise_like for one sample: to `noise` [C, H, W] (or a clip [C, F, H, W],
/// frame by frame) it adds, for i = 0 .. iterations-1, a draw of shape [C, max(1, floor(H /
/// r^i)), max(1, floor(W / r^i))] upsampled bilinearly to H x W times discount^i, r = 2 + 2 x
/// U[0, 1) drawn per level from `generator` (stopping after a level 1 pixel high or wide), then
/// divides by the result's standard deviation. kohya draws r once per batch and normalises over
/// the whole batch; difftrain draws and normalises per sample, so a sample's noise does not
/// depend on its batch mates (world-size invariance).
torch::Tensor pyramid_noise(const torch::Tensor& noise, at::Generator& generator,
                            int64_t iterations, double discount);

/// Diffusers' DDPM objective on a DDPMScheduler: t ~ U{0, ..., T-1}, noisy = add_noise(x0, noise
/// (+ perturbation), t), target = noise / velocity / x0 by the scheduler's prediction_type, loss
/// weights min-SNR-gamma (when set).
class DdpmObjective : public TrainingObjective {
 public:
  DdpmObjective(std::shared_ptr<NoiseScheduler> scheduler, DdpmObjectiveOptions options);
  std::string name() const override;
  NoisedBatch noise(const torch::Tensor& x0, const std::vector<int64_t>& keys, int64_t epoch,
                    torch::Device device) const override;
  /// The noise scheduler (its config goes into checkpoints and validation samplers).
  const std::shared_ptr<NoiseScheduler>& scheduler() const { return scheduler_; }

 private:
  std::shared_ptr<NoiseScheduler> scheduler_;
  DdpmObjectiveOptions options_;
};

}  // namespace difftrain::diffusion
