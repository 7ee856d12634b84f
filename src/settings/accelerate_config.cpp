// Accelerate config YAML (what `accelerate config` writes) -> ExternalTrainingConfig: the
// top-level training keys, the fsdp_config and deepspeed_config sections (deepspeed_config_file
// through the DeepSpeed reader), and the DIFFTRAIN_FSDP_* variables that carry the result to the
// ranks. The launch keys (num_processes, ...) are launch/config.cpp's.
#include "difftrain/settings/sharding_config.h"

#include "config_reader_util.h"
#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <filesystem>
#include <set>
#include <sstream>

namespace difftrain::settings {
namespace {

namespace fs = std::filesystem;
using detail::upper;

struct YamlReader {
  const std::string& origin;
  ExternalTrainingConfig& out;
  /// parse_accelerate_sections(): the caller reads and reports the top-level keys itself.
  bool top_level_read_elsewhere = false;

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
  bool offload = false;
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
      // FSDP's CPUOffload: the sharded parameters, their gradients and the optimizer step on the
      // CPU. Parameter offload applies under FULL_SHARD only (settled after the loop).
      offload = r.boolean(v, name);
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
  if (offload && s.strategy == ShardingStrategy::kNoShard) {
    r.out.warnings.push_back(
        r.origin +
        ": fsdp_config.fsdp_offload_params=true: offload needs a sharded strategy; NO_SHARD "
        "trains without offload");
  } else if (offload) {
    // Under SHARD_GRAD_OP the gathered parameters stay on the device between steps (as FSDP
    // keeps them unsharded after forward): only the optimizer side is offloaded.
    s.offload_optimizer = true;
    s.offload_params = s.strategy == ShardingStrategy::kFullShard;
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
      // (Said about the top-level keys, so only when this reader reports them.)
      const bool report = !r.top_level_read_elsewhere;
      if (report && mp && out.mixed_precision && *mp != *out.mixed_precision) {
        out.warnings.push_back(
            fmt::format("{}: mixed_precision={} differs from {}'s fp16/bf16 sections: using {}",
                        r.origin, *mp, p.string(), *out.mixed_precision));
      }
      if (!out.mixed_precision) out.mixed_precision = mp;
      if (report && gas && out.gradient_accumulation_steps &&
          *gas != *out.gradient_accumulation_steps) {
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
      out.sharding.strategy = detail::strategy_of_zero_stage(*stage);
      out.sharding_set = true;
    } else if (key == "offload_optimizer_device" || key == "offload_param_device") {
      const std::string d = v.IsNull() ? "none" : r.scalar(v, name);
      if (d == "none") continue;
      if (d != "cpu" && d != "nvme") r.fail(name, v, "none, cpu or nvme");
      if (d == "nvme") {
        r.warn(name, v, "NVMe offload is not supported: offloading to CPU memory instead");
      }
      (key == "offload_optimizer_device" ? out.sharding.offload_optimizer
                                         : out.sharding.offload_params) = true;
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

// The fsdp_config and deepspeed_config sections, read after the top-level values they may
// override (already in r.out), under `type` (distributed_type, upper-cased).
void read_sections(const YamlReader& r, const YAML::Node& root, const std::string& type,
                   const std::string& base_dir) {
  ExternalTrainingConfig& out = r.out;
  const std::string& origin = r.origin;
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
}

YAML::Node load(const std::string& yaml_text, const std::string& origin) {
  try {
    return YAML::Load(yaml_text);
  } catch (const YAML::ParserException& e) {
    throw Error(fmt::format("Accelerate config {}: line {}: invalid YAML ({}); fix the file",
                            origin, e.mark.line + 1, e.msg));
  }
}

}  // namespace

ExternalTrainingConfig parse_accelerate_config(const std::string& yaml_text,
                                               const std::string& origin,
                                               const std::string& base_dir) {
  const YAML::Node root = load(yaml_text, origin);
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
  read_sections(r, root, type, base_dir);
  return out;
}

ExternalTrainingConfig parse_accelerate_sections(const std::string& yaml_text,
                                                 const std::string& origin,
                                                 const AccelerateTopLevel& top,
                                                 const std::string& base_dir) {
  const YAML::Node root = load(yaml_text, origin);
  ExternalTrainingConfig out;
  if (!root.IsMap()) return out;
  out.mixed_precision = top.mixed_precision;
  out.gradient_accumulation_steps = top.gradient_accumulation_steps;
  const YamlReader r{origin, out, /*top_level_read_elsewhere=*/true};
  read_sections(r, root, top.distributed_type, base_dir);
  return out;
}

ExternalTrainingConfig read_accelerate_config(const std::string& path) {
  const std::string text = detail::read_text(path, "Accelerate config");
  return parse_accelerate_config(text, path, fs::path(path).parent_path().string());
}

std::vector<std::pair<std::string, std::string>> sharding_env(const ShardingOptions& o) {
  auto b = [](bool v) { return std::string(v ? "true" : "false"); };
  std::vector<std::pair<std::string, std::string>> env = {
      {"DIFFTRAIN_SHARDING_STRATEGY", to_string(o.strategy)},
      {"DIFFTRAIN_FSDP_AUTO_WRAP_POLICY", o.auto_wrap.policy},
  };
  if (!o.auto_wrap.classes.empty()) {
    env.emplace_back("DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP", detail::join(o.auto_wrap.classes));
  }
  env.emplace_back("DIFFTRAIN_FSDP_MIN_NUM_PARAMS", std::to_string(o.auto_wrap.min_num_params));
  env.emplace_back("DIFFTRAIN_FSDP_FORWARD_PREFETCH", b(o.forward_prefetch));
  env.emplace_back("DIFFTRAIN_FSDP_BACKWARD_PREFETCH", b(o.backward_prefetch));
  env.emplace_back("DIFFTRAIN_SYNC_EACH_BATCH", b(o.sync_each_batch));
  env.emplace_back("DIFFTRAIN_OFFLOAD_OPTIMIZER_DEVICE", o.offload_optimizer ? "cpu" : "none");
  env.emplace_back("DIFFTRAIN_OFFLOAD_PARAM_DEVICE", o.offload_params ? "cpu" : "none");
  return env;
}

}  // namespace difftrain::settings
