#include "difftrain/train/memory_estimate.h"

#include "difftrain/accel/precision.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/optim/quantize.h"

#include <fmt/format.h>
#include <malloc.h>

#if defined(__SANITIZE_ADDRESS__)
#define DIFFTRAIN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define DIFFTRAIN_ASAN 1
#endif
#endif
#if DIFFTRAIN_ASAN
#include <sanitizer/allocator_interface.h>
#endif
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>
#include <unordered_set>

namespace difftrain::train {
namespace fs = std::filesystem;
namespace {

// optim::AdamW8bit's default min_8bit_size (the trainer builds it with the default): smaller
// parameters keep fp32 moments.
constexpr int64_t kMin8bitSize = 4096;

// What optim::AdamW / optim::AdamW8bit hold for one fp32 parameter of `n` elements: two fp32
// moments, or two uint8 code tensors and one fp32 absmax per block for each moment.
int64_t adam_state_bytes(int64_t n, bool eight_bit) {
  if (!eight_bit || n < kMin8bitSize) return 8 * n;  // AdamW: exp_avg, exp_avg_sq
  const int64_t blocks = (n + optim::kQuantBlockSize - 1) / optim::kQuantBlockSize;
  return 2 * n + 2 * 4 * blocks;
}

// What the chosen optimizer holds for one fp32 parameter of `n` elements: Prodigy's exp_avg,
// exp_avg_sq, s and p0, or AdamW's.
int64_t optimizer_state_bytes(int64_t n, const MemoryEstimateOptions& o) {
  if (o.optimizer == "prodigy") return 16 * n;
  return adam_state_bytes(n, o.use_8bit_adam);
}

// Bytes of heap in use right now, all arenas (glibc): small chunks plus mmapped ones. Under
// AddressSanitizer malloc is ASan's (mallinfo2 reports zeros), so ask its allocator instead.
int64_t live_heap_bytes() {
#if DIFFTRAIN_ASAN
  return static_cast<int64_t>(__sanitizer_get_current_allocated_bytes());
#else
  const struct mallinfo2 m = mallinfo2();
  return static_cast<int64_t>(m.uordblks + m.hblkhd);
#endif
}

}  // namespace

void check_memory_estimate_options(const MemoryEstimateOptions& o) {
  if (o.optimizer != "adamw" && o.optimizer != "prodigy") {
    throw Error("--optimizer " + o.optimizer + ": unknown; use adamw or prodigy");
  }
  if (o.optimizer == "prodigy" && o.use_8bit_adam) {
    throw Error("--use_8bit_adam applies to AdamW; Prodigy has no 8-bit form");
  }
  if (o.num_processes < 1) {
    throw Error(fmt::format("num_processes must be at least 1, got {}", o.num_processes));
  }
  if (o.batch_size < 1) throw Error(fmt::format("batch_size must be >= 1, got {}", o.batch_size));
  // The strategy-dependent rules (settings::check_offload) are the caller's, for the strategy it
  // asks about: the comparison rows of other strategies apply the offload where it can run.
  if (o.offload_params && !o.offload_optimizer) {
    throw Error(
        "offload_param_device cpu needs offload_optimizer_device cpu too (the host shards are "
        "the optimizer's master weights): add --offload_optimizer_device cpu");
  }
  if (o.resolution < 0) {
    throw Error(
        fmt::format("resolution must be >= 0 (0: the config's sample_size), got {}", o.resolution));
  }
  if (o.lora && o.lora_rank < 1) {
    throw Error(fmt::format("LoRA rank must be at least 1, got {}", o.lora_rank));
  }
  const auto storage = models::parse_weight_storage(o.base_weights_dtype, "--base_weights_dtype");
  if (storage != models::WeightStorage::kDense && !o.lora) {
    throw Error("--base_weights_dtype stores a LoRA run's frozen base in 8 bits; add --lora");
  }
  if (o.blocks_to_swap < 0) {
    throw Error("--blocks_to_swap is " + std::to_string(o.blocks_to_swap) +
                ": it counts blocks, 0 (off) or more");
  }
  if (o.blocks_to_swap > 0 && !o.lora) {
    throw Error(
        "--blocks_to_swap keeps a LoRA run's frozen blocks in host memory (a full "
        "fine-tune's weights train and stay on the device); add --lora");
  }
}

void check_block_swap_estimated(const MemoryEstimateOptions& o,
                                const std::vector<MemoryEstimate>& estimates,
                                const std::string& family) {
  if (o.blocks_to_swap == 0) return;
  for (const auto& e : estimates)
    if (e.block_swap_host_bytes > 0) return;
  throw Error("--blocks_to_swap " + std::to_string(o.blocks_to_swap) + ": the " + family +
              " family's model has no block swap (it swaps a transformer family's blocks); "
              "leave --blocks_to_swap out");
}

int64_t MemoryEstimate::total_peak_bytes() const {
  return param_peak_bytes + grad_peak_bytes + optimizer_bytes + frozen_param_bytes -
         block_swap_saved_bytes + activation_bytes;
}

MemoryEstimate estimate_state_memory(const torch::nn::Module& trainable,
                                     const MemoryEstimateOptions& options,
                                     const torch::nn::Module* frozen_model) {
  check_memory_estimate_options(options);
  // Frozen parameters, each tensor once (a model and its adapters' container may share none, but
  // a module may register one tensor twice); trainable ones as the optimizer sees them.
  std::unordered_set<const void*> seen;
  int64_t frozen_params = 0, frozen_bytes = 0;
  std::vector<int64_t> numels;
  auto add = [&](const torch::nn::Module& m, bool trainable_too) {
    for (const auto& p : m.parameters(true)) {
      if (!seen.insert(p.unsafeGetTensorImpl()).second) continue;
      if (p.requires_grad()) {
        if (trainable_too) numels.push_back(p.numel());
        continue;
      }
      frozen_params += p.numel();
      frozen_bytes += static_cast<int64_t>(p.nbytes());
    }
  };
  add(trainable, true);
  if (frozen_model != nullptr) {
    add(*frozen_model, false);
    // An 8-bit base's weights are not parameters.
    frozen_params += models::quantized_weight_count(*frozen_model);
    frozen_bytes += models::quantized_weight_bytes(*frozen_model);
  }
  return estimate_state_memory_from_counts(accel::plan_units(trainable, options.auto_wrap), numels,
                                           frozen_params, frozen_bytes, options);
}

MemoryEstimate estimate_state_memory_from_counts(std::vector<accel::UnitPlan> units,
                                                 const std::vector<int64_t>& param_numels,
                                                 int64_t frozen_params, int64_t frozen_bytes,
                                                 const MemoryEstimateOptions& options) {
  check_memory_estimate_options(options);
  MemoryEstimate e;
  const int64_t N = options.num_processes;
  e.num_processes = options.num_processes;
  // One process trains unsharded, unless the optimizer is offloaded (the engine then runs over
  // a world of one).
  e.strategy =
      N == 1 && !options.offload_optimizer ? accel::ShardingStrategy::kNoShard : options.strategy;
  e.offload_optimizer =
      options.offload_optimizer && e.strategy != accel::ShardingStrategy::kNoShard;
  e.offload_params = e.offload_optimizer && options.offload_params &&
                     e.strategy == accel::ShardingStrategy::kFullShard;
  e.units = std::move(units);
  e.frozen_params = frozen_params;
  e.frozen_param_bytes = frozen_bytes;

  int64_t P = 0, Sh = 0, Umax = 0, Uroot = 0;
  for (const auto& u : e.units) {
    const int64_t s = (u.numel + N - 1) / N;
    P += u.numel;
    Sh += s;
    if (u.name.empty()) Uroot = N * s;
    Umax = std::max(Umax, N * s);
  }
  const int64_t Ppad = N * Sh;
  e.trainable_params = P;

  if (e.strategy == accel::ShardingStrategy::kNoShard) {
    e.shard_params = e.padded_params = P;
    e.param_bytes = e.param_peak_bytes = e.grad_bytes = e.grad_peak_bytes = 4 * P;
    // The optimizer sees the model's parameter tensors one by one.
    for (const int64_t n : param_numels) e.optimizer_bytes += optimizer_state_bytes(n, options);
    return e;
  }

  e.shard_params = Sh;
  e.padded_params = Ppad;
  // The sharded optimizer updates one fp32 master shard of S_u elements per unit.
  for (const auto& u : e.units) {
    e.optimizer_bytes += optimizer_state_bytes((u.numel + N - 1) / N, options);
  }
  switch (e.strategy) {
    case accel::ShardingStrategy::kShardOptimizer:
      e.param_bytes = e.param_peak_bytes = 4 * Ppad + 4 * Sh;
      e.grad_bytes = e.grad_peak_bytes = 4 * Ppad + 4 * Sh;
      break;
    case accel::ShardingStrategy::kShardGradOp:
      e.param_bytes = e.param_peak_bytes = 4 * Ppad + 4 * Sh;
      e.grad_bytes = 4 * Sh;
      e.grad_peak_bytes = 4 * Sh + 4 * Ppad;
      break;
    case accel::ShardingStrategy::kFullShard:
      e.param_bytes = 4 * Sh;
      // The root unit stays gathered; one unit runs while the next is prefetched.
      e.param_peak_bytes = 4 * Sh + 4 * (Uroot + 2 * Umax);
      e.grad_bytes = 4 * Sh;
      e.grad_peak_bytes = 4 * Sh + 4 * Ppad;
      break;
    case accel::ShardingStrategy::kNoShard: break;
  }
  if (e.offload_optimizer) {
    // The master shards, their gradient slots and the optimizer state move to the host; ZeRO-3
    // keeps a device copy of the shards for its gathers unless the parameters are offloaded too.
    e.host_bytes = 4 * Sh + 4 * Sh + e.optimizer_bytes;
    e.optimizer_bytes = 0;
    e.grad_bytes -= 4 * Sh;
    e.grad_peak_bytes -= 4 * Sh;
    if (e.strategy == accel::ShardingStrategy::kFullShard) {
      if (e.offload_params) {
        e.param_bytes -= 4 * Sh;
        e.param_peak_bytes -= 4 * Sh;
      }
    } else {
      e.param_bytes -= 4 * Sh;
      e.param_peak_bytes -= 4 * Sh;
    }
  }
  return e;
}

int64_t measure_forward_bytes(const std::function<torch::Tensor()>& forward) {
  forward();  // warm-up: caches and pools that stay are not activations
  const int64_t before = live_heap_bytes();
  torch::Tensor out = forward();
  const int64_t after = live_heap_bytes();
  out = torch::Tensor();
  return std::max<int64_t>(0, after - before);
}

nlohmann::json to_json(const MemoryEstimate& e) {
  nlohmann::json units = nlohmann::json::array();
  const accel::UnitPlan* largest = nullptr;
  for (const auto& u : e.units) {
    units.push_back({{"name", u.name}, {"module_class", u.module_class}, {"numel", u.numel}});
    if (largest == nullptr || u.numel > largest->numel) largest = &u;
  }
  return {
      {"num_processes", e.num_processes},
      {"strategy", accel::to_string(e.strategy)},
      {"param_bytes", e.param_bytes},
      {"param_peak_bytes", e.param_peak_bytes},
      {"grad_bytes", e.grad_bytes},
      {"grad_peak_bytes", e.grad_peak_bytes},
      {"optimizer_bytes", e.optimizer_bytes},
      {"frozen_param_bytes", e.frozen_param_bytes},
      {"activation_bytes", e.activation_bytes},
      {"host_bytes", e.host_bytes},
      {"block_swap_host_bytes", e.block_swap_host_bytes},
      {"block_swap_saved_bytes", e.block_swap_saved_bytes},
      {"offload_optimizer", e.offload_optimizer},
      {"offload_params", e.offload_params},
      {"total_peak_bytes", e.total_peak_bytes()},
      {"trainable_params", e.trainable_params},
      {"frozen_params", e.frozen_params},
      {"shard_params", e.shard_params},
      {"padded_params", e.padded_params},
      {"num_units", e.units.size()},
      {"largest_unit", largest == nullptr ? nlohmann::json(nullptr)
                                          : nlohmann::json{{"name", largest->name},
                                                           {"module_class", largest->module_class},
                                                           {"numel", largest->numel}}},
      {"units", units}};
}

std::string format_bytes(int64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (int64_t{1} << 30)) return fmt::format("{:.2f} GiB", b / (1 << 30));
  if (bytes >= (int64_t{1} << 20)) return fmt::format("{:.1f} MiB", b / (1 << 20));
  if (bytes >= (int64_t{1} << 10)) return fmt::format("{:.1f} KiB", b / (1 << 10));
  return fmt::format("{} B", bytes);
}

