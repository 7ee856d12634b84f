#pragma once
// The one precedence merge of difftrain's settings, used by `difftrain launch`
// (launch::resolve_launch_options()) and by `difftrain train` (train::parse_train_config()):
//
//   defaults  <-  config files (in the order given)  <-  environment  <-  flags
//
// Each source is a SettingLayer of {name, value} pairs under difftrain's option names
// (mixed_precision, gradient_accumulation_steps, sharding_strategy, fsdp_min_num_params, ...).
// A higher source wins; within one source the later layer wins. A value a config file states that
// a higher layer replaces with a different one is listed in MergedSettings::overrides, so a
// caller can say so (the trainer warns; the launcher does not). See docs/SHARDING.md and
// docs/launch.md.

#include <nlohmann/json.hpp>

#include <cstddef>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::settings {

struct ExternalTrainingConfig;  // difftrain/settings/sharding_config.h
struct ShardingOptions;         // difftrain/settings/sharding_options.h

/// Where a layer's values come from, lowest precedence first.
enum class SettingSource { kDefault, kConfigFile, kEnvironment, kFlag };

/// What one source says.
struct SettingLayer {
  SettingSource source = SettingSource::kConfigFile;
  /// Names the source in messages: a file's path, "environment", "flags".
  std::string origin;
  /// {name, value} for each setting this source sets, in the order they are reported.
  std::vector<std::pair<std::string, nlohmann::json>> values;
  /// Names set only as part of a group (the FSDP fields that come with a sharding strategy at
  /// their defaults): replacing them is not worth an override note.
  std::vector<std::string> implied;

  /// Adds (or replaces) `name`; `stated` false marks it implied.
  void set(const std::string& name, nlohmann::json value, bool stated = true);
  /// The value of `name` in this layer, or nullptr.
  const nlohmann::json* find(const std::string& name) const;
};

/// A setting's winning value and the layer it came from.
struct MergedSetting {
  std::string name;
  nlohmann::json value;
  size_t layer = 0;  ///< index into the merged layers
  SettingSource source = SettingSource::kDefault;
};

/// A value that a config file (or the environment) states and a higher layer replaced with a
/// different one.
struct SettingOverride {
  std::string name;
  nlohmann::json value;       ///< the winning value
  nlohmann::json overridden;  ///< the lower layer's value
  size_t layer = 0;           ///< index of the lower layer
  SettingSource by = SettingSource::kFlag;
};

/// The result of merge_settings().
struct MergedSettings {
  /// One entry per name set by any layer, in the order names first appear (layers in precedence
  /// order).
  std::vector<MergedSetting> settings;
  /// In the order of the overridden layers (as given), then of their values.
  std::vector<SettingOverride> overrides;

  /// The entry of `name`, or nullptr when no layer sets it.
  const MergedSetting* find(const std::string& name) const;
};

/// Merges `layers` (any order): sorted by source, stably, and applied lowest first, so the
/// highest source wins and, within a source, the last layer given.
MergedSettings merge_settings(const std::vector<SettingLayer>& layers);

/// A DeepSpeed or Accelerate file's values as a config-file layer, under the trainer's option
/// names: with `ext.sharding_set`, sharding_strategy (canonical name) and the FSDP fields
/// fsdp_auto_wrap_policy, fsdp_transformer_layer_cls_to_wrap (comma-joined),
/// fsdp_min_num_params, fsdp_forward_prefetch, fsdp_backward_prefetch (implied where at
/// ShardingOptions' defaults, or an empty class list); then mixed_precision,
/// gradient_accumulation_steps, max_grad_norm (DeepSpeed gradient_clipping) and
/// train_batch_size (train_micro_batch_size_per_gpu) when the file sets them.
SettingLayer external_config_layer(const ExternalTrainingConfig& ext, const std::string& origin);

/// `base` with the sharding settings of `merged` (the names external_config_layer() uses) put
/// in; the class list is split on commas.
ShardingOptions merged_sharding_options(const MergedSettings& merged, ShardingOptions base);

}  // namespace difftrain::settings
