#pragma once
// Tables shared by the sigma-based samplers (Euler, Euler ancestral, DPM-Solver, UniPC), with the
// dtypes Diffusers 0.31 computes them in (numpy float32 vs float64 matters for the last bits).
// Private to src/diffusion.

#include "difftrain/diffusion/scheduler_config.h"

#include <ATen/core/Generator.h>
#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::diffusion::detail {

/// sigma_t = ((1 - a_t) / a_t) ** 0.5 over alphas_cumprod (float32 [T]), each operation in
/// float32 as torch does it: float32 values as floats [T].
std::vector<float> sigmas_from_alphas_cumprod(const torch::Tensor& alphas_cumprod);

/// np.log of a float32 array: float32 [T].
std::vector<float> log_float32(const std::vector<float>& values);

/// The noise schedule of Karras et al. (2022), Diffusers' `_convert_to_karras`: n float64 values
/// (max^(1/rho) + linspace(0, 1, n) * (min^(1/rho) - max^(1/rho)))^rho, rho = 7.
std::vector<double> karras_sigmas(double sigma_min, double sigma_max, int64_t n);

/// Diffusers' `_sigma_to_t`: the fractional training timestep of `sigma` found by linear
/// interpolation of log(sigma) in `log_sigmas` (float32 [T], ascending with t), clipped to
/// [0, T - 1]. Returns float64, as numpy does; the interpolation weight is float32, as numpy 1.x
/// computes it (a float64 scalar against a float32 array).
double sigma_to_t(double sigma, const std::vector<float>& log_sigmas);

/// numpy.interp(x, arange(len(fp)), fp) in float64 (fp as given, widened to double).
std::vector<double> interp_on_index(const std::vector<double>& x, const std::vector<float>& fp);

/// numpy.linspace(start, stop, n) in float64 (numpy's formula: start + i * step, the last value
/// set to stop exactly).
std::vector<double> linspace(double start, double stop, int64_t n);

/// The timesteps of the Euler samplers' set_timesteps(n) as numpy float32 values, descending:
/// "linspace": linspace(0, T - 1, n) (not rounded); "leading": round(arange(n) * (T // n)) +
/// steps_offset; "trailing": round(arange(T, 0, -T / n)) - 1 (numpy's float arange). Throws for
/// n < 1, and for n > T with "leading" (T // n would be 0). `who` names the caller in errors.
std::vector<float> spaced_float_timesteps(int64_t num_train_timesteps, int64_t num_inference_steps,
                                          TimestepSpacing spacing, int64_t steps_offset,
                                          const std::string& who);

/// Diffusers' `index_for_timestep`: the position of `timestep` in `timesteps` (any dtype, [L]),
/// the second match when it occurs more than once (so a restarted image-to-image loop does not
/// skip a sigma). Throws difftrain::Error naming `who` when it is not there.
int64_t index_for_timestep(const torch::Tensor& timesteps, double timestep, const std::string& who);

/// Step noise as Diffusers' `randn_tensor(like.shape, generator=...)`: at::randn in float32 on the
/// generator's device (the default generator: like's device), then moved to like's device and
/// dtype. like: [B, ...].
torch::Tensor step_noise(const torch::Tensor& like, const std::optional<at::Generator>& generator);

}  // namespace difftrain::diffusion::detail
