#pragma once
// The settings of a noise scheduler: Diffusers' scheduler_config.json for DDPMScheduler and
// DDIMScheduler (Diffusers 0.31), read with Diffusers' defaults and written back so that Diffusers
// loads it.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::diffusion {

/// How the betas are laid out over the training timesteps (`beta_schedule`).
enum class BetaSchedule {
  kLinear,           ///< "linear": torch.linspace(beta_start, beta_end, T) in float32
  kScaledLinear,     ///< "scaled_linear": linspace(sqrt(beta_start), sqrt(beta_end), T) ** 2
  kSquaredcosCapV2,  ///< "squaredcos_cap_v2": Glide's cosine schedule, betas capped at 0.999
  kSigmoid,          ///< "sigmoid": GeoDiff's schedule; DDPMScheduler only, as in Diffusers
};

/// What the model predicts (`prediction_type`).
enum class PredictionType {
  kEpsilon,      ///< "epsilon": the noise
  kVPrediction,  ///< "v_prediction": the velocity sqrt(a) * noise - sqrt(1 - a) * x0
  kSample,       ///< "sample": the clean sample x0
};

/// The variance of DDPMScheduler's reverse step (`variance_type`; DDIM ignores it).
enum class VarianceType {
  kFixedSmall,     ///< "fixed_small": the posterior variance, clamped at 1e-20
  kFixedSmallLog,  ///< "fixed_small_log": the same variance through exp(0.5 * log(v))
  kFixedLarge,     ///< "fixed_large": beta_t
  kFixedLargeLog,  ///< "fixed_large_log": accepted in files, refused by DDPMScheduler (see there)
  kLearned,        ///< "learned": the model's second half of channels is the variance
  kLearnedRange,   ///< "learned_range": the model interpolates between the two log variances
};

/// How set_timesteps() spreads the inference timesteps (`timestep_spacing`, Table 2 of
/// "Common Diffusion Noise Schedules and Sample Steps are Flawed").
enum class TimestepSpacing {
  kLeading,   ///< "leading": 0, r, 2r, ... (r = T // n) plus steps_offset, descending
  kTrailing,  ///< "trailing": round(T - i * T / n) - 1, i = 0 .. n-1; starts at T - 1
  kLinspace,  ///< "linspace": round(linspace(0, T - 1, n)), descending
};

/// The Diffusers name of each value ("linear", "v_prediction", ...), as written in
/// scheduler_config.json.
std::string to_string(BetaSchedule value);
std::string to_string(PredictionType value);
std::string to_string(VarianceType value);
std::string to_string(TimestepSpacing value);

/// Parse a Diffusers name, matched exactly (case-sensitive, as Diffusers compares strings). An
/// unknown name throws difftrain::Error naming the field, the bad value and the supported values.
BetaSchedule parse_beta_schedule(const std::string& name);
PredictionType parse_prediction_type(const std::string& name);
VarianceType parse_variance_type(const std::string& name);
TimestepSpacing parse_timestep_spacing(const std::string& name);

/// Parses JSON text as Python's json module writes it. Diffusers saves float fields that are
/// infinite or NaN (DPMSolverMultistepScheduler's default lambda_min_clipped = -inf) as the bare
/// tokens -Infinity, Infinity and NaN, which JSON does not have; outside strings they are read as
/// the strings "-Infinity", "Infinity" and "NaN", which every numeric field of the scheduler
/// configs accepts as those numbers. Any other syntax error throws nlohmann::json::parse_error.
nlohmann::json parse_python_json(const std::string& text);

/// json.dump(indent) with the strings "-Infinity", "Infinity" and "NaN" written back as Python's
/// bare tokens, so Diffusers reads them as floats again.
std::string dump_python_json(const nlohmann::json& json, int indent = 2);

