#pragma once
// `difftrain estimate-memory`: the per-rank bytes a training run holds for parameters, gradients,
// optimizer state, frozen weights and activations under each sharding strategy (Accelerate's
// `accelerate estimate-memory`, which counts parameters only; DeepSpeed's
// estimate_zero2/zero3_model_states_mem_needs). State bytes follow the sharding engine's
// accounting (the names of run_info.rank<r>.json "state_bytes"); activations are measured on one
// forward pass. See docs/SHARDING.md.

#include "difftrain/accel/sharding.h"

#include <torch/nn/module.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace difftrain::train {

/// What run to estimate. Field names follow `difftrain train` / `difftrain launch`.
struct MemoryEstimateOptions {
  /// Ranks N (Accelerate's num_processes). With 1, every strategy is NO_SHARD.
  int num_processes = 1;
  accel::ShardingStrategy strategy = accel::ShardingStrategy::kNoShard;
  /// How the trainable module is cut into units (FSDP's auto_wrap_policy).
  accel::AutoWrapPolicy auto_wrap;
  /// "no" | "bf16" | "fp16": the autocast of the activation measurement. Trainable parameters
  /// stay fp32 under every mode (master weights), so state bytes do not depend on it.
  std::string mixed_precision = "no";
  /// 8-bit AdamW (optim::AdamW8bit, its default min_8bit_size) instead of AdamW.
  bool use_8bit_adam = false;
  /// "adamw" (with use_8bit_adam: 8-bit) or "prodigy" (four fp32 tensors per parameter).
  std::string optimizer = "adamw";
  /// Train LoRA adapters on a frozen UNet (the trainer's --lora) with rank `lora_rank`.
  bool lora = false;
  int64_t lora_rank = 4;
  /// Layers that get adapters; empty: the trainer's default (to_q, to_k, to_v, to_out.0).
  std::vector<std::string> lora_target_modules;
  /// LoRA: the frozen base in 8 bits (the trainer's --base_weights_dtype: none | int8 |
  /// fp8_e4m3): the denoiser's and held text encoders' Linear/Conv weights at 1 byte plus a
  /// float32 scale per output channel, by models/quantized_weight.h's size rule.
  std::string base_weights_dtype = "none";
  /// FLUX.1: the text encoders stay loaded to encode each batch (CLIP LoRA, --train_text_encoder);
  /// otherwise the trainer caches the captions' embeddings and releases them, and they are not
  /// counted.
  bool train_text_encoder = false;
  /// ZeRO-Offload (the trainer's --offload_optimizer_device cpu): master shards, their
  /// gradients and the optimizer state counted as host bytes. Applies to the sharded
  /// strategies (the NO_SHARD row of a comparison is without it); with one process the
  /// requested strategy is kept, as the trainer keeps it.
  bool offload_optimizer = false;
  /// FULL_SHARD (with offload_optimizer): no device copy of the parameter shards
  /// (--offload_param_device cpu). Other strategies' rows are without it.
  bool offload_params = false;
  /// Per-process batch; activations are measured at batch 1 and scaled linearly.
  int64_t batch_size = 1;
  /// Height = width of the UNet input (the latent size for latent models: 64 for SD-1.5 at
  /// 512 px); 0: the config's sample_size.
  int64_t resolution = 0;
  /// Recompute resnets and attentions in backward (the trainer's --gradient_checkpointing).
  bool gradient_checkpointing = false;
  /// --blocks_to_swap: transformer blocks whose frozen weights stay in host memory
  /// (models/block_swap.h); 0 = none. Only a family with a block swap takes it.
  int64_t blocks_to_swap = 0;
  /// Tokens of encoder_hidden_states; 0 = the family's training default: 77 for cross-attention
  /// UNets (CLIP's, as Diffusers' text-to-image scripts), 512 T5 tokens for FLUX.1 (`difftrain
  /// train`'s --max_sequence_length).
  int64_t encoder_sequence_length = 0;
  /// Video families: the clip's frames and pixel height / width (0: the family's default, Wan's
  /// 81 x 480 x 832).
  int64_t num_frames = 0, height = 0, width = 0;
};

