#pragma once

#include <iosfwd>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::launch {

/// What `difftrain config` writes and `difftrain launch` reads: the defaults of launch's flags.
/// Key names are Accelerate's (`accelerate config` YAML) so an Accelerate config file is read as
/// it is; a field left empty means "not set here" and the flag's default applies.
struct LaunchConfig {
  std::optional<std::string> compute_environment;  ///< LOCAL_MACHINE only
  std::optional<std::string> distributed_type;     ///< NO | MULTI_CPU | MULTI_GPU
  std::optional<std::string> mixed_precision;      ///< no | fp16 | bf16
  std::optional<int> num_processes;                ///< total over all machines
  std::optional<int> num_machines;
  std::optional<int> machine_rank;
  std::optional<std::string> main_process_ip;
  std::optional<int> main_process_port;
  std::optional<int> num_cpu_threads_per_process;
  std::optional<int> gradient_accumulation_steps;
  std::optional<int> max_restarts;
  std::optional<std::string> log_dir;

  /// distributed_type as Accelerate reads it: upper-cased, "NO" when absent, and kept also when
  /// `distributed_type` above is not (FSDP, DEEPSPEED, unsupported types). The fsdp_config /
  /// deepspeed_config sections are read under it by settings::parse_accelerate_sections() (see
  /// launch/resolve.h). Not written by config_to_yaml().
  std::string accelerate_distributed_type = "NO";

  /// One line per key that was read but cannot be honoured (or is unknown), with the reason.
  /// Never silently dropped: `difftrain launch` prints these as warnings.
  std::vector<std::string> notes;
};

/// $XDG_CACHE_HOME/difftrain/default_config.yaml (default ~/.cache/difftrain/...).
std::string default_config_path();

/// The text of the config file at `path`; throws difftrain::Error naming the path when it
/// cannot be read ("... cannot be read: no such file: check the path or create it with
/// `difftrain config`").
std::string read_config_text(const std::string& path);

/// Reads a difftrain or Accelerate config YAML: parse_config(read_config_text(path), path). Only
/// the top-level keys; an Accelerate file's fsdp_config / deepspeed_config sections are
/// settings::parse_accelerate_sections()'s. Throws difftrain::Error naming the path (and the line,
/// for YAML syntax errors, or the key, for a bad value) and how to fix it.
LaunchConfig load_config(const std::string& path);

/// Parses YAML text; `origin` names it in errors.
LaunchConfig parse_config(const std::string& yaml_text, const std::string& origin);

/// The YAML text of `config` (Accelerate key names; unset fields are omitted).
std::string config_to_yaml(const LaunchConfig& config);

/// Writes `config` to `path` atomically (temporary file + rename), creating parent folders.
void save_config(const std::string& path, const LaunchConfig& config);

/// Asks the `difftrain config` questions on `out`, reading answers from `in`; an empty answer keeps
/// the default shown in brackets (taken from `defaults`). Re-asks on an invalid answer.
LaunchConfig ask_config(std::istream& in, std::ostream& out, const LaunchConfig& defaults);

/// Checks values (ranges, names, consistency) and throws difftrain::Error naming `origin` and the
/// key.
void validate_config(const LaunchConfig& config, const std::string& origin);

}  // namespace difftrain::launch
