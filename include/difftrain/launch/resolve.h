#pragma once
// `difftrain launch`'s settings from its flags, its config file and a DeepSpeed file, merged
// once by settings::merge_settings() (difftrain/settings/config_merge.h): the CLI only parses
// arguments and calls resolve_launch_options(). See docs/launch.md ("Config files").

#include "difftrain/launch/launcher.h"

#include <functional>
#include <set>
#include <string>

namespace difftrain::launch {

/// The command line of `difftrain launch`, before merging.
struct LaunchFlags {
  /// Every flag's value: what was given, else LaunchOptions' default. `command` is the program.
  LaunchOptions options;
  /// Names of the flags given, as Accelerate spells them: num_processes, mixed_precision,
  /// sharding_strategy, ...
  std::set<std::string> given;
  /// --config_file; "" = default_config_path() when that file exists, else none.
  std::string config_file;
  /// --sharding_strategy (used when "sharding_strategy" is in `given`).
  std::string sharding_strategy;
  /// --deepspeed_config_file ("" = none).
  std::string deepspeed_config_file;
  /// --offload_optimizer_device / --offload_param_device (none | cpu; used when given).
  std::string offload_optimizer_device;
  std::string offload_param_device;
};

/// The options `difftrain launch` runs with, by the one merge of
///   LaunchOptions' defaults <- the config file (its launch keys, then, for an Accelerate file,
///   the fsdp_config / deepspeed_config sections and their deepspeed_config_file)
///   <- --deepspeed_config_file <- the flags given.
/// The launcher reads no environment of its own here (DIFFTRAIN_JOIN_TIMEOUT is read by run()).
/// A sharding strategy from any of them reaches the ranks as DIFFTRAIN_SHARDING_STRATEGY and
/// DIFFTRAIN_FSDP_* in `extra_env` (settings::sharding_env()). Each line for the user (notes on the
/// config file, warnings about what the files ask for and cannot be honoured) goes to `report`
/// as soon as it is known, without a trailing newline. Throws difftrain::Error for unreadable or
/// invalid files and a bad --sharding_strategy.
LaunchOptions resolve_launch_options(const LaunchFlags& flags,
                                     const std::function<void(const std::string&)>& report);

}  // namespace difftrain::launch
