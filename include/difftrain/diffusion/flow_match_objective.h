#pragma once
// Rectified-flow (flow-matching) training, as Diffusers' SD3/FLUX training scripts
// (train_dreambooth_lora_flux.py, training_utils.compute_density_for_timestep_sampling and
// compute_loss_weighting_for_sd3) and kohya's sd-scripts (flux_train_utils
// get_noisy_model_input_and_timesteps) do it:
//
//   sigma  in [0, 1] per sample (how it is drawn: FlowMatchOptions::timestep_sampling)
//   noisy  = (1 - sigma) * x0 + sigma * noise
//   target = noise - x0
//   t      = the timestep the model is given, 1000 * sigma (the transformer divides by 1000)
//   weight = none (1), cosmap 2 / (pi (1 - 2 sigma + 2 sigma^2)), sigma_sqrt sigma^-2
//
// Diffusers' way ("sigma", the default): u from the density of --weighting_scheme, then
// index = (u * N).long() into the scheduler's own training tables (FlowMatchEulerDiscreteScheduler
// built from the folder's config and never set_timesteps: N timesteps that are float32
// roundings, shifted by `shift` unless use_dynamic_shifting). kohya's continuous ways: uniform,
// sigmoid, shift (--discrete_flow_shift), and those families register (FLUX.1's flux_shift: mu
// from the latent size). Latents are images [B, C, H, W] or clips [B, C, F, H, W].

#include "difftrain/diffusion/objective.h"

#include <ATen/core/Generator.h>
#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace difftrain::diffusion {

/// The flags of Diffusers' and kohya's flow-matching training.
struct FlowMatchOptions {
  /// Diffusers' --weighting_scheme: none | logit_normal | mode | cosmap | sigma_sqrt. With
  /// timestep_sampling "sigma" it picks the density of u (logit_normal, mode; the others draw u
  /// uniformly) and the loss weight (cosmap, sigma_sqrt; the others weigh 1).
  std::string weighting_scheme = "none";
  double logit_mean = 0.0;   ///< --logit_mean (logit_normal)
  double logit_std = 1.0;    ///< --logit_std (logit_normal)
  double mode_scale = 1.29;  ///< --mode_scale (mode)
  /// kohya's --timestep_sampling: sigma (Diffusers' tables, above) | uniform | sigmoid | shift |
  /// a registered one (FlowTimestepSampling). All but sigma draw sigma continuously and are not
  /// bound to the tables.
  std::string timestep_sampling = "sigma";
  /// --sigmoid_scale (sigmoid, shift and the registered samplings)
  double sigmoid_scale = 1.0;
  double discrete_flow_shift = 3.0;  ///< --discrete_flow_shift (shift)
  /// musubi-tuner's / kohya's --min_timestep / --max_timestep (0..1000): a continuous sampling's
  /// sigma becomes sigma * (max - min) / 1000 + min / 1000 (training one of Wan 2.2's experts on
  /// its noise range). Not with "sigma".
  double min_timestep = 0.0, max_timestep = 1000.0;
  /// The element-wise loss (kohya's --loss_type and Huber schedule; set_loss_options()).
  LossOptions loss;
  uint64_t seed = 0;  ///< the per-sample streams
};

/// A timestep sampling a family adds to flow matching: kohya's sigmoid draw, then a shift that
/// depends on the latents' size (FLUX.1's kohya `flux_shift`, registered by its family).
struct FlowTimestepSampling {
  std::string name;  ///< the --timestep_sampling value
  /// sigmas [B] float32 from the sigmoid draws `u` [B] for latents of shape `x0_shape` (images
  /// [B, C, H, W] or clips [B, C, F, H, W]); throws difftrain::Error for a shape it cannot size.
  std::function<torch::Tensor(const torch::Tensor& u, torch::IntArrayRef x0_shape)> shift;
};
/// Adds `sampling` (a name already taken is refused by a difftrain::Error).
void register_flow_timestep_sampling(FlowTimestepSampling sampling);

/// The weighting schemes and timestep samplings the options take (the built-in samplings, then
/// the registered ones), for messages and --help.
std::vector<std::string> flow_weighting_schemes();
std::vector<std::string> flow_timestep_samplings();

/// Flow matching on a FlowMatchEulerDiscreteScheduler config (its training tables).
class FlowMatchObjective : public TrainingObjective {
 public:
  /// `scheduler_config`: the folder's scheduler_config.json object (a FlowMatchEuler one);
  /// `source` names it in errors. Throws difftrain::Error for an unknown scheme or sampling
  /// (listing the known ones) or bad values (logit_std <= 0, discrete_flow_shift <= 0, ...).
  FlowMatchObjective(const nlohmann::json& scheduler_config, const std::string& source,
                     FlowMatchOptions options);

  std::string name() const override;
  /// As TrainingObjective's, refusing --huber_schedule snr (flow matching has no alpha_bar; kohya
  /// refuses it too). The Huber thresholds' t is 1000 x sigma (kohya's FLUX.1 timesteps).
  void set_loss_options(LossOptions options) override;

  /// Sample i's noise (x0's shape, float32) from its kNoise stream and its draw from its
  /// kTimestep stream (data/sample_rng.h), then from_draws().
  NoisedBatch noise(const torch::Tensor& x0, const std::vector<int64_t>& keys, int64_t epoch,
                    torch::Device device) const override;

  /// The value u each sample's generator gives: Diffusers' compute_density_for_timestep_sampling
  /// for one sample under "sigma" (logit_normal: sigmoid(N(mean, std)); mode: 1 - u -
  /// mode_scale (cos^2(pi u / 2) - 1 + u); else U[0, 1)), or kohya's sigma under the others
  /// (before a registered sampling's size-dependent shift, which from_draws applies). Float32 [1].
  torch::Tensor draw(at::Generator& generator) const;

  /// The batch for draws `u` [B] (draw()'s values, float32), noise [B, ...] and x0 [B, ...]
  /// (images or clips). timesteps are float32 [B] (the tables' values or
  /// 1000 * sigma), weights float32 [B] (undefined when every weight is 1).
  NoisedBatch from_draws(const torch::Tensor& x0, const torch::Tensor& noise,
                         const torch::Tensor& u) const;

  /// What from_draws() derives from `u` for a batch of shape `x0_shape`: the indices into the
  /// tables under "sigma" (int64 [B]; undefined otherwise) and each sample's sigma (float32 [B]).
  struct Draws {
    torch::Tensor indices, sigmas;
  };
  Draws sigmas_for(const torch::Tensor& u, torch::IntArrayRef x0_shape) const;

  /// The training tables: timesteps and sigmas, float32 [N].
  const torch::Tensor& train_timesteps() const { return timesteps_; }
  const torch::Tensor& train_sigmas() const { return sigmas_; }
  const FlowMatchOptions& options() const { return options_; }

 private:
  FlowMatchOptions options_;
  torch::Tensor timesteps_, sigmas_;
  int64_t num_train_timesteps_ = 1000;
};

}  // namespace difftrain::diffusion
