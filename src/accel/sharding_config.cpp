#include "difftrain/accel/sharding_config.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include <cctype>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

namespace difftrain::accel {
namespace {

namespace fs = std::filesystem;
using nlohmann::json;

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::string read_text(const std::string& path, const char* what) {
  std::ifstream in(path);
  if (!in) {
    throw Error(fmt::format("{} {} cannot be read: {}: check the path", what, path,
                            fs::exists(path) ? "permission denied" : "no such file"));
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

// ---------------------------------------------------------------------------------------------
// DeepSpeed JSON

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
      {"cpu_offload", {{"false"}, "offload is not supported: state stays in each rank's memory"}},
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
      {"zero_force_ds_cpu_optimizer", {{"false"}, "no CPU optimizer: offload is not supported"}},
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
      static const ShardingStrategy by_stage[] = {
          ShardingStrategy::kNoShard, ShardingStrategy::kShardOptimizer,
          ShardingStrategy::kShardGradOp, ShardingStrategy::kFullShard};
      r.out.sharding.strategy = by_stage[value.get<int64_t>()];
      r.out.sharding_set = true;
    } else if (key == "offload_optimizer" || key == "offload_param") {
      if (!value.is_object()) r.fail(name, value, "an object ({\"device\": \"none\"})");
      const json device = value.value("device", json("none"));
      if (!device.is_string()) r.fail(name + ".device", device, "\"none\", \"cpu\" or \"nvme\"");
      const std::string d = device.get<std::string>();
      if (d == "none" || d == "auto") continue;
      if (d != "cpu" && d != "nvme")
        r.fail(name + ".device", device, "\"none\", \"cpu\" or \"nvme\"");
      r.warn(name + ".device", device,
             key == "offload_optimizer"
                 ? "offload is not supported: optimizer state stays in each rank's memory "
                   "(sharded by ZeRO stage >= 1)"
                 : "offload is not supported: parameters stay in each rank's memory (sharded by "
                   "ZeRO stage 3)");
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
  return parse_deepspeed_config(read_text(path, "DeepSpeed config"), path);
}

// ---------------------------------------------------------------------------------------------
// Accelerate YAML

namespace {

struct YamlReader {
  const std::string& origin;
  ExternalTrainingConfig& out;

  [[noreturn]] void fail(const std::string& key, const YAML::Node& value,
                         const std::string& expected) const {
    throw Error(fmt::format("Accelerate config {}: {} is '{}': expected {}; fix the file", origin,
                            key, text(value), expected));
  }
  void warn(const std::string& key, const YAML::Node& value, const std::string& why) const {
    out.warnings.push_back(fmt::format("{}: {}={}: {}", origin, key, text(value), why));
  }

  static std::string text(const YAML::Node& node) {
    if (node.IsScalar()) return node.Scalar();
    if (node.IsNull()) return "null";
    YAML::Emitter e;
    e << YAML::Flow << node;
    return e.c_str();
  }

  /// A mapping key as text; YAML allows lists and mappings as keys (`? [a]: 1`), Accelerate
  /// configs never use them.
  std::string key_name(const YAML::Node& k, const std::string& parent) const {
    if (!k.IsScalar()) fail(parent, k, "a plain key name (not a list or mapping)");
    return k.Scalar();
  }

  std::string scalar(const YAML::Node& v, const std::string& key) const {
    if (!v.IsScalar()) fail(key, v, "a single value");
    return v.Scalar();
  }

  bool boolean(const YAML::Node& v, const std::string& key) const {
    const std::string t = upper(v.IsScalar() ? v.Scalar() : "");
    if (t == "TRUE" || t == "YES" || t == "1") return true;
    if (t == "FALSE" || t == "NO" || t == "0" || v.IsNull()) return false;
    fail(key, v, "true or false");
  }

  std::optional<int64_t> whole(const YAML::Node& v, const std::string& key, int64_t min) const {
    if (v.IsNull() || (v.IsScalar() && v.Scalar() == "auto")) return std::nullopt;
    int64_t n = 0;
    try {
      n = v.as<int64_t>();
    } catch (const YAML::Exception&) {
      fail(key, v, fmt::format("a whole number >= {}", min));
    }
    if (n < min) fail(key, v, fmt::format("a whole number >= {}", min));
    return n;
  }

  std::optional<double> number(const YAML::Node& v, const std::string& key) const {
    if (v.IsNull() || (v.IsScalar() && v.Scalar() == "auto")) return std::nullopt;
    double d = 0;
    try {
      d = v.as<double>();
    } catch (const YAML::Exception&) {
      fail(key, v, "a number >= 0");
    }
    if (!(d >= 0) || !std::isfinite(d)) fail(key, v, "a number >= 0");
    return d;
  }
};

// Top-level keys that belong to `difftrain launch` (launch/config.cpp reads them and reports
// the ones it cannot honour), so they pass here quietly.
const std::set<std::string>& launch_keys() {
  static const std::set<std::string> keys = {"compute_environment",
                                             "num_processes",
                                             "num_machines",
                                             "machine_rank",
                                             "main_process_ip",
                                             "main_process_port",
                                             "num_cpu_threads_per_process",
                                             "max_restarts",
                                             "log_dir",
                                             "rdzv_backend",
                                             "same_network",
                                             "use_cpu",
                                             "debug",
                                             "downcast_bf16",
                                             "enable_cpu_affinity",
                                             "gpu_ids",
                                             "main_training_function",
                                             "tpu_env",
                                             "tpu_use_cluster",
                                             "tpu_use_sudo",
                                             "tpu_name",
                                             "tpu_zone",
                                             "commands",
                                             "command_file",
                                             "num_gpus",
                                             "dynamo_config",
                                             "megatron_lm_config",
                                             "ipex_config",
                                             "mpirun_config",
                                             "fp8_config"};
  return keys;
}

void read_fsdp(const YamlReader& r, const YAML::Node& fsdp) {
  ShardingOptions& s = r.out.sharding;
  s.strategy = ShardingStrategy::kFullShard;  // Accelerate's default
  bool strategy_given = false;
  std::optional<bool> reshard_after_forward;
  for (const auto& item : fsdp) {
    const std::string key = r.key_name(item.first, "fsdp_config");
    const YAML::Node& v = item.second;
    const std::string name = "fsdp_config." + key;
    if (key == "fsdp_sharding_strategy") {
      const std::string t = upper(r.scalar(v, name));
      strategy_given = true;
      if (t == "HYBRID_SHARD" || t == "4" || t == "HYBRID_SHARD_ZERO2" || t == "5") {
        const bool zero2 = t == "HYBRID_SHARD_ZERO2" || t == "5";
        s.strategy = zero2 ? ShardingStrategy::kShardGradOp : ShardingStrategy::kFullShard;
        r.warn(name, v,
               fmt::format("hybrid sharding (shard within a machine, replicate across machines) "
                           "is not supported: sharding over all ranks with {}",
                           to_string(s.strategy)));
      } else {
        s.strategy = parse_sharding_strategy(t, "Accelerate config " + r.origin + ": " + name);
      }
    } else if (key == "fsdp_reshard_after_forward") {
      const std::string t = upper(r.scalar(v, name));
      if (t == "TRUE" || t == "FALSE") {
        reshard_after_forward = t == "TRUE";
      } else {
        s.strategy = parse_sharding_strategy(t, "Accelerate config " + r.origin + ": " + name);
        strategy_given = true;
      }
    } else if (key == "fsdp_auto_wrap_policy") {
      const std::string t = upper(r.scalar(v, name));
      if (t != "TRANSFORMER_BASED_WRAP" && t != "SIZE_BASED_WRAP" && t != "NO_WRAP") {
        r.fail(name, v, "TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP");
      }
      s.auto_wrap.policy = t;
    } else if (key == "fsdp_min_num_params") {
      if (auto n = r.whole(v, name, 1)) s.auto_wrap.min_num_params = *n;
    } else if (key == "fsdp_transformer_layer_cls_to_wrap") {
      s.auto_wrap.classes.clear();
      std::vector<std::string> parts;
      if (v.IsSequence()) {
        for (const auto& c : v) parts.push_back(r.scalar(c, name));
      } else if (!v.IsNull()) {
        parts.push_back(r.scalar(v, name));
      }
      for (const auto& p : parts) {
        std::stringstream in(p);
        std::string c;
        while (std::getline(in, c, ',')) {
          c.erase(0, c.find_first_not_of(" \t"));
          c.erase(c.find_last_not_of(" \t") + 1);
          if (!c.empty()) s.auto_wrap.classes.push_back(c);
        }
      }
    } else if (key == "fsdp_forward_prefetch") {
      s.forward_prefetch = r.boolean(v, name);
    } else if (key == "fsdp_backward_prefetch" || key == "fsdp_backward_prefetch_policy") {
      const std::string t = upper(v.IsNull() ? "NO_PREFETCH" : r.scalar(v, name));
      if (t == "BACKWARD_PRE" || t == "TRUE") {
        s.backward_prefetch = true;
      } else if (t == "BACKWARD_POST") {
        s.backward_prefetch = true;
        r.warn(name, v, "difftrain prefetches when a unit's backward begins: runs as BACKWARD_PRE");
      } else if (t == "NO_PREFETCH" || t == "FALSE") {
        s.backward_prefetch = false;
      } else {
        r.fail(name, v, "BACKWARD_PRE, BACKWARD_POST or NO_PREFETCH");
      }
    } else if (key == "fsdp_state_dict_type") {
      if (upper(r.scalar(v, name)) != "SHARDED_STATE_DICT") {
        r.warn(name, v,
               "difftrain always writes sharded checkpoints; `difftrain merge-weights` "
               "consolidates them into one file");
      }
    } else if (key == "fsdp_offload_params") {
      if (r.boolean(v, name)) {
        r.warn(name, v, "offload is not supported: parameters stay in each rank's memory");
      }
    } else if (key == "fsdp_use_orig_params") {
      // difftrain's optimizer always sees the original parameters: either value works.
    } else if (key == "fsdp_sync_module_states") {
      if (!r.boolean(v, name)) {
        r.warn(name, v, "rank 0's weights are always broadcast to every rank by prepare()");
      }
    } else if (key == "fsdp_cpu_ram_efficient_loading") {
      if (r.boolean(v, name)) {
        r.warn(name, v, "not supported: every rank loads the whole model before it is sharded");
      }
    } else if (key == "fsdp_activation_checkpointing") {
      if (r.boolean(v, name)) {
        r.warn(name, v, "not applied: use `difftrain train --gradient_checkpointing`");
      }
    } else if (key == "fsdp_version") {
      const std::string t = r.scalar(v, name);
      if (t != "1" && t != "2") r.fail(name, v, "1 or 2");
    } else {
      r.warn(name, v, "unknown fsdp_config key: ignored (check its spelling)");
    }
  }
  // FSDP2 (fsdp_version: 2) says reshard_after_forward instead of a strategy.
  if (!strategy_given && reshard_after_forward) {
    s.strategy =
        *reshard_after_forward ? ShardingStrategy::kFullShard : ShardingStrategy::kShardGradOp;
  }
  r.out.sharding_set = true;
}

void read_deepspeed_section(const YamlReader& r, const YAML::Node& ds,
                            const std::string& base_dir) {
  ExternalTrainingConfig& out = r.out;
  // The JSON file first: the YAML's own keys override it (with a warning when they differ).
  if (ds["deepspeed_config_file"] && !ds["deepspeed_config_file"].IsNull()) {
    const std::string file = r.scalar(ds["deepspeed_config_file"], "deepspeed_config_file");
    if (!file.empty() && file != "none") {
      fs::path p(file);
      if (p.is_relative() && !base_dir.empty()) p = fs::path(base_dir) / p;
      ExternalTrainingConfig inner = read_deepspeed_config(p.string());
      auto warnings = std::move(out.warnings);
      const auto mp = out.mixed_precision;
      const auto gas = out.gradient_accumulation_steps;
      out = std::move(inner);
      warnings.insert(warnings.end(), out.warnings.begin(), out.warnings.end());
      out.warnings = std::move(warnings);
      if (mp && out.mixed_precision && *mp != *out.mixed_precision) {
        out.warnings.push_back(
            fmt::format("{}: mixed_precision={} differs from {}'s fp16/bf16 sections: using {}",
                        r.origin, *mp, p.string(), *out.mixed_precision));
      }
      if (!out.mixed_precision) out.mixed_precision = mp;
      if (gas && out.gradient_accumulation_steps && *gas != *out.gradient_accumulation_steps) {
        out.warnings.push_back(
            fmt::format("{}: gradient_accumulation_steps={} differs from {}'s: using {}", r.origin,
                        *gas, p.string(), *out.gradient_accumulation_steps));
      }
      if (!out.gradient_accumulation_steps) out.gradient_accumulation_steps = gas;
    }
  }
  auto set_from_yaml = [&](auto& target, const auto& value, const std::string& name) {
    if (!value) return;
    if (target && *target != *value) {
      out.warnings.push_back(
          fmt::format("{}: deepspeed_config.{}={} overrides {}", r.origin, name, *value, *target));
    }
    target = value;
  };
  for (const auto& item : ds) {
    const std::string key = r.key_name(item.first, "deepspeed_config");
    const YAML::Node& v = item.second;
    const std::string name = "deepspeed_config." + key;
    if (key == "deepspeed_config_file") {
      continue;
    } else if (key == "zero_stage") {
      const std::optional<int64_t> stage = r.whole(v, name, 0);
      if (!stage) continue;
      if (*stage > 3) r.fail(name, v, "0, 1, 2 or 3 (ZeRO stage)");
      static const ShardingStrategy by_stage[] = {
          ShardingStrategy::kNoShard, ShardingStrategy::kShardOptimizer,
          ShardingStrategy::kShardGradOp, ShardingStrategy::kFullShard};
      out.sharding.strategy = by_stage[*stage];
      out.sharding_set = true;
    } else if (key == "offload_optimizer_device" || key == "offload_param_device") {
      const std::string d = v.IsNull() ? "none" : r.scalar(v, name);
      if (d == "none") continue;
      if (d != "cpu" && d != "nvme") r.fail(name, v, "none, cpu or nvme");
      r.warn(name, v,
             key == "offload_optimizer_device"
                 ? "offload is not supported: optimizer state stays in each rank's memory"
                 : "offload is not supported: parameters stay in each rank's memory");
    } else if (key == "offload_optimizer_nvme_path" || key == "offload_param_nvme_path") {
      // Only used with an nvme device, which is reported above.
    } else if (key == "gradient_accumulation_steps") {
      set_from_yaml(out.gradient_accumulation_steps, r.whole(v, name, 1), key);
    } else if (key == "gradient_clipping") {
      set_from_yaml(out.gradient_clipping, r.number(v, name), key);
    } else if (key == "zero3_init_flag") {
      if (r.boolean(v, name)) {
        r.warn(name, v, "no zero.Init: every rank builds the whole model, then it is sharded");
      }
    } else if (key == "zero3_save_16bit_model") {
      if (r.boolean(v, name)) {
        r.warn(name, v,
               "difftrain always writes sharded checkpoints; `difftrain merge-weights` "
               "consolidates them into one file");
      }
    } else if (key == "deepspeed_multinode_launcher") {
      // A launch setting: `difftrain launch` starts the ranks on every machine itself.
    } else if (key == "deepspeed_hostfile" || key == "deepspeed_inclusion_filter" ||
               key == "deepspeed_exclusion_filter") {
      const std::string t = v.IsNull() ? "none" : r.text(v);
      if (t == "none" || t.empty()) continue;
      r.warn(name, v,
             "not used: run `difftrain launch` on each machine with --num_machines, "
             "--machine_rank and --main_process_ip");
    } else if (key == "deepspeed_moe_layer_cls_names") {
      if (!v.IsNull() && r.text(v) != "none")
        r.warn(name, v, "mixture-of-experts is not supported");
    } else {
      r.warn(name, v, "unknown deepspeed_config key: ignored (check its spelling)");
    }
  }
  if (!out.sharding_set) {
    out.warnings.push_back(fmt::format(
        "{}: deepspeed_config: no zero_stage (nor a zero_optimization.stage in "
        "deepspeed_config_file) under distributed_type DEEPSPEED: the sharding strategy stays "
        "difftrain's",
        r.origin));
  }
}

}  // namespace

ExternalTrainingConfig parse_accelerate_config(const std::string& yaml_text,
                                               const std::string& origin,
                                               const std::string& base_dir) {
  YAML::Node root;
  try {
    root = YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    throw Error(fmt::format("Accelerate config {}: line {}: invalid YAML ({}); fix the file",
                            origin, e.mark.line + 1, e.msg));
  }
  ExternalTrainingConfig out;
  if (root.IsNull()) return out;
  if (!root.IsMap()) {
    throw Error(fmt::format(
        "Accelerate config {}: expected a mapping of keys (distributed_type: FSDP, ...)", origin));
  }
  const YamlReader r{origin, out};
  std::string type = "NO";
  if (root["distributed_type"] && !root["distributed_type"].IsNull()) {
    type = upper(r.scalar(root["distributed_type"], "distributed_type"));
  }
  for (const auto& item : root) {
    const std::string key = r.key_name(item.first, "the top level");
    const YAML::Node& v = item.second;
    if (key == "distributed_type") {
      if (type != "NO" && type != "MULTI_CPU" && type != "MULTI_GPU" && type != "FSDP" &&
          type != "DEEPSPEED") {
        r.warn(key, v,
               "not supported: difftrain runs data-parallel ranks (NO, MULTI_CPU, MULTI_GPU) "
               "with optional sharding (FSDP, DEEPSPEED)");
      }
    } else if (key == "mixed_precision") {
      if (v.IsNull()) continue;  // not set: difftrain's value stays
      const std::string m = r.scalar(v, key);
      if (m == "fp8") {
        r.warn(key, v, "fp8 is not supported: using no");
        out.mixed_precision = "no";
      } else if (m == "no" || m == "fp16" || m == "bf16") {
        out.mixed_precision = m;
      } else {
        r.fail(key, v, "no, fp16 or bf16");
      }
    } else if (key == "gradient_accumulation_steps") {
      out.gradient_accumulation_steps = r.whole(v, key, 1);
    } else if (key == "fsdp_config" || key == "deepspeed_config") {
      // Read below, after the top-level values they may override.
    } else if (!launch_keys().count(key)) {
      r.warn(key, v,
             "unknown key: ignored (not an Accelerate or difftrain setting; check its spelling)");
    }
  }
  for (const char* section : {"fsdp_config", "deepspeed_config"}) {
    const YAML::Node v = root[section];
    if (!v || v.IsNull() || (v.IsMap() && v.size() == 0)) continue;
    if (!v.IsMap()) r.fail(section, v, "a mapping of keys");
    const bool used = (type == "FSDP" && std::string(section) == "fsdp_config") ||
                      (type == "DEEPSPEED" && std::string(section) == "deepspeed_config");
    if (!used) {
      out.warnings.push_back(fmt::format(
          "{}: {} is ignored because distributed_type is {} (set distributed_type: {} to use it)",
          origin, section, type, std::string(section) == "fsdp_config" ? "FSDP" : "DEEPSPEED"));
    } else if (type == "FSDP") {
      read_fsdp(r, v);
    } else {
      read_deepspeed_section(r, v, base_dir);
    }
  }
  // distributed_type FSDP without an fsdp_config section still shards (FULL_SHARD).
  if (type == "FSDP" && !out.sharding_set) {
    out.sharding.strategy = ShardingStrategy::kFullShard;
    out.sharding_set = true;
  }
  if (type == "DEEPSPEED" && !out.sharding_set &&
      !(root["deepspeed_config"] && root["deepspeed_config"].IsMap() &&
        root["deepspeed_config"].size() > 0)) {
    out.warnings.push_back(fmt::format(
        "{}: deepspeed_config: missing under distributed_type DEEPSPEED: the sharding strategy "
        "stays difftrain's",
        origin));
  }
  return out;
}

ExternalTrainingConfig read_accelerate_config(const std::string& path) {
  const std::string text = read_text(path, "Accelerate config");
  return parse_accelerate_config(text, path, fs::path(path).parent_path().string());
}

std::vector<std::pair<std::string, std::string>> sharding_env(const ShardingOptions& o) {
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  std::vector<std::pair<std::string, std::string>> env = {
      {"DIFFTRAIN_SHARDING_STRATEGY", to_string(o.strategy)},
      {"DIFFTRAIN_FSDP_AUTO_WRAP_POLICY", o.auto_wrap.policy},
  };
  if (!o.auto_wrap.classes.empty()) {
    env.emplace_back("DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP", join(o.auto_wrap.classes));
  }
  env.emplace_back("DIFFTRAIN_FSDP_MIN_NUM_PARAMS", std::to_string(o.auto_wrap.min_num_params));
  env.emplace_back("DIFFTRAIN_FSDP_FORWARD_PREFETCH", b(o.forward_prefetch));
  env.emplace_back("DIFFTRAIN_FSDP_BACKWARD_PREFETCH", b(o.backward_prefetch));
  env.emplace_back("DIFFTRAIN_SYNC_EACH_BATCH", b(o.sync_each_batch));
  return env;
}

}  // namespace difftrain::accel
