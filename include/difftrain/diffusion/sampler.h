#pragma once
// The sampling side of Diffusers' schedulers (0.31), one interface for all of them: DDPM, DDIM,
// PNDM, Euler, Euler ancestral, DPM-Solver++ (2M, Karras, SDE), UniPC and flow-matching Euler.
// The pipelines run every one of them with Diffusers' loop:
//
//     auto sampler = load_sampler("model/scheduler/scheduler_config.json", "");  // the folder's
//     class sampler->set_timesteps(30); torch::Tensor x = at::randn(shape, gen) *
//     sampler->init_noise_sigma(); for (int64_t i = 0; i < sampler->timesteps().size(0); ++i) {
//       const double t = sampler->timestep(i);
//       torch::Tensor eps = unet(sampler->scale_model_input(x, t), sampler->timesteps()[i]);
//       x = sampler->step(eps, t, x, gen);
//     }
//
// Training keeps using NoiseScheduler (noise_scheduler.h): the forward process is DDPM's for every
// one of these samplers, as in Diffusers' training scripts.

#include <ATen/core/Generator.h>
#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::diffusion {

/// Options that are arguments of a pipeline call in Diffusers, not scheduler config fields.
struct SamplerOptions {
  /// DDIMScheduler.step's eta (0: deterministic DDIM). Ignored by the other samplers.
  double eta = 0.0;
};

/// Arguments of Diffusers' `set_timesteps` beyond the step count, which only some classes take.
struct TimestepOptions {
  /// Custom sigmas in place of the class's own spacing, float64, decreasing, in (0, 1] for flow
  /// matching (FluxPipeline passes numpy's linspace(1, 1/N, N)). Empty: the class's spacing.
  std::vector<double> sigmas;
  /// The time shift of dynamic shifting (FluxPipeline's `calculate_shift` of the image sequence
  /// length; see flow_match_mu()). Required when the config has use_dynamic_shifting true.
  std::optional<double> mu;
};

/// FluxPipeline's `calculate_shift`: mu for an image of `image_seq_len` packed latent tokens,
/// linear between (base_image_seq_len, base_shift) and (max_image_seq_len, max_shift), in float64:
/// mu = L * m + b, m = (max_shift - base_shift) / (max_len - base_len), b = base_shift - m *
/// base_len. The four values come from the scheduler's config (Diffusers' defaults 256, 4096,
/// 0.5, 1.15 when absent or null).
double flow_match_mu(int64_t image_seq_len, const nlohmann::json& scheduler_config);

/// One Diffusers scheduler as a sampler. Stateful like Diffusers' objects: set_timesteps() resets
/// the step counter and the multistep history, and step() must be called once per timestep, in
/// order.
class Sampler {
 public:
  virtual ~Sampler() = default;
  Sampler(const Sampler&) = delete;
  Sampler& operator=(const Sampler&) = delete;

  /// Diffusers' class name, e.g. "EulerDiscreteScheduler".
  virtual std::string class_name() const = 0;

  /// The config this sampler runs with: every init argument of the class with the file's value
  /// or the class's default, plus _class_name; what Diffusers' `scheduler.config` shows (and what
  /// save_config writes, minus _diffusers_version).
  virtual nlohmann::json config() const = 0;

  /// Chooses the inference timesteps (and sigmas) for `num_inference_steps` >= 1 and resets the
  /// step counter and history. Diffusers: `set_timesteps(num_inference_steps)`. Throws
  /// difftrain::Error for a count the config cannot take.
  virtual void set_timesteps(int64_t num_inference_steps) = 0;

  /// set_timesteps() with Diffusers' extra arguments (`set_timesteps(num_inference_steps,
  /// sigmas=..., mu=...)`, as `retrieve_timesteps` passes them). The default takes empty options
  /// only and refuses the rest naming the class; flow matching takes both.
  virtual void set_timesteps_with(int64_t num_inference_steps, const TimestepOptions& options);

  /// The timesteps of the loop on the CPU, as Diffusers stores them: int64 [L] (DDPM, DDIM, PNDM,
  /// DPM-Solver, UniPC) or float32 [L] (Euler, Euler ancestral, flow matching). L may exceed
  /// num_inference_steps (PNDM repeats one timestep). Pass timesteps()[i] to the model.
  virtual const torch::Tensor& timesteps() const = 0;

  /// timesteps()[i] as a double (exact for both dtypes).
  double timestep(int64_t i) const;

  /// float32 [L + 1] sigmas on the CPU for the sigma-based samplers, undefined otherwise.
  virtual torch::Tensor sigmas() const { return {}; }

  /// The standard deviation of the initial noise (Diffusers: `init_noise_sigma`): 1 for most;
  /// Euler's is sqrt(sigma_max^2 + 1) or sigma_max depending on timestep_spacing. Valid after
  /// set_timesteps().
  virtual double init_noise_sigma() const { return 1.0; }

  /// The model input for `sample` at `timestep` (Diffusers: `scale_model_input`); the Euler
  /// samplers divide by sqrt(sigma^2 + 1), the others return sample unchanged.
  virtual torch::Tensor scale_model_input(const torch::Tensor& sample, double timestep) {
    (void)timestep;
    return sample;
  }

  /// One reverse step: x_{t-1} from model_output and sample (x_t), both [B, C, ...] of one shape.
  /// Noise, where the sampler draws any, comes from at::randn(sample's shape, generator) in
  /// float32 on the CPU when a CPU generator is given (Diffusers' randn_tensor), then moves to
  /// sample's device and dtype. Diffusers: `step(model_output, timestep, sample,
  /// generator=...).prev_sample`.
  virtual torch::Tensor step(const torch::Tensor& model_output, double timestep,
                             const torch::Tensor& sample,
                             std::optional<at::Generator> generator = std::nullopt) = 0;

 protected:
  Sampler() = default;
};

/// The sampler names `--scheduler` takes, each with the Diffusers class and settings it stands
/// for: "ddpm", "ddim", "pndm", "euler", "euler_karras", "euler_ancestral", "dpmpp_2m",
/// "dpmpp_2m_karras", "dpmpp_2m_sde", "dpmpp_2m_sde_karras", "unipc", "flow_match_euler".
/// Diffusers class names ("EulerDiscreteScheduler", ...) are accepted too.
std::vector<std::string> sampler_names();

/// A sampler from a scheduler_config.json object. kind "" = the config's _class_name; otherwise a
/// name of sampler_names() whose class is built from the config as Diffusers'
/// `Class.from_config(config)` does (fields the class has are taken from the file, the others get
/// the class's defaults; keys listed in _use_default_values are dropped first) and then the name's
/// settings are applied (e.g. "dpmpp_2m_karras": use_karras_sigmas true). `source` names the
/// config in errors. Throws difftrain::Error for an unknown kind or class (listing the supported
/// ones) and for bad field values (naming the field).
std::unique_ptr<Sampler> make_sampler(const nlohmann::json& scheduler_config,
                                      const std::string& kind, const std::string& source,
                                      const SamplerOptions& options = {});

/// make_sampler() of the scheduler_config.json at `path`.
std::unique_ptr<Sampler> load_sampler(const std::string& path, const std::string& kind,
                                      const SamplerOptions& options = {});

}  // namespace difftrain::diffusion
