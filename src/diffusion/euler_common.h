#pragma once
// What EulerDiscreteScheduler (euler.cpp) and EulerAncestralDiscreteScheduler
// (euler_ancestral.cpp) share in Diffusers 0.31: the training sigmas, the sigma and timestep
// tables, init_noise_sigma, scale_model_input and the step index. Private to src/diffusion.

#include "sampler_classes.h"

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::diffusion::detail {

/// The base of the two Euler samplers. A subclass reads betas_ and, with read_spacing(),
/// timestep_spacing and steps_offset; fills the training tables with set_training_tables(); and
/// in set_timesteps() calls spaced_timesteps(), set_sigmas() and sets timesteps_.
class EulerSamplerBase : public Sampler {
 public:
  std::string class_name() const override { return class_name_; }
  const torch::Tensor& timesteps() const override { return timesteps_; }
  torch::Tensor sigmas() const override { return sigmas_; }

  /// max(sigmas) for "linspace" and "trailing" spacing, else (max(sigmas)^2 + 1)^0.5.
  double init_noise_sigma() const override;

  /// sample / (sigma^2 + 1)^0.5 with the sigma of `timestep`'s step. sample: [B, C, H, W].
  torch::Tensor scale_model_input(const torch::Tensor& sample, double timestep) override;

 protected:
  explicit EulerSamplerBase(std::string class_name) : class_name_(std::move(class_name)) {}

  /// timestep_spacing (default "linspace") and steps_offset (default 0, >= 0).
  void read_spacing(const ConfigReader& r);

  /// train_sigmas_ from alphas_cumprod (float32 [T]), and the tables before set_timesteps():
  /// sigmas_ every training sigma descending then 0 (float32 [T + 1]), timesteps_ T - 1 .. 0
  /// (float32 [T]).
  void set_training_tables(const torch::Tensor& alphas_cumprod);

  /// The float32 timesteps of set_timesteps(n) with timestep_spacing_ and steps_offset_.
  std::vector<float> spaced_timesteps(int64_t n) const;

  /// sigmas_ = the float64 `sigmas` rounded to float32, then `last` (float32 [L + 1]); the next
  /// step looks its index up again.
  void set_sigmas(const std::vector<double>& sigmas, float last);

  /// The index of `timestep` in timesteps_, looked up on the first call after set_timesteps().
  int64_t step_index(double timestep);

  /// sigmas_[i] as a 0-dim float32 tensor; an error past the last sigma.
  torch::Tensor sigma_at(int64_t i) const;

  std::string class_name_;
  SchedulerConfig betas_;
  std::string timestep_spacing_;
  int64_t steps_offset_ = 0;
  std::vector<float> train_sigmas_;  // [T]
  torch::Tensor timesteps_;          // float32 [L]
  torch::Tensor sigmas_;             // float32 [L + 1]
  std::optional<int64_t> step_index_;
};

}  // namespace difftrain::diffusion::detail
