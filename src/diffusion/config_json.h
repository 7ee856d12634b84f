#pragma once
// What the readers of scheduler configs share: SchedulerConfig's (scheduler_config.cpp) and the
// samplers' ConfigReader and factory (sampler.cpp). Private to src/diffusion.

#include <nlohmann/json.hpp>

#include <optional>
#include <set>
#include <string>

namespace difftrain::diffusion::detail {

/// "scheduler config <source>" ("scheduler config" when source is empty), how every message
/// about a config starts.
std::string where_of(const std::string& source);

/// The fields of DDPMScheduler's and DDIMScheduler's __init__ together (Diffusers 0.31), the ones
/// SchedulerConfig reads (anything else in a file goes to `extra`). DDPM has no set_alpha_to_one,
/// DDIM no variance_type.
const std::set<std::string>& noise_scheduler_keys();

/// The text of the scheduler config file at `path`; difftrain::Error naming the path and what to
/// give instead when it cannot be read.
std::string read_config_text(const std::string& path);

/// A JSON value for a message, short and on one line: its dump (cut to 60 characters) and its
/// type, e.g. `"one" (string)`.
std::string shown(const nlohmann::json& value);

/// The number of a string parse_python_json() made of Python's bare tokens: "-Infinity",
/// "Infinity" or "NaN"; nullopt for every other value.
std::optional<double> python_float_token(const nlohmann::json& value);

}  // namespace difftrain::diffusion::detail
