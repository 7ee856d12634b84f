// The shared part of the two Euler samplers (see euler_common.h).

#include "euler_common.h"

#include "difftrain/core/error.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

namespace difftrain::diffusion::detail {

double EulerSamplerBase::init_noise_sigma() const {
  const torch::Tensor max_sigma = sigmas_.max();
  if (timestep_spacing_ == "linspace" || timestep_spacing_ == "trailing") {
    return max_sigma.item<double>();
  }
  return (max_sigma.pow(2) + 1).pow(0.5).item<double>();
}

torch::Tensor EulerSamplerBase::scale_model_input(const torch::Tensor& sample, double timestep) {
  const torch::Tensor sigma = sigma_at(step_index(timestep));
  return sample / (sigma.pow(2) + 1).pow(0.5);
}

void EulerSamplerBase::read_spacing(const ConfigReader& r) {
  timestep_spacing_ =
      r.get_choice("timestep_spacing", "linspace", {"linspace", "leading", "trailing"});
  steps_offset_ = r.get_non_negative_int("steps_offset", 0);
}

void EulerSamplerBase::set_training_tables(const torch::Tensor& alphas_cumprod) {
  train_sigmas_ = sigmas_from_alphas_cumprod(alphas_cumprod);
  std::vector<float> sig(train_sigmas_.rbegin(), train_sigmas_.rend());
  sig.push_back(0.0f);
  sigmas_ = torch::tensor(sig, torch::kFloat32);
  std::vector<float> ts;
  for (int64_t t = betas_.num_train_timesteps - 1; t >= 0; --t) ts.push_back(static_cast<float>(t));
  timesteps_ = torch::tensor(ts, torch::kFloat32);
}

std::vector<float> EulerSamplerBase::spaced_timesteps(int64_t n) const {
  return spaced_float_timesteps(betas_.num_train_timesteps, n,
                                parse_timestep_spacing(timestep_spacing_), steps_offset_,
                                class_name_);
}

void EulerSamplerBase::set_sigmas(const std::vector<double>& sigmas, float last) {
  std::vector<float> sig32;
  for (double s : sigmas) sig32.push_back(static_cast<float>(s));
  sig32.push_back(last);
  sigmas_ = torch::tensor(sig32, torch::kFloat32);
  step_index_.reset();
}

int64_t EulerSamplerBase::step_index(double timestep) {
  if (!step_index_) step_index_ = index_for_timestep(timesteps_, timestep, class_name_);
  return *step_index_;
}

torch::Tensor EulerSamplerBase::sigma_at(int64_t i) const {
  if (i < 0 || i >= sigmas_.size(0)) {
    throw Error(class_name_ + "::step: step " + std::to_string(i) +
                " is past the last sigma; call set_timesteps() again before a new loop");
  }
  return sigmas_[i];
}

}  // namespace difftrain::diffusion::detail
