#pragma once
// The sampler classes behind make_sampler() (sampler.cpp), private to src/diffusion. Each factory
// takes the config as make_sampler() resolved it: the file's fields (after _use_default_values was
// dropped) with the --scheduler name's settings applied; each class reads the fields it has with
// its own Diffusers 0.31 defaults through ConfigReader and ignores the rest, as from_config does.

#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/scheduler_config.h"

#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::diffusion::detail {

/// Typed reads of a scheduler config with defaults; every error is one line naming the source,
/// the field, the bad value and what is expected. A JSON null reads as the default (Diffusers
/// writes null for unset optional fields such as sigma_min).
class ConfigReader {
 public:
  ConfigReader(const nlohmann::json& config, std::string source);

  int64_t get_int(const std::string& key, int64_t fallback) const;
  /// get_int(), then checked to be >= 0 (steps_offset).
  int64_t get_non_negative_int(const std::string& key, int64_t fallback) const;
  double get_double(const std::string& key, double fallback) const;
  /// nullopt when absent or null.
  std::optional<double> get_optional_double(const std::string& key) const;
  bool get_bool(const std::string& key, bool fallback) const;
  std::string get_string(const std::string& key, const std::string& fallback) const;
  /// get_string(), then checked against `allowed` (the error lists them).
  std::string get_choice(const std::string& key, const std::string& fallback,
                         const std::vector<std::string>& allowed) const;
  /// A list of integers (UniPC's disable_corrector); empty when absent or null.
  std::vector<int64_t> get_int_list(const std::string& key) const;

  /// The beta fields (num_train_timesteps, beta_start, beta_end, beta_schedule, trained_betas,
  /// rescale_betas_zero_snr) as a SchedulerConfig with DDPM's defaults for the rest, validated.
  /// `allowed` limits beta_schedule to what the class supports (Diffusers raises otherwise).
  SchedulerConfig beta_config(const std::vector<BetaSchedule>& allowed) const;

  /// The float32 [T] alphas_cumprod of beta_config(): cumprod(1 - betas), with
  /// rescale_betas_zero_snr applied to the betas first when `rescale` and the config says so;
  /// when `zero_snr_fix`, the last value is set to 2**-24 afterwards (Diffusers' Euler and
  /// DPM-Solver do this so sigma_T stays finite).
  torch::Tensor alphas_cumprod(const std::vector<BetaSchedule>& allowed, bool rescale,
                               bool zero_snr_fix) const;

  /// "scheduler config <source>: " for messages.
  std::string where() const;
  const nlohmann::json& json() const { return config_; }

 private:
  nlohmann::json config_;
  std::string source_;
};

/// The beta schedules of every sampler class but DDPMScheduler (Diffusers raises for "sigmoid").
const std::vector<BetaSchedule>& sampler_beta_schedules();

/// Writes the beta fields of `betas` into `out` as Diffusers' `scheduler.config` shows them:
/// num_train_timesteps, beta_start, beta_end, beta_schedule and trained_betas (null when unset).
void put_beta_fields(const SchedulerConfig& betas, nlohmann::json& out);

std::unique_ptr<Sampler> make_ddpm_sampler(const nlohmann::json& config, const std::string& source);
std::unique_ptr<Sampler> make_ddim_sampler(const nlohmann::json& config, const std::string& source,
                                           double eta);
std::unique_ptr<Sampler> make_pndm_sampler(const nlohmann::json& config, const std::string& source);
std::unique_ptr<Sampler> make_euler_sampler(const nlohmann::json& config,
                                            const std::string& source);
std::unique_ptr<Sampler> make_euler_ancestral_sampler(const nlohmann::json& config,
                                                      const std::string& source);
std::unique_ptr<Sampler> make_dpm_solver_multistep_sampler(const nlohmann::json& config,
                                                           const std::string& source);
std::unique_ptr<Sampler> make_unipc_sampler(const nlohmann::json& config,
                                            const std::string& source);
std::unique_ptr<Sampler> make_flow_match_euler_sampler(const nlohmann::json& config,
                                                       const std::string& source);

}  // namespace difftrain::diffusion::detail
