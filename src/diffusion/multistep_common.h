#pragma once
// What DPMSolverMultistepScheduler (dpm_solver.cpp) and UniPCMultistepScheduler (unipc.cpp) share
// in Diffusers 0.31: the timestep spacings of their set_timesteps(), the sigma tables, the
// sigma -> (alpha_t, sigma_t, lambda_t) conversions as 0-dim float32 tensors (so every formula
// runs the same torch kernels as Diffusers), dynamic thresholding and the first step's index.
// Private to src/diffusion.

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

/// Writes the beta fields of `reader`'s config into `out` as Diffusers' `scheduler.config` shows
/// them (num_train_timesteps, beta_start, beta_end, beta_schedule, trained_betas,
/// rescale_betas_zero_snr).
void put_beta_fields(const ConfigReader& reader, const SchedulerConfig& betas, nlohmann::json& out);

/// The beta schedules DPM-Solver and UniPC accept (Diffusers raises for "sigmoid").
const std::vector<BetaSchedule>& multistep_beta_schedules();

/// A positive number of inference steps, else difftrain::Error naming `who`.
void check_num_inference_steps(int64_t num_inference_steps, const std::string& who);

}  // namespace difftrain::diffusion::detail
