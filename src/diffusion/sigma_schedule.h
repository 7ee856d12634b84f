#pragma once
// Tables shared by the sigma-based samplers (Euler, Euler ancestral, DPM-Solver, UniPC), with the
// dtypes Diffusers 0.31 computes them in (numpy float32 vs float64 matters for the last bits).
// Private to src/diffusion.

#include <torch/types.h>

#include <cstdint>
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
/// [0, T - 1]. Returns float64, as numpy does.
double sigma_to_t(double sigma, const std::vector<float>& log_sigmas);

/// numpy.interp(x, arange(len(fp)), fp) in float64 (fp as given, widened to double).
std::vector<double> interp_on_index(const std::vector<double>& x, const std::vector<float>& fp);

/// numpy.linspace(start, stop, n) in float64 (numpy's formula: start + i * step, the last value
/// set to stop exactly).
std::vector<double> linspace(double start, double stop, int64_t n);

}  // namespace difftrain::diffusion::detail