/// `difftrain estimate-memory`'s flags as given (names and spellings of `difftrain train`'s):
/// the options taken as they are, and the ones given as text that memory_estimate_options()
/// parses.
struct MemoryEstimateFlags {
  /// Every option but the four below; optimizer, base_weights_dtype (any case) and
  /// auto_wrap.policy (any case) are normalised.
  MemoryEstimateOptions options;
  std::string sharding_strategy = "NO_SHARD";  ///< any spelling parse_sharding_strategy takes
  std::string mixed_precision = "no";
  std::string offload_optimizer_device = "none";
  std::string offload_param_device = "none";
};

/// The options `flags` describe, parsed and checked with the trainer's rules (sharding strategy,
/// mixed precision, offload devices and their combination). Throws difftrain::Error (one line)
/// naming the flag.
MemoryEstimateOptions memory_estimate_options(const MemoryEstimateFlags& flags);

/// Per-rank bytes of one run. With P trainable elements in units of n_u elements, S_u =
/// ceil(n_u / N), Sh = Σ S_u, Ppad = N·Sh, Umax = max_u N·S_u, Uroot = N·S_root:
///   NO_SHARD         params 4P, grads 4P, optimizer over the full parameters
///   SHARD_OPTIMIZER  params 4·Ppad + 4·Sh (flat params + fp32 master shards), grads the same,
///                    optimizer over one parameter of S_u elements per unit
///   SHARD_GRAD_OP    params as ZeRO-1; grads 4·Sh, peak 4·Sh + 4·Ppad; optimizer as ZeRO-1
///   FULL_SHARD       params 4·Sh, peak 4·Sh + 4·(Uroot + 2·Umax); grads, optimizer as ZeRO-2
/// With offload_optimizer, 4·Sh (master shards) + 4·Sh (their gradients) + the optimizer state are
/// host_bytes instead, and the device keeps: ZeRO-1 params 4·Ppad, grads 4·Ppad; ZeRO-2 params
/// 4·Ppad, grads 0 (peak 4·Ppad); ZeRO-3 params 4·Sh (0 with offload_params; peak + the gathered
/// units), grads 0 (peak 4·Ppad); optimizer 0.
/// The *_peak values are upper bounds; the others are what is held between steps.
struct MemoryEstimate {
  int num_processes = 1;
  /// The strategy the numbers are for (NO_SHARD whenever num_processes is 1).
  accel::ShardingStrategy strategy = accel::ShardingStrategy::kNoShard;
  int64_t param_bytes = 0;
  int64_t param_peak_bytes = 0;
  int64_t grad_bytes = 0;
  int64_t grad_peak_bytes = 0;
  int64_t optimizer_bytes = 0;
  /// Parameters that do not train (the UNet under LoRA), replicated on every rank, in their
  /// dtype.
  int64_t frozen_param_bytes = 0;
  /// Offload: this rank's state in host memory (the fields above are then the device's).
  int64_t host_bytes = 0;
  /// Block swap: the swapped blocks' frozen bytes in host memory, and the device bytes that
  /// saves (those minus the staging of two blocks; already out of frozen_param_bytes' share of
  /// total_peak_bytes()).
  int64_t block_swap_host_bytes = 0;
  int64_t block_swap_saved_bytes = 0;
  bool offload_optimizer = false;  ///< as estimated (false for NO_SHARD rows)
  bool offload_params = false;
  /// Measured for batch_size (see measure_activation_bytes); 0 from estimate_state_memory().
  int64_t activation_bytes = 0;
  /// P, and the frozen parameters' elements.
  int64_t trainable_params = 0;
  int64_t frozen_params = 0;
  /// Sh: elements of this rank's shards (P when not sharded), and Ppad = N·Sh.
  int64_t shard_params = 0;
  int64_t padded_params = 0;
  /// accel::plan_units() of the trainable module under the options' auto-wrap policy.
  std::vector<accel::UnitPlan> units;

  /// param_peak + grad_peak + optimizer + frozen + activation bytes (the device's; host_bytes
  /// apart).
  int64_t total_peak_bytes() const;
};

