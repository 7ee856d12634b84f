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
};

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
  /// The per-sample loss [B] float32: the squared error of `prediction` against batch.target,
  /// averaged over every non-batch dimension, times batch.weights when defined.
  torch::Tensor losses(const torch::Tensor& prediction, const NoisedBatch& batch) const;
};

/// Options of Diffusers' DDPM training scripts.
struct DdpmObjectiveOptions {
  std::optional<double> snr_gamma;  ///< min-SNR-gamma loss weights (--snr_gamma)
  double noise_offset = 0.0;        ///< per-channel offset noise (--noise_offset)
  double input_perturbation = 0.0;  ///< --input_perturbation
  uint64_t seed = 0;                ///< the per-sample streams
};

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