std::string format_memory_table(const MemoryEstimate& e, int64_t batch_size) {
  std::string s = fmt::format(
      "{} on {} process{}: {} trainable parameters ({} per rank after padding and sharding), {} "
      "frozen\n",
      accel::to_string(e.strategy), e.num_processes, e.num_processes == 1 ? "" : "es",
      e.trainable_params, e.shard_params, e.frozen_params);
  s += fmt::format("  {:<26}{:>16}  {:>12}\n", "per rank", "bytes", "size");
  auto row = [&](const std::string& name, int64_t bytes) {
    s += fmt::format("  {:<26}{:>16}  {:>12}\n", name, bytes, format_bytes(bytes));
  };
  row("parameters", e.param_bytes);
  row("parameter peak", e.param_peak_bytes);
  row("gradients", e.grad_bytes);
  row("gradient peak", e.grad_peak_bytes);
  row("optimizer state", e.optimizer_bytes);
  row("frozen weights", e.frozen_param_bytes);
  if (e.block_swap_host_bytes > 0) row("  of which block swap saves", e.block_swap_saved_bytes);
  row(fmt::format("activations (batch {})", batch_size), e.activation_bytes);
  row("total peak", e.total_peak_bytes());
  if (e.offload_optimizer) {
    row(e.offload_params ? "host (offload + params)" : "host (offload)", e.host_bytes);
  }
  const accel::UnitPlan* largest = nullptr;
  for (const auto& u : e.units) {
    if (largest == nullptr || u.numel > largest->numel) largest = &u;
  }
  s += fmt::format("  units: {}", e.units.size());
  if (largest != nullptr) {
    s += fmt::format("; largest {} ({}, {} parameters)",
                     largest->name.empty() ? "<root>" : largest->name, largest->module_class,
                     largest->numel);
  }
  return s + "\n";
}

