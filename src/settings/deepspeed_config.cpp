// DeepSpeed JSON configs -> ExternalTrainingConfig (ZeRO stage, fp16/bf16, accumulation,
// clipping, micro batch), with one warning per key difftrain cannot honour. The Accelerate YAML
// reader (accelerate_config.cpp) calls it for deepspeed_config_file.
#include "difftrain/settings/sharding_config.h"

#include "config_reader_util.h"
#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace difftrain::settings {
namespace detail {

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string read_text(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) {
    throw Error(fmt::format("{} {} cannot be read: {}: check the path", what, path,
                            std::filesystem::exists(path) ? "permission denied" : "no such file"));
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::string join(const std::vector<std::string>& items) {
  std::string out;
  for (const auto& i : items) out += (out.empty() ? "" : ",") + i;
  return out;
}

ShardingStrategy strategy_of_zero_stage(int64_t stage) {
  static const ShardingStrategy by_stage[] = {
      ShardingStrategy::kNoShard, ShardingStrategy::kShardOptimizer, ShardingStrategy::kShardGradOp,
      ShardingStrategy::kFullShard};
  return by_stage[stage];
}

}  // namespace detail

namespace {

using nlohmann::json;

struct DsReader {
  const std::string& origin;
  ExternalTrainingConfig& out;

  [[noreturn]] void fail(const std::string& key, const json& value,
                         const std::string& expected) const {
    throw Error(fmt::format("DeepSpeed config {}: {} is {}: expected {}; fix the file", origin, key,
                            value.dump(), expected));
  }
  void warn(const std::string& key, const json& value, const std::string& why) const {
    out.warnings.push_back(fmt::format("{}: {}={}: {}", origin, key, value.dump(), why));
  }

  static bool is_auto(const json& v) { return v.is_string() && v.get<std::string>() == "auto"; }

  std::optional<int64_t> whole(const json& v, const std::string& key, int64_t min) const {
    if (is_auto(v)) return std::nullopt;
    if (!v.is_number_integer() || v.get<int64_t>() < min) {
      fail(key, v, fmt::format("a whole number >= {} or \"auto\"", min));
    }
    return v.get<int64_t>();
  }

  std::optional<double> number(const json& v, const std::string& key) const {
    if (is_auto(v)) return std::nullopt;
    if (!v.is_number() || v.get<double>() < 0 || !std::isfinite(v.get<double>())) {
      fail(key, v, "a number >= 0 (0: no clipping) or \"auto\"");
    }
    return v.get<double>();
  }

  // true / false, or nullopt for "auto".
  std::optional<bool> flag(const json& v, const std::string& key) const {
    if (is_auto(v)) return std::nullopt;
    if (!v.is_boolean()) fail(key, v, "true, false or \"auto\"");
    return v.get<bool>();
  }