/// Throws difftrain::Error (one line) when options.blocks_to_swap is set but none of `estimates`
/// (`family`'s) counted a block swap: its model has none.
void check_block_swap_estimated(const MemoryEstimateOptions& options,
                                const std::vector<MemoryEstimate>& estimates,
                                const std::string& family);

/// The state bytes above for `trainable` (the module that would be prepared: the UNet, or the
/// LoraLayers holding the adapters) under `options` (num_processes, strategy, auto_wrap,
/// use_8bit_adam; the rest is not used). Trainable parameters are those with requires_grad, each
/// counted as fp32. Frozen parameters are those without requires_grad in `trainable` and in
/// `frozen_model` (e.g. the UNet whose adapters `trainable` holds), each tensor counted once.
/// activation_bytes is 0. Throws difftrain::Error on num_processes < 1 or a bad auto-wrap policy.
MemoryEstimate estimate_state_memory(const torch::nn::Module& trainable,
                                     const MemoryEstimateOptions& options,
                                     const torch::nn::Module* frozen_model = nullptr);

/// estimate_state_memory() from counts, for models too large to build (FLUX.1's transformer):
/// `units` as plan_units() would give them (name, class, numel), `param_numels` the elements of
/// every trainable parameter tensor (the optimizer's tensors under NO_SHARD), and the frozen
/// parameters' elements and bytes. Same formulas and errors as estimate_state_memory().
MemoryEstimate estimate_state_memory_from_counts(std::vector<accel::UnitPlan> units,
                                                 const std::vector<int64_t>& param_numels,
                                                 int64_t frozen_params, int64_t frozen_bytes,
                                                 const MemoryEstimateOptions& options);

/// Throws difftrain::Error for options no run can have: num_processes or batch_size below 1, a
/// negative resolution, a LoRA rank below 1.
void check_memory_estimate_options(const MemoryEstimateOptions& options);

/// The live heap bytes one call of `forward` leaves allocated while its result is alive (the
/// autograd graph of a training forward), after one warm-up call whose result is dropped; the UNet
/// families' measure_activation_bytes (families/unet/memory.h) says what it counts.
int64_t measure_forward_bytes(const std::function<torch::Tensor()>& forward);

/// Every field of `estimate` by its name, plus total_peak_bytes, num_units, largest_unit
/// ({name, module_class, numel}) and units ([{name, module_class, numel}]).
nlohmann::json to_json(const MemoryEstimate& estimate);

/// "1.23 GiB", "45.6 MiB", "789 KiB" or "12 B".
std::string format_bytes(int64_t bytes);

/// The table `difftrain estimate-memory` prints: one row per quantity (bytes and a readable
/// size), then the unit count and the largest unit.
std::string format_memory_table(const MemoryEstimate& estimate, int64_t batch_size);

/// One row per estimate (strategy, parameters, gradients, optimizer, frozen, activations, total
/// peak), for comparing strategies at one N.
std::string format_strategy_comparison(const std::vector<MemoryEstimate>& estimates);

/// The strategies `difftrain estimate-memory` reports: options.strategy first, then (with more
/// than one process) every other strategy for comparison.
std::vector<accel::ShardingStrategy> strategies_to_compare(const MemoryEstimateOptions& options);

/// `difftrain estimate-memory`'s output for `estimates` of `model` (the first is the requested
/// strategy's, as strategies_to_compare orders them): the header line, format_memory_table of
/// the first, the strategy comparison with more than one process, and the closing note.
std::string memory_report(const std::string& model, const MemoryEstimateOptions& options,
                          const std::vector<MemoryEstimate>& estimates);

/// The same as one JSON object (`--json`): to_json of the first estimate plus model,
/// mixed_precision, use_8bit_adam, lora, batch_size and "comparison" (every estimate by
/// strategy, without units).
nlohmann::json memory_report_json(const std::string& model, const MemoryEstimateOptions& options,
                                  const std::vector<MemoryEstimate>& estimates);

}  // namespace difftrain::train
