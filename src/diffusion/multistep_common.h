#pragma once
// What DPMSolverMultistepScheduler (dpm_solver.cpp) and UniPCMultistepScheduler (unipc.cpp) share
// in Diffusers 0.31: the timestep spacings of their set_timesteps(), the sigma tables, the
// sigma -> (alpha_t, sigma_t, lambda_t) conversions as 0-dim float32 tensors (so every formula
// runs the same torch kernels as Diffusers), dynamic thresholding, the first step's index, and
// the base class with the config fields and loop state both have. Private to src/diffusion.

#include "sampler_classes.h"

#include <ATen/core/Generator.h>
#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::diffusion::detail {

/// The timesteps of set_timesteps(n) before any sigma conversion, descending int64 values:
/// "linspace": round(linspace(0, last - 1, n + 1))[::-1][:-1]; "leading": (arange(n + 1) *
/// (last // (n + 1)))[::-1][:-1] + steps_offset; "trailing": round(arange(last, 0, -T / n)) - 1
/// with numpy's float arange. `last_timestep` is T for UniPC, T minus the lambda_min_clipped
/// count for DPM-Solver. numpy rounds half to even.
std::vector<int64_t> multistep_timesteps(int64_t num_train_timesteps, int64_t last_timestep,
                                         int64_t num_inference_steps, const std::string& spacing,
                                         int64_t steps_offset);

/// How the inference sigmas are chosen.
enum class SigmaSpacing {
  kInterp,  ///< np.interp of the training sigmas at the spaced timesteps
  kKarras,  ///< use_karras_sigmas: Karras et al.'s rho = 7 schedule, timesteps from sigma_to_t
  kLu,      ///< use_lu_lambdas (DPM-Solver): uniform log-SNR, timesteps from sigma_to_t
};

/// The first L sigmas (float64, before the final one is appended) and the int64 timesteps of
/// set_timesteps(n), from the spaced `timesteps` and the float32 training sigmas [T]
/// (sigmas_from_alphas_cumprod). Karras and Lu give n values and replace the timesteps.
void multistep_sigmas(SigmaSpacing spacing, int64_t num_inference_steps,
                      const std::vector<float>& train_sigmas, std::vector<int64_t>& timesteps,
                      std::vector<double>& sigmas);

/// Diffusers' _sigma_to_alpha_sigma_t on a 0-dim float32 tensor: alpha_t = 1 / (sigma^2 + 1)^0.5,
/// sigma_t = sigma * alpha_t.
std::pair<torch::Tensor, torch::Tensor> sigma_to_alpha_sigma_t(const torch::Tensor& sigma);

/// log(alpha_t) - log(sigma_t), 0-dim float32.
torch::Tensor lambda_of(const torch::Tensor& alpha_t, const torch::Tensor& sigma_t);

/// Diffusers' _threshold_sample (Imagen's dynamic thresholding) of x: [B, C, ...], per example:
/// s = the `ratio` quantile of |x| clamped to [1, max_value]; x is clamped to [-s, s] / s.
torch::Tensor threshold_sample(const torch::Tensor& x, double ratio, double max_value,
                               const std::string& who);

/// Diffusers' index_for_timestep: the index of `timestep` in `timesteps` (int64 [L]); the second
/// match when it occurs more than once, L - 1 when it does not occur.
int64_t index_for_timestep(const torch::Tensor& timesteps, double timestep);

/// The SDE noise of one step: float32 randn of `shape` drawn from `generator` on the generator's
/// device (the CPU one in the pipelines), then moved to `device`. Diffusers: randn_tensor.
torch::Tensor draw_step_noise(at::IntArrayRef shape, const torch::Device& device,
                              const std::optional<at::Generator>& generator);

/// The base of DPMSolverMultistepScheduler (dpm_solver.cpp) and UniPCMultistepScheduler
/// (unipc.cpp): the config fields both have, the training sigmas, the tables of set_timesteps(),
/// the history of converted model outputs and the checks at the start of step(). The constructor
/// reads and checks the shared fields; a subclass reads its own after it.
class MultistepSampler : public Sampler {
 public:
  std::string class_name() const override { return class_name_; }
  const torch::Tensor& timesteps() const override { return timesteps_; }
  torch::Tensor sigmas() const override { return sigmas_; }

