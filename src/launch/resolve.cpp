#include "difftrain/launch/resolve.h"

#include "difftrain/launch/config.h"
#include "difftrain/settings/config_merge.h"
#include "difftrain/settings/sharding_config.h"
#include "difftrain/settings/sharding_options.h"

#include <filesystem>
#include <optional>

namespace difftrain::launch {

namespace {

namespace fs = std::filesystem;

// The LaunchOptions fields a config file or a flag may set, under Accelerate's names.
template <typename T>
struct Field {
  const char* name;
  T LaunchOptions::*option;
  std::optional<T> LaunchConfig::*config;
};

const Field<int> kIntFields[] = {
    {"num_processes", &LaunchOptions::num_processes, &LaunchConfig::num_processes},
    {"num_machines", &LaunchOptions::num_machines, &LaunchConfig::num_machines},
    {"machine_rank", &LaunchOptions::machine_rank, &LaunchConfig::machine_rank},
    {"main_process_port", &LaunchOptions::main_process_port, &LaunchConfig::main_process_port},
    {"num_cpu_threads_per_process", &LaunchOptions::num_cpu_threads_per_process,
     &LaunchConfig::num_cpu_threads_per_process},
    {"gradient_accumulation_steps", &LaunchOptions::gradient_accumulation_steps,
     &LaunchConfig::gradient_accumulation_steps},
    {"max_restarts", &LaunchOptions::max_restarts, &LaunchConfig::max_restarts},
};

const Field<std::string> kStringFields[] = {
    {"main_process_ip", &LaunchOptions::main_process_ip, &LaunchConfig::main_process_ip},
    {"mixed_precision", &LaunchOptions::mixed_precision, &LaunchConfig::mixed_precision},
    {"log_dir", &LaunchOptions::log_dir, &LaunchConfig::log_dir},
};

settings::SettingLayer config_layer(const LaunchConfig& c, const std::string& path) {
  settings::SettingLayer layer;
  layer.source = settings::SettingSource::kConfigFile;
  layer.origin = path;
  for (const auto& f : kIntFields) {
    if (c.*f.config) layer.set(f.name, *(c.*f.config));
  }
  for (const auto& f : kStringFields) {
    if (c.*f.config) layer.set(f.name, *(c.*f.config));
  }
  return layer;
}

settings::SettingLayer flags_layer(const LaunchFlags& flags) {
  settings::SettingLayer layer;
  layer.source = settings::SettingSource::kFlag;
  layer.origin = "flags";
  for (const auto& f : kIntFields) {
    if (flags.given.count(f.name)) layer.set(f.name, flags.options.*f.option);
  }
  for (const auto& f : kStringFields) {
    if (flags.given.count(f.name)) layer.set(f.name, flags.options.*f.option);
  }
  if (flags.given.count("sharding_strategy")) {
    layer.set("sharding_strategy", settings::to_string(settings::parse_sharding_strategy(
                                       flags.sharding_strategy, "--sharding_strategy")));
  }
  // Checked here, so a typo fails in the launcher rather than in every rank.
  if (flags.given.count("offload_optimizer_device")) {
    layer.set(
        "offload_optimizer_device",
        settings::parse_offload_device(flags.offload_optimizer_device, "--offload_optimizer_device")
            ? "cpu"
            : "none");
  }
  if (flags.given.count("offload_param_device")) {
    layer.set("offload_param_device",
              settings::parse_offload_device(flags.offload_param_device, "--offload_param_device")
                  ? "cpu"
                  : "none");
  }
  return layer;
}

}  // namespace

LaunchOptions resolve_launch_options(const LaunchFlags& flags,
                                     const std::function<void(const std::string&)>& report) {
  std::string path = flags.config_file;
  if (path.empty() && fs::exists(default_config_path())) path = default_config_path();
  std::vector<settings::SettingLayer> layers;
  if (!path.empty()) {
    // One read of the file: launch::parse_config() takes the top-level keys, the Accelerate
    // reader only the sections, under the top-level values parse_config() read.
    const std::string text = read_config_text(path);
    const LaunchConfig c = parse_config(text, path);
    for (const auto& note : c.notes) report("difftrain launch: config " + path + ": " + note);
    layers.push_back(config_layer(c, path));
    settings::AccelerateTopLevel top;
    top.distributed_type = c.accelerate_distributed_type;
    top.mixed_precision = c.mixed_precision;
    if (c.gradient_accumulation_steps)
      top.gradient_accumulation_steps = *c.gradient_accumulation_steps;
    const settings::ExternalTrainingConfig sections =
        settings::parse_accelerate_sections(text, path, top, fs::path(path).parent_path().string());
    for (const auto& w : sections.warnings) report("difftrain launch: warning: " + w);
    layers.push_back(settings::external_config_layer(sections, path));
  }
  if (!flags.deepspeed_config_file.empty()) {
    const settings::ExternalTrainingConfig ds =
        settings::read_deepspeed_config(flags.deepspeed_config_file);
    for (const auto& w : ds.warnings) report("difftrain launch: warning: " + w);
    layers.push_back(settings::external_config_layer(ds, flags.deepspeed_config_file));
  }
  layers.push_back(flags_layer(flags));
  const settings::MergedSettings merged = settings::merge_settings(layers);

  LaunchOptions options = flags.options;
  for (const auto& f : kIntFields) {
    if (const auto* s = merged.find(f.name)) options.*f.option = s->value.get<int>();
  }
  for (const auto& f : kStringFields) {
    if (const auto* s = merged.find(f.name)) options.*f.option = s->value.get<std::string>();
  }
  if (merged.find("sharding_strategy") != nullptr ||
      merged.find("offload_optimizer_device") != nullptr ||
      merged.find("offload_param_device") != nullptr) {
    const settings::ShardingOptions sharding =
        settings::merged_sharding_options(merged, settings::ShardingOptions{});
    for (const auto& [name, value] : settings::sharding_env(sharding)) {
      options.extra_env[name] = value;
    }
  }
  if (merged.find("max_grad_norm") != nullptr || merged.find("train_batch_size") != nullptr) {
    report(
        "difftrain launch: note: gradient_clipping and train_micro_batch_size_per_gpu are "
        "training options the ranks do not get from the launcher: give the same file to "
        "`difftrain train --deepspeed_config` (or --accelerate_config_file)");
  }
  return options;
}

}  // namespace difftrain::launch