std::string format_strategy_comparison(const std::vector<MemoryEstimate>& estimates) {
  std::string s = fmt::format("  {:<16}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}\n",
                              "per rank", "params", "param peak", "grads", "grad peak", "optimizer",
                              "frozen", "activations", "total peak", "host");
  for (const auto& e : estimates) {
    s += fmt::format("  {:<16}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}{:>12}\n",
                     accel::to_string(e.strategy), format_bytes(e.param_bytes),
                     format_bytes(e.param_peak_bytes), format_bytes(e.grad_bytes),
                     format_bytes(e.grad_peak_bytes), format_bytes(e.optimizer_bytes),
                     format_bytes(e.frozen_param_bytes), format_bytes(e.activation_bytes),
                     format_bytes(e.total_peak_bytes()), format_bytes(e.host_bytes));
  }
  return s;
}

std::vector<accel::ShardingStrategy> strategies_to_compare(const MemoryEstimateOptions& options) {
  std::vector<accel::ShardingStrategy> strategies = {options.strategy};
  if (options.num_processes > 1) {
    for (auto s : {accel::ShardingStrategy::kNoShard, accel::ShardingStrategy::kShardOptimizer,
                   accel::ShardingStrategy::kShardGradOp, accel::ShardingStrategy::kFullShard}) {
      if (s != options.strategy) strategies.push_back(s);
    }
  }
  return strategies;
}