/// Every field Diffusers' DDPMScheduler and DDIMScheduler take from scheduler_config.json, with
/// Diffusers' defaults. One struct serves both classes: each reads the fields it knows (DDPM:
/// variance_type; DDIM: set_alpha_to_one) and ignores the other's, like Diffusers does.
struct SchedulerConfig {
  /// `_class_name`: "DDPMScheduler", "DDIMScheduler" or another Diffusers scheduler whose config
  /// is being reused (Diffusers' training scripts load Stable Diffusion's PNDMScheduler config into
  /// a DDPMScheduler). Empty when the file has none.
  std::string class_name = "DDPMScheduler";
  /// `num_train_timesteps`: T, the length of the beta table. At least 1.
  int64_t num_train_timesteps = 1000;
  /// `beta_start`, `beta_end`: the first and last beta of linear, scaled_linear and sigmoid.
  /// In [0, 1).
  double beta_start = 0.0001;
  double beta_end = 0.02;
  /// `beta_schedule`.
  BetaSchedule beta_schedule = BetaSchedule::kLinear;
  /// `trained_betas`: T betas given directly; when set, beta_schedule/start/end are not used.
  std::optional<std::vector<double>> trained_betas;
  /// `variance_type` (DDPMScheduler).
  VarianceType variance_type = VarianceType::kFixedSmall;
  /// `clip_sample`, `clip_sample_range`: clamp the predicted x0 to [-range, range] in step().
  bool clip_sample = true;
  double clip_sample_range = 1.0;
  /// `prediction_type`.
  PredictionType prediction_type = PredictionType::kEpsilon;
  /// `thresholding`, `dynamic_thresholding_ratio`, `sample_max_value`: Imagen's dynamic
  /// thresholding of the predicted x0 in step() (replaces clip_sample when on). The ratio is a
  /// quantile in (0, 1]; sample_max_value > 0.
  bool thresholding = false;
  double dynamic_thresholding_ratio = 0.995;
  double sample_max_value = 1.0;
  /// `timestep_spacing`, `steps_offset` (added to "leading" timesteps only, as in Diffusers;
  /// Stable Diffusion uses 1). steps_offset >= 0.
  TimestepSpacing timestep_spacing = TimestepSpacing::kLeading;
  int64_t steps_offset = 0;
  /// `set_alpha_to_one` (DDIMScheduler): the alpha-bar "before" timestep 0 is 1 (true) or
  /// alphas_cumprod[0] (false).
  bool set_alpha_to_one = true;
  /// `rescale_betas_zero_snr`: rescale the betas so the last timestep has zero SNR
  /// (Algorithm 1 of "Common Diffusion Noise Schedules and Sample Steps are Flawed").
  bool rescale_betas_zero_snr = false;
  /// Keys this struct does not know (e.g. PNDMScheduler's skip_prk_steps), kept verbatim so that
  /// to_json() writes them back. Keys starting with '_' other than _class_name are dropped.
  nlohmann::json extra = nlohmann::json::object();

  /// Reads a scheduler_config.json object. Missing fields (and `trained_betas: null`) take
  /// Diffusers' defaults, unknown keys go to `extra`. Throws difftrain::Error, one line naming
  /// `source` (the file, used only in messages), the field, the bad value and what is expected:
  /// for a wrong JSON type (integers must be JSON integers, booleans JSON booleans), an unknown
  /// enum value (listing the supported ones), and the range checks of validate(). Diffusers:
  /// `ConfigMixin.from_config` / `extract_init_dict`.
  static SchedulerConfig from_json(const nlohmann::json& json, const std::string& source);

  /// Reads and parses the file at `path` (a scheduler_config.json), as from_json. Diffusers:
  /// `DDPMScheduler.from_pretrained(folder, subfolder="scheduler")` minus the download.
  static SchedulerConfig load(const std::string& path);

  /// from_json() of scheduler_config.json text already in memory; `source` names it in errors.
  static SchedulerConfig parse(const std::string& json_text, const std::string& source);

  /// The scheduler_config.json Diffusers 0.31 would write for `class_name`: `_class_name`,
  /// `_diffusers_version` "0.31.0", every init argument of that class (DDPMScheduler: no
  /// set_alpha_to_one; DDIMScheduler: no variance_type; any other class name: all fields), and
  /// `extra`. Keys are sorted (nlohmann's object), as Diffusers' `to_json_string` sorts them.
  nlohmann::json to_json() const;

  /// Writes to_json() to `path` as Diffusers does (indent 2, trailing newline), atomically.
  void save(const std::string& path) const;

  /// Range checks: num_train_timesteps >= 1, betas in [0, 1) and finite, trained_betas of length
  /// num_train_timesteps, clip_sample_range > 0, dynamic_thresholding_ratio in (0, 1],
  /// sample_max_value > 0, steps_offset >= 0. Throws difftrain::Error naming `source` when given.
  void validate(const std::string& source = "") const;

  bool operator==(const SchedulerConfig& other) const;
  bool operator!=(const SchedulerConfig& other) const { return !(*this == other); }
};

}  // namespace difftrain::diffusion