 protected:
  /// Reads the shared fields of `json` with Diffusers' defaults (solver_order 2, epsilon,
  /// linspace spacing, zero final sigma, ...) and fills alphas_cumprod_ and train_sigmas_.
  /// `source` names the config in errors.
  MultistepSampler(const nlohmann::json& json, const std::string& source, std::string class_name);

  /// _class_name, the beta fields and the shared fields as Diffusers' `scheduler.config` shows
  /// them; a subclass adds its own.
  nlohmann::json shared_config() const;

  /// multistep_timesteps() of set_timesteps(n) up to `last_timestep`, after checking n >= 1;
  /// throws when the spacing gives none.
  std::vector<int64_t> spaced_timesteps(int64_t n, int64_t last_timestep) const;

  /// Stores the tables of set_timesteps(): `timesteps` (int64 [L]) and `sigmas` (float64 [L + 1],
  /// stored as float32), and starts a new loop (empty history, first step looked up again).
  void set_tables(const std::vector<int64_t>& timesteps, const std::vector<double>& sigmas);

  /// The index of `timestep`'s step (looked up on the first step after set_timesteps()), after
  /// checking that set_timesteps() ran and the loop has a step left.
  int64_t begin_step(double timestep);

  /// Adds `converted` as the newest of the last solver_order converted model outputs.
  void push_model_output(const torch::Tensor& converted);

  /// Ends step i: one more step of the warm-up (up to solver_order), and the next step is i + 1.
  void end_step(int64_t i);

  /// Diffusers' convert_model_output for a data-prediction solver: x0 from the model output
  /// (epsilon, sample or v_prediction) at alpha_t, sigma_t (0-dim), thresholded when set.
  torch::Tensor predicted_x0(const torch::Tensor& model_output, const torch::Tensor& sample,
                             const torch::Tensor& alpha_t, const torch::Tensor& sigma_t) const;

  /// The same for a noise-prediction solver: epsilon from the model output (not thresholded).
  torch::Tensor predicted_epsilon(const torch::Tensor& model_output, const torch::Tensor& sample,
                                  const torch::Tensor& alpha_t, const torch::Tensor& sigma_t) const;

  /// threshold_sample() with the config's dynamic_thresholding_ratio and sample_max_value.
  torch::Tensor threshold(const torch::Tensor& x0) const;

  /// Diffusers' _sigma_to_alpha_sigma_t: with use_flow_sigmas (alpha, sigma) = (1 - sigma,
  /// sigma), else sigma_to_alpha_sigma_t().
  std::pair<torch::Tensor, torch::Tensor> alpha_sigma(const torch::Tensor& sigma) const;

  ConfigReader reader_;
  std::string class_name_;
  SchedulerConfig betas_;
  int64_t solver_order_ = 2;
  std::string prediction_type_, timestep_spacing_, final_sigmas_type_;
  bool thresholding_ = false, lower_order_final_ = true;
  bool use_karras_sigmas_ = false, use_exponential_sigmas_ = false, use_beta_sigmas_ = false;
  /// Flow-matching sigmas (use_flow_sigmas): sigma in [0, 1], shifted by flow_shift.
  bool use_flow_sigmas_ = false;
  double flow_shift_ = 1.0;
  double dynamic_thresholding_ratio_ = 0.995, sample_max_value_ = 1.0;
  int64_t steps_offset_ = 0;

  torch::Tensor alphas_cumprod_;     // float32 [T]
  std::vector<float> train_sigmas_;  // [T]

  torch::Tensor timesteps_;  // int64 [L]
  torch::Tensor sigmas_;     // float32 [L + 1]
  int64_t num_inference_steps_ = 0;
  std::vector<torch::Tensor> model_outputs_;  // the last solver_order converted outputs
  int64_t lower_order_nums_ = 0;
  std::optional<int64_t> step_index_;
};

}  // namespace difftrain::diffusion::detail