namespace {

// The estimates sorted by strategy (the comparison's order).
std::vector<MemoryEstimate> by_strategy(std::vector<MemoryEstimate> estimates) {
  std::sort(estimates.begin(), estimates.end(),
            [](const auto& a, const auto& b) { return a.strategy < b.strategy; });
  return estimates;
}

}  // namespace

nlohmann::json memory_report_json(const std::string& model, const MemoryEstimateOptions& options,
                                  const std::vector<MemoryEstimate>& estimates) {
  if (estimates.empty()) throw Error("memory_report_json: no estimate");
  auto json = to_json(estimates.front());
  json["model"] = model;
  json["mixed_precision"] = options.mixed_precision;
  json["use_8bit_adam"] = options.use_8bit_adam;
  json["optimizer"] = options.optimizer;
  json["lora"] = options.lora;
  json["batch_size"] = options.batch_size;
  json["comparison"] = nlohmann::json::array();
  for (const auto& e : by_strategy(estimates)) {
    auto row = to_json(e);
    row.erase("units");
    row.erase("largest_unit");
    json["comparison"].push_back(row);
  }
  return json;
}

std::string memory_report(const std::string& model, const MemoryEstimateOptions& options,
                          const std::vector<MemoryEstimate>& estimates) {
  if (estimates.empty()) throw Error("memory_report: no estimate");
  std::string s = fmt::format(
      "difftrain estimate-memory: {}{}{}, mixed precision {}, batch {} per process\n", model,
      options.lora ? fmt::format(", LoRA rank {}", options.lora_rank) : std::string(),
      options.optimizer == "prodigy" ? ", Prodigy"
      : options.use_8bit_adam        ? ", 8-bit AdamW"
                                     : ", AdamW",
      options.mixed_precision, options.batch_size);
  if (options.offload_optimizer) {
    s += options.offload_params
             ? "offload: optimizer and parameter shards in host memory (FULL_SHARD)\n"
             : "offload: master shards, gradients and optimizer state in host memory\n";
  }
  s += format_memory_table(estimates.front(), options.batch_size);
  if (options.num_processes > 1) {
    s += fmt::format("\nEvery strategy on {} processes:\n", options.num_processes) +
         format_strategy_comparison(by_strategy(estimates));
  }
  return s +
         "\nState bytes follow the sharding engine's accounting (peaks are upper bounds); "
         "activations are measured on one forward and scaled by the batch: an estimate.\n";
}

}  // namespace difftrain::train
