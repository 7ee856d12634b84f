#pragma once
// Sharding settings of a run (DeepSpeed ZeRO stages 1-3, PyTorch FSDP): the strategy names, the
// auto-wrap policy and their environment variables. Read by `difftrain launch` (which passes
// them on to its ranks) and by the Accelerator (accel/sharding.h plans the units from them); no
// LibTorch here, so the launcher does not depend on the Accelerator.

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::settings {

/// What is split across ranks (FSDP's ShardingStrategy names; DeepSpeed's ZeRO stages).
enum class ShardingStrategy {
  kNoShard,         ///< DDP: everything replicated, gradients all-reduced (ZeRO-0)
  kShardOptimizer,  ///< ZeRO-1: each rank keeps and updates 1/N of the optimizer state
  kShardGradOp,     ///< ZeRO-2: gradients reduce-scattered too; each rank keeps 1/N of them
  kFullShard,       ///< ZeRO-3 / FSDP FULL_SHARD: parameters sharded too, gathered per unit
};

/// "NO_SHARD", "SHARD_OPTIMIZER", "SHARD_GRAD_OP", "FULL_SHARD".
const char* to_string(ShardingStrategy strategy);
/// Accepts the names above in any case, FSDP's numbers ("1" FULL_SHARD, "2" SHARD_GRAD_OP,
/// "3" NO_SHARD, as Accelerate's fsdp_sharding_strategy) and ZeRO stages ("zero0".."zero3").
/// Throws difftrain::Error naming `origin` and the accepted values.
ShardingStrategy parse_sharding_strategy(const std::string& text,
                                         const std::string& origin = "sharding_strategy");

/// How a model is cut into wrapped units (FSDP's auto_wrap_policy). A unit's trainable
/// parameters are one flat buffer; under FULL_SHARD it is gathered just before the unit's
/// forward and backward and freed after them. Parameters not in any wrapped module form the
/// root unit.
struct AutoWrapPolicy {
  /// "TRANSFORMER_BASED_WRAP" (modules whose class is in `classes`), "SIZE_BASED_WRAP"
  /// (modules with at least `min_num_params` trainable parameters not already in a unit) or
  /// "NO_WRAP" (one root unit). Accelerate's fsdp_auto_wrap_policy.
  std::string policy = "TRANSFORMER_BASED_WRAP";
  /// Class names for TRANSFORMER_BASED_WRAP (Accelerate's fsdp_transformer_layer_cls_to_wrap):
  /// Diffusers names such as ResnetBlock2D, Transformer2DModel, DownBlock2D,
  /// CrossAttnDownBlock2D, UNetMidBlock2D, UpBlock2D. Empty: the blocks the model names itself
  /// (core::NoSplitModules, like Diffusers' _no_split_modules; difftrain's UNets name
  /// ResnetBlock2D, Transformer2DModel and the Attention layers of UNet2DModel), or one root
  /// unit for a model that names none.
  std::vector<std::string> classes;
  /// SIZE_BASED_WRAP threshold (Accelerate's fsdp_min_num_params; default 1e8 as FSDP's).
  int64_t min_num_params = 100000000;
};

/// Sharding options of an Accelerator (Accelerate's FullyShardedDataParallelPlugin /
/// DeepSpeedPlugin zero_stage).
struct ShardingOptions {
  ShardingStrategy strategy = ShardingStrategy::kNoShard;
  AutoWrapPolicy auto_wrap;
  /// FULL_SHARD: start the next unit's all-gather when a unit's forward begins (FSDP's
  /// forward_prefetch).
  bool forward_prefetch = true;
  /// FULL_SHARD: start the next unit's all-gather when a unit's backward begins
  /// (FSDP's backward_prefetch BACKWARD_PRE).
  bool backward_prefetch = true;
  /// Under gradient accumulation, reduce-scatter after every micro-step and keep only the
  /// gradient shard (less memory, more communication), instead of accumulating full gradients
  /// locally and reducing once per update (Accelerate's sync_each_batch).
  bool sync_each_batch = false;
  /// ZeRO-Offload (DeepSpeed's offload_optimizer.device "cpu", Accelerate's
  /// offload_optimizer_device / fsdp_offload_params): each rank's fp32 master shards, their
  /// gradients and the optimizer state live in host memory; the optimizer steps on the CPU and
  /// the updated shards return to the device in the parameters' dtype. Needs a strategy other
  /// than NO_SHARD (with one process too: the engine then shards over a world of one).
  bool offload_optimizer = false;
  /// FULL_SHARD with offload_optimizer only (DeepSpeed's offload_param.device "cpu"): no
  /// parameter shard stays on the device; each unit is copied from the host shard and gathered
  /// for its forward and backward, and freed after.
  bool offload_params = false;

  /// Reads the DIFFTRAIN_SHARDING_STRATEGY, DIFFTRAIN_FSDP_AUTO_WRAP_POLICY,
  /// DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP (comma-separated), DIFFTRAIN_FSDP_MIN_NUM_PARAMS,
  /// DIFFTRAIN_FSDP_FORWARD_PREFETCH, DIFFTRAIN_FSDP_BACKWARD_PREFETCH,
  /// DIFFTRAIN_SYNC_EACH_BATCH, DIFFTRAIN_OFFLOAD_OPTIMIZER_DEVICE and
  /// DIFFTRAIN_OFFLOAD_PARAM_DEVICE ("none" | "cpu") environment variables (set by `difftrain
  /// launch`) over `base`.
  static ShardingOptions from_env(const ShardingOptions& base);
  /// from_env() over the defaults.
  static ShardingOptions from_env();
};

/// Reads an offload device as DeepSpeed and Accelerate name it: "none" (or "" / "false") -> false,
/// "cpu" (or "true") -> true. "nvme" and anything else throw difftrain::Error naming `origin`.
bool parse_offload_device(const std::string& text, const std::string& origin);

/// Throws difftrain::Error (one line, the fix included) when `options` cannot run: offload under
/// NO_SHARD, parameter offload without FULL_SHARD or without optimizer offload.
void check_offload(const ShardingOptions& options);

}  // namespace difftrain::settings
