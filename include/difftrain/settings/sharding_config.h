#pragma once
// Configs users already have: DeepSpeed JSON files and Accelerate config YAML (FSDP and
// DEEPSPEED sections) read into difftrain's sharding options and the few training settings
// they carry. Everything such a file asks for that difftrain cannot honour is reported, one line
// per key, in `warnings`; nothing is dropped silently. See docs/SHARDING.md for the key table.
// The DeepSpeed reader is src/settings/deepspeed_config.cpp, the Accelerate reader (and
// sharding_env()) src/settings/accelerate_config.cpp; how their values are merged with flags is
// difftrain/settings/config_merge.h.

#include "difftrain/settings/sharding_options.h"

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::settings {

/// What a DeepSpeed or Accelerate config file says about training. An empty optional means "the
/// file does not set it (or says "auto")": difftrain's own value is kept.
struct ExternalTrainingConfig {
  /// The sharding the file asks for; meaningful only when `sharding_set`.
  ShardingOptions sharding;
  /// True when the file chose a strategy (DeepSpeed zero_optimization.stage, Accelerate
  /// distributed_type FSDP/DEEPSPEED).
  bool sharding_set = false;
  /// "no" | "fp16" | "bf16" (DeepSpeed fp16.enabled / bf16.enabled; Accelerate mixed_precision).
  std::optional<std::string> mixed_precision;
  std::optional<int64_t> gradient_accumulation_steps;
  /// Max global gradient norm (DeepSpeed gradient_clipping; difftrain's --max_grad_norm).
  std::optional<double> gradient_clipping;
  /// Per-process batch (DeepSpeed train_micro_batch_size_per_gpu; difftrain's
  /// --train_batch_size).
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  /// One line per key that was read but cannot be honoured (or is unknown), naming the key and
  /// why. Callers print them once (the launcher, or rank 0 of the trainer).
  std::vector<std::string> warnings;
};

/// Reads a DeepSpeed config (JSON text); `origin` (a path) names it in errors and warnings.
/// zero_optimization.stage 0/1/2/3 -> NO_SHARD / SHARD_OPTIMIZER / SHARD_GRAD_OP / FULL_SHARD;
/// fp16.enabled / bf16.enabled -> mixed_precision; gradient_accumulation_steps,
/// gradient_clipping, train_micro_batch_size_per_gpu as they are; "auto" leaves a value unset.
/// Throws difftrain::Error (one line: origin, key, fix) for invalid JSON, wrong types and
/// impossible values (stage 4, fp16 and bf16 both enabled, ...).
ExternalTrainingConfig parse_deepspeed_config(const std::string& json_text,
                                              const std::string& origin);

/// parse_deepspeed_config() of the file at `path`; throws difftrain::Error naming the path when
/// it cannot be read.
ExternalTrainingConfig read_deepspeed_config(const std::string& path);

/// Reads an Accelerate config YAML (as `accelerate config` writes it): distributed_type,
/// mixed_precision, gradient_accumulation_steps, fsdp_config and deepspeed_config (whose
/// deepspeed_config_file is read relative to `base_dir`, "" = the current folder). Sharding is
/// set only for distributed_type FSDP or DEEPSPEED. The launch keys (num_processes,
/// machine_rank, main_process_ip, ...) belong to `difftrain launch` and pass quietly; unknown
/// keys are warnings. Warnings read "ORIGIN: key=value: why" (nested keys dotted, e.g.
/// fsdp_config.fsdp_offload_params). Throws difftrain::Error for invalid YAML and bad values.
ExternalTrainingConfig parse_accelerate_config(const std::string& yaml_text,
                                               const std::string& origin,
                                               const std::string& base_dir = "");

/// parse_accelerate_config() of the file at `path` (deepspeed_config_file relative to the
/// file's folder).
ExternalTrainingConfig read_accelerate_config(const std::string& path);

/// The top-level values of an Accelerate config that its fsdp_config / deepspeed_config
/// sections depend on, as a caller that reads the top level itself (launch::load_config(), for
/// `difftrain launch`) read them.
struct AccelerateTopLevel {
  /// distributed_type upper-cased ("NO" when absent); the sections are used under FSDP /
  /// DEEPSPEED only.
  std::string distributed_type = "NO";
  std::optional<std::string> mixed_precision;  ///< "no" | "fp16" | "bf16"
  std::optional<int64_t> gradient_accumulation_steps;
};

/// Only the fsdp_config and deepspeed_config sections of an Accelerate config YAML, for a caller
/// that has read its top-level keys itself (`top`): the result is what
/// parse_accelerate_config() gives for the same text, without the warnings about top-level
/// keys (those are the caller's to report; this includes the two saying that a
/// deepspeed_config_file's fp16/bf16 or gradient_accumulation_steps differs from the top-level
/// value, which then wins as usual), so that every key is read once.
ExternalTrainingConfig parse_accelerate_sections(const std::string& yaml_text,
                                                 const std::string& origin,
                                                 const AccelerateTopLevel& top,
                                                 const std::string& base_dir = "");

/// The environment variables ShardingOptions::from_env() reads, as {name, value}, in the
/// order DIFFTRAIN_SHARDING_STRATEGY, DIFFTRAIN_FSDP_AUTO_WRAP_POLICY,
/// DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP (comma-separated; omitted when empty),
/// DIFFTRAIN_FSDP_MIN_NUM_PARAMS, DIFFTRAIN_FSDP_FORWARD_PREFETCH,
/// DIFFTRAIN_FSDP_BACKWARD_PREFETCH, DIFFTRAIN_SYNC_EACH_BATCH (booleans as "true"/"false").
/// `difftrain launch` passes them to every rank.
std::vector<std::pair<std::string, std::string>> sharding_env(const ShardingOptions& options);

}  // namespace difftrain::settings