  const json& section(const json& root, const std::string& key) const {
    const json& s = root.at(key);
    if (!s.is_object()) fail(key, s, "an object ({...})");
    return s;
  }
};

// Settings a DeepSpeed config may hold that change nothing in difftrain. `neutral`: values
// (JSON text) at which ignoring them changes nothing, so they pass quietly; "auto" always does.
struct Knob {
  std::set<std::string> neutral;
  std::string reason;
};

const std::map<std::string, Knob>& zero_knobs() {
  static const std::string layout =
      "no effect: difftrain reduces one flat buffer per wrapped unit (see "
      "fsdp_auto_wrap_policy)";
  static const std::string stage3 =
      "ZeRO-3 tuning knob with no effect: difftrain gathers one wrapped unit at a time, "
      "prefetching the next (fsdp_forward_prefetch / fsdp_backward_prefetch)";
  static const std::string unsupported = "not supported by difftrain's ZeRO";
  static const std::map<std::string, Knob> knobs = {
      {"overlap_comm",
       {{"false"}, "no effect: difftrain's schedule of communication and backward is fixed"}},
      {"contiguous_gradients", {{}, layout}},
      {"reduce_bucket_size", {{}, layout}},
      {"allgather_bucket_size", {{}, layout}},
      {"allgather_partitions", {{"true"}, layout}},
      {"reduce_scatter", {{"true"}, layout}},
      {"round_robin_gradients", {{"false"}, layout}},
      {"sub_group_size", {{}, layout}},
      {"elastic_checkpoint", {{"false"}, "checkpoints are resumed with the same world size"}},
      {"load_from_fp32_weights", {{"true"}, "checkpoints always hold fp32 weights"}},
      {"ignore_unused_parameters",
       {{"true"}, "parameters without gradients are always allowed (their gradient is zero)"}},
      {"legacy_stage1", {{"false"}, unsupported}},
      {"zero_hpz_partition_size", {{"1"}, unsupported + " (ZeRO++ hierarchical partitioning)"}},
      {"zero_quantized_weights", {{"false"}, unsupported + " (ZeRO++ quantized weights)"}},
      {"zero_quantized_gradients", {{"false"}, unsupported + " (ZeRO++ quantized gradients)"}},
      {"zero_quantized_nontrainable_weights", {{"false"}, unsupported}},
      {"mics_shard_size", {{"-1"}, unsupported + " (MiCS)"}},
      {"mics_hierarchical_params_gather", {{"false"}, unsupported + " (MiCS)"}},
      {"memory_efficient_linear", {{"true"}, "no effect"}},
      {"stage3_prefetch_bucket_size", {{}, stage3}},
      {"stage3_param_persistence_threshold", {{}, stage3}},
      {"stage3_model_persistence_threshold", {{}, stage3}},
      {"stage3_max_live_parameters", {{}, stage3}},
      {"stage3_max_reuse_distance", {{}, stage3}},
      {"stage3_gather_16bit_weights_on_model_save",
       {{"false"},
        "difftrain always writes sharded checkpoints; `difftrain merge-weights` consolidates "
        "them into one file"}},
      {"stage3_gather_fp16_weights_on_model_save",
       {{"false"},
        "difftrain always writes sharded checkpoints; `difftrain merge-weights` consolidates "
        "them into one file"}},
  };
  return knobs;
}

const std::map<std::string, Knob>& top_level_knobs() {
  static const std::string unsupported = "not supported by difftrain";
  static const std::map<std::string, Knob> knobs = {
      {"steps_per_print", {{}, "difftrain prints progress every --logging_steps updates"}},
      {"wall_clock_breakdown", {{"false"}, "timing breakdowns are not implemented"}},
      {"memory_breakdown", {{"false"}, "memory breakdowns are not implemented"}},
      {"dump_state", {{"false"}, "not implemented"}},
      {"prescale_gradients", {{"false"}, "gradients are averaged after the reduction"}},
      {"gradient_predivide_factor", {{"1", "1.0"}, "gradients are averaged after the reduction"}},
      {"communication_data_type",
       {{"null"}, "collectives run in the gradients' dtype (fp32 master gradients)"}},
      {"zero_allow_untested_optimizer", {{"true", "false"}, ""}},  // difftrain's own optimizer
      // Offload always steps difftrain's own CPU optimizer: either value works.
      {"zero_force_ds_cpu_optimizer", {{"false", "true"}, ""}},
      {"seed", {{}, "difftrain's random draws derive from --seed"}},
      {"activation_checkpointing",
       {{}, "use difftrain's --gradient_checkpointing to recompute activations"}},
      {"flops_profiler", {{}, unsupported}},
      {"tensorboard", {{}, "difftrain's trackers follow --report_to"}},
      {"wandb", {{}, "difftrain's trackers follow --report_to (tensorboard, jsonl)"}},
      {"csv_monitor", {{}, "difftrain's trackers follow --report_to (tensorboard, jsonl)"}},
      {"comet", {{}, "difftrain's trackers follow --report_to (tensorboard, jsonl)"}},
      {"comms_logger", {{}, unsupported}},
      {"checkpoint", {{}, "checkpoint layout is difftrain's (sharded; see merge-weights)"}},
      {"data_types", {{}, "gradient accumulation runs in fp32"}},
      {"sparse_attention", {{}, unsupported}},
      {"data_efficiency", {{}, unsupported}},
      {"curriculum_learning", {{}, unsupported}},
      {"compression_training", {{}, unsupported}},
      {"elasticity", {{}, unsupported + ": the world size is fixed per run"}},
      {"autotuning", {{}, unsupported}},
      {"aio", {{}, "NVMe offload is not supported"}},
      {"pipeline", {{}, "pipeline parallelism is not supported"}},
      {"tensor_parallel", {{}, "tensor parallelism is not supported"}},
      {"hybrid_engine", {{}, unsupported}},
      {"nebula", {{}, unsupported}},
      {"quantize_training", {{}, unsupported}},
      {"eigenvalue", {{}, unsupported}},
      {"progressive_layer_drop", {{}, unsupported}},
  };
  return knobs;
}

// A section such as {"enabled": false, ...} changes nothing.
bool disabled_section(const json& v) {
  return v.is_object() && (v.empty() || (v.contains("enabled") && v.at("enabled").is_boolean() &&
                                         !v.at("enabled").get<bool>()));
}

void read_zero(const DsReader& r, const json& zero) {
  for (const auto& [key, value] : zero.items()) {
    const std::string name = "zero_optimization." + key;
    if (key == "stage") {
      if (DsReader::is_auto(value)) continue;
      if (!value.is_number_integer() || value.get<int64_t>() < 0 || value.get<int64_t>() > 3) {
        r.fail(name, value,
               "0, 1, 2 or 3 (ZeRO stage: 0 = DDP, 1 = optimizer state, 2 = + gradients, "
               "3 = + parameters)");
      }
      r.out.sharding.strategy = detail::strategy_of_zero_stage(value.get<int64_t>());
      r.out.sharding_set = true;
    } else if (key == "offload_optimizer" || key == "offload_param") {
      if (!value.is_object()) r.fail(name, value, "an object ({\"device\": \"none\"})");
      const json device = value.value("device", json("none"));
      if (!device.is_string()) r.fail(name + ".device", device, "\"none\", \"cpu\" or \"nvme\"");
      const std::string d = device.get<std::string>();
      if (d == "none" || d == "auto") continue;
      if (d != "cpu" && d != "nvme")
        r.fail(name + ".device", device, "\"none\", \"cpu\" or \"nvme\"");
      if (d == "nvme") {
        r.warn(name + ".device", device,
               "NVMe offload is not supported: offloading to CPU memory instead");
      }
      (key == "offload_optimizer" ? r.out.sharding.offload_optimizer
                                  : r.out.sharding.offload_params) = true;
      for (const auto& [k, v] : value.items()) {
        if (k == "device" || k == "nvme_path" || k == "pin_memory") continue;
        r.warn(name + "." + k, v,
               "no effect: difftrain's offload keeps whole shards in (pinned, on CUDA) host "
               "memory");
      }
    } else if (key == "cpu_offload") {
      // The old spelling of offload_optimizer.device "cpu" (DeepSpeed before 0.3.16).
      if (!value.is_boolean()) r.fail(name, value, "true or false");
      if (value.get<bool>()) r.out.sharding.offload_optimizer = true;
    } else if (auto it = zero_knobs().find(key); it != zero_knobs().end()) {
      if (DsReader::is_auto(value) || it->second.neutral.count(value.dump())) continue;
      r.warn(name, value, it->second.reason);
    } else if (key.rfind("stage3_", 0) == 0) {
      r.warn(name, value,
             "ZeRO-3 tuning knob with no effect: difftrain gathers one wrapped unit at a time");
    } else {
      r.warn(name, value, "unknown zero_optimization key: ignored (check its spelling)");
    }
  }
}

// What an fp16 / bf16 section says about being on: DeepSpeed's default for a section without
// "enabled" is off.
enum class Switch { kAbsent, kOn, kOff, kAuto };

Switch read_precision_section(const DsReader& r, const json& s, const std::string& key) {
  Switch state = Switch::kOff;
  if (s.contains("enabled")) {
    const std::optional<bool> enabled = r.flag(s.at("enabled"), key + ".enabled");
    state = !enabled ? Switch::kAuto : *enabled ? Switch::kOn : Switch::kOff;
  }
  // Loss-scale settings of a section that is off change nothing.
  const bool matters = state != Switch::kOff;
  for (const auto& [k, v] : s.items()) {
    const std::string name = key + "." + k;
    if (k == "enabled" || DsReader::is_auto(v) || !matters) continue;
    if (key == "fp16" && k == "loss_scale") {
      if (!v.is_number()) r.fail(name, v, "0 (dynamic loss scaling) or a number");
      if (v.get<double>() != 0) {
        r.warn(name, v,
               "static loss scales are not supported: difftrain scales dynamically (starts at "
               "2^16, halves on overflow, doubles after 2000 good steps)");
      }
    } else if (key == "fp16" && k == "initial_scale_power") {
      if (v != json(16)) {
        r.warn(name, v, "difftrain's dynamic loss scale starts at 2^16");
      }
    } else if (key == "fp16" && k == "loss_scale_window") {
      if (v != json(2000)) r.warn(name, v, "difftrain's loss scale grows after 2000 good steps");
    } else if (key == "fp16" && k == "hysteresis") {
      if (v != json(1)) r.warn(name, v, "difftrain's loss scale halves on the first overflow");
    } else if (key == "fp16" && k == "consecutive_hysteresis") {
      if (v != json(false)) r.warn(name, v, "difftrain's loss scale halves on every overflow");
    } else if (key == "fp16" && k == "min_loss_scale") {
      r.warn(name, v, "difftrain's dynamic loss scale has no lower bound");
    } else if (k == "auto_cast") {
      if (v != json(false)) r.warn(name, v, "inputs are not cast; autocast covers the forward");
    } else {
      r.warn(name, v, "not supported by difftrain's mixed precision: ignored");
    }
  }
  return state;
}

}  // namespace

ExternalTrainingConfig parse_deepspeed_config(const std::string& json_text,
                                              const std::string& origin) {
  json root;
  try {
    root = json::parse(json_text);
  } catch (const json::parse_error& e) {
    std::string what = e.what();
    for (auto& c : what)
      if (c == '\n') c = ' ';
    throw Error(fmt::format("DeepSpeed config {}: invalid JSON at byte {} ({}); fix the file",
                            origin, e.byte, what));
  } catch (const json::exception& e) {  // out_of_range for a number such as 1e999
    throw Error(
        fmt::format("DeepSpeed config {}: invalid JSON ({}); fix the file", origin, e.what()));
  }
  ExternalTrainingConfig out;
  if (!root.is_object()) {
    throw Error(fmt::format(
        "DeepSpeed config {}: expected a JSON object of settings ({{\"zero_optimization\": ...}}), "
        "got {}",
        origin, root.type_name()));
  }
  const DsReader r{origin, out};
  Switch fp16 = Switch::kAbsent, bf16 = Switch::kAbsent;
  for (const auto& [key, value] : root.items()) {
    if (key == "zero_optimization") {
      if (value.is_boolean() && !value.get<bool>()) continue;
      read_zero(r, r.section(root, key));
    } else if (key == "gradient_accumulation_steps") {
      out.gradient_accumulation_steps = r.whole(value, key, 1);
    } else if (key == "train_micro_batch_size_per_gpu") {
      out.train_micro_batch_size_per_gpu = r.whole(value, key, 1);
    } else if (key == "train_batch_size") {
      r.whole(value, key, 1);  // checked against the others below
    } else if (key == "gradient_clipping") {
      out.gradient_clipping = r.number(value, key);
    } else if (key == "fp16") {
      fp16 = read_precision_section(r, r.section(root, key), key);
    } else if (key == "bf16" || key == "bfloat16") {
      bf16 = read_precision_section(r, r.section(root, key), key);
    } else if (key == "amp") {
      if (!disabled_section(value)) {
        r.warn(key, value, "apex AMP is not supported: use the fp16 or bf16 section");
      }
    } else if (key == "optimizer") {
      r.warn(key, value.is_object() ? value.value("type", json("?")) : value,
             "not used: difftrain's own optimizer is used (AdamW, or --use_8bit_adam) with "
             "--learning_rate, --adam_beta1/2, --adam_weight_decay, --adam_epsilon");
    } else if (key == "scheduler") {
      r.warn(key, value.is_object() ? value.value("type", json("?")) : value,
             "not used: difftrain's own schedule is used (--lr_scheduler, --lr_warmup_steps)");
    } else if (auto it = top_level_knobs().find(key); it != top_level_knobs().end()) {
      if (it->second.reason.empty() || DsReader::is_auto(value) ||
          it->second.neutral.count(value.dump()) || disabled_section(value)) {
        continue;
      }
      r.warn(key, value, it->second.reason);
    } else {
      r.warn(key, value, "unknown key: ignored (not a DeepSpeed setting; check its spelling)");
    }
  }
  if (fp16 == Switch::kOn && bf16 == Switch::kOn) {
    throw Error(fmt::format(
        "DeepSpeed config {}: fp16.enabled and bf16.enabled are both true: expected at most one; "
        "fix the file",
        origin));
  }
  if (fp16 == Switch::kOn) {
    out.mixed_precision = "fp16";
  } else if (bf16 == Switch::kOn) {
    out.mixed_precision = "bf16";
  } else if (fp16 != Switch::kAuto && bf16 != Switch::kAuto &&
             (fp16 == Switch::kOff || bf16 == Switch::kOff)) {
    out.mixed_precision = "no";  // explicitly off, and nothing said "auto"
  }
  // train_batch_size = micro batch x accumulation x processes in DeepSpeed; difftrain takes the
  // per-process batch and derives the global one, so a total is only checked.
  if (root.contains("train_batch_size") && !DsReader::is_auto(root.at("train_batch_size"))) {
    const int64_t total = root.at("train_batch_size").get<int64_t>();
    const auto& micro = out.train_micro_batch_size_per_gpu;
    const int64_t accum = out.gradient_accumulation_steps.value_or(1);
    if (!micro) {
      r.warn("train_batch_size", root.at("train_batch_size"),
             "not used: difftrain's batch is per process; set train_micro_batch_size_per_gpu "
             "(or --train_batch_size), the global batch is that x accumulation x processes");
    } else if (total % (*micro * accum) != 0) {
      r.warn("train_batch_size", root.at("train_batch_size"),
             fmt::format("inconsistent: not a multiple of train_micro_batch_size_per_gpu {} x "
                         "gradient_accumulation_steps {}; ignored, the global batch is {} x "
                         "{} x processes",
                         *micro, accum, *micro, accum));
    } else if (!out.gradient_accumulation_steps && total != *micro) {
      r.warn("train_batch_size", root.at("train_batch_size"),
             "not used to derive gradient_accumulation_steps (difftrain keeps its own): set "
             "gradient_accumulation_steps explicitly");
    }
  }
  return out;
}

ExternalTrainingConfig read_deepspeed_config(const std::string& path) {
  return parse_deepspeed_config(detail::read_text(path, "DeepSpeed config"), path);
}

}  // namespace difftrain::settings
