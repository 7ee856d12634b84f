// The one precedence merge (settings::merge_settings: defaults <- config files <- environment <-
// flags) and `difftrain launch`'s use of it (launch::resolve_launch_options).
#include "difftrain/settings/config_merge.h"
#include "difftrain/accel/sharding.h"
#include "difftrain/launch/resolve.h"
#include "difftrain/settings/sharding_config.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>

namespace {

using difftrain::settings::merge_settings;
using difftrain::settings::SettingLayer;
using difftrain::settings::SettingSource;

SettingLayer layer(SettingSource source, const std::string& origin,
                   std::vector<std::pair<std::string, nlohmann::json>> values) {
  SettingLayer l;
  l.source = source;
  l.origin = origin;
  for (auto& [name, value] : values) l.set(name, value);
  return l;
}

std::string merge_temp_dir(const std::string& name) {
  const auto dir = std::filesystem::temp_directory_path() /
                   ("difftrain-config-merge-" + name + "-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  return dir.string();
}

std::string all_lines(const std::vector<std::string>& lines) {
  std::string all;
  for (const auto& l : lines) all += l + "\n";
  return all;
}

TEST(ConfigMerge, HigherSourceWinsAndLaterFileWinsWithinASource) {
  // Given out of order on purpose: the source decides, not the position.
  const std::vector<SettingLayer> layers = {
      layer(SettingSource::kFlag, "flags", {{"mixed_precision", "fp16"}}),
      layer(SettingSource::kConfigFile, "a.yaml",
            {{"mixed_precision", "bf16"}, {"gradient_accumulation_steps", 2}}),
      layer(SettingSource::kEnvironment, "environment", {{"gradient_accumulation_steps", 3}}),
      layer(SettingSource::kConfigFile, "ds.json",
            {{"gradient_accumulation_steps", 4}, {"max_grad_norm", 0.5}}),
      layer(SettingSource::kDefault, "defaults",
            {{"mixed_precision", "no"}, {"max_grad_norm", 1.0}, {"train_batch_size", 16}}),
  };
  const auto merged = merge_settings(layers);
  ASSERT_NE(merged.find("mixed_precision"), nullptr);
  EXPECT_EQ(merged.find("mixed_precision")->value, "fp16");
  EXPECT_EQ(merged.find("mixed_precision")->source, SettingSource::kFlag);
  EXPECT_EQ(merged.find("gradient_accumulation_steps")->value, 3);  // environment > files
  EXPECT_EQ(merged.find("max_grad_norm")->value, 0.5);              // file > defaults
  EXPECT_EQ(merged.find("max_grad_norm")->layer, 3u);
  EXPECT_EQ(merged.find("train_batch_size")->source, SettingSource::kDefault);
  EXPECT_EQ(merged.find("seed"), nullptr);
  // What a file states and a higher layer replaced; a later file replacing an earlier one and
  // defaults replaced by anything are not overrides.
  ASSERT_EQ(merged.overrides.size(), 3u);
  EXPECT_EQ(merged.overrides[0].name, "mixed_precision");
  EXPECT_EQ(merged.overrides[0].layer, 1u);
  EXPECT_EQ(merged.overrides[0].overridden, "bf16");
  EXPECT_EQ(merged.overrides[0].by, SettingSource::kFlag);
  EXPECT_EQ(merged.overrides[1].name, "gradient_accumulation_steps");
  EXPECT_EQ(merged.overrides[1].layer, 1u);
  EXPECT_EQ(merged.overrides[2].layer, 3u);
  EXPECT_EQ(merged.overrides[2].value, 3);
  EXPECT_EQ(merged.overrides[2].overridden, 4);
}

TEST(ConfigMerge, ExternalConfigLayerImpliesFsdpDefaults) {
  const auto ext = difftrain::settings::parse_accelerate_config(
      "distributed_type: FSDP\nmixed_precision: bf16\nfsdp_config:\n"
      "  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_min_num_params: 5000\n",
      "a.yaml");
  const SettingLayer file = difftrain::settings::external_config_layer(ext, "a.yaml");
  ASSERT_NE(file.find("sharding_strategy"), nullptr);
  EXPECT_EQ(*file.find("sharding_strategy"), "SHARD_GRAD_OP");
  EXPECT_EQ(*file.find("fsdp_min_num_params"), 5000);
  EXPECT_EQ(*file.find("fsdp_transformer_layer_cls_to_wrap"), "");
  EXPECT_EQ(*file.find("mixed_precision"), "bf16");
  EXPECT_EQ(file.find("max_grad_norm"), nullptr);
  // Flags that differ only from implied values are not overrides.
  const auto merged = merge_settings(
      {file, layer(SettingSource::kFlag, "flags",
                   {{"fsdp_auto_wrap_policy", "NO_WRAP"}, {"fsdp_min_num_params", 77}})});
  ASSERT_EQ(merged.overrides.size(), 1u);
  EXPECT_EQ(merged.overrides[0].name, "fsdp_min_num_params");
  const auto sharding =
      difftrain::settings::merged_sharding_options(merged, difftrain::accel::ShardingOptions{});
  EXPECT_EQ(sharding.strategy, difftrain::accel::ShardingStrategy::kShardGradOp);
  EXPECT_EQ(sharding.auto_wrap.policy, "NO_WRAP");
  EXPECT_EQ(sharding.auto_wrap.min_num_params, 77);
}

TEST(ConfigMerge, AccelerateSectionsReadWithoutTheTopLevel) {
  const std::string yaml =
      "distributed_type: fsdp\nnum_procesess: 2\nmixed_precision: fp8\n"
      "fsdp_config:\n  fsdp_sharding_strategy: 2\n  fsdp_offload_params: true\n";
  const auto whole = difftrain::settings::parse_accelerate_config(yaml, "a.yaml");
  difftrain::settings::AccelerateTopLevel top;
  top.distributed_type = "FSDP";
  top.mixed_precision = "no";
  const auto sections = difftrain::settings::parse_accelerate_sections(yaml, "a.yaml", top);
  EXPECT_EQ(sections.sharding.strategy, whole.sharding.strategy);
  EXPECT_EQ(sections.mixed_precision, whole.mixed_precision);
  EXPECT_TRUE(sections.sharding.offload_optimizer);
  EXPECT_EQ(sections.sharding.offload_optimizer, whole.sharding.offload_optimizer);
  EXPECT_TRUE(sections.warnings.empty()) << all_lines(sections.warnings);
  EXPECT_EQ(whole.warnings.size(), 2u) << all_lines(whole.warnings);  // fp8, num_procesess
}

TEST(LaunchResolve, ConfigFileThenDeepSpeedFileThenFlags) {
  const auto dir = merge_temp_dir("resolve");
  const std::string yaml = dir + "/accelerate.yaml";
  std::ofstream(yaml) << "distributed_type: FSDP\nnum_processes: 2\nmixed_precision: bf16\n"
                         "max_restarts: 1\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
                         "  fsdp_offload_params: true\n  fsdp_forward_prefetch: false\n";
  difftrain::launch::LaunchFlags flags;
  flags.config_file = yaml;
  flags.options.num_processes = 3;
  flags.given = {"num_processes"};
  std::vector<std::string> lines;
  auto report = [&](const std::string& line) { lines.push_back(line); };
  const auto o = difftrain::launch::resolve_launch_options(flags, report);
  EXPECT_EQ(o.num_processes, 3);  // the flag
  EXPECT_EQ(o.mixed_precision, "bf16");
  EXPECT_EQ(o.max_restarts, 1);
  EXPECT_EQ(o.extra_env.at("DIFFTRAIN_SHARDING_STRATEGY"), "SHARD_GRAD_OP");
  EXPECT_EQ(o.extra_env.at("DIFFTRAIN_FSDP_FORWARD_PREFETCH"), "false");
  // fsdp_offload_params under SHARD_GRAD_OP: the optimizer side goes to host memory.
  EXPECT_EQ(o.extra_env.at("DIFFTRAIN_OFFLOAD_OPTIMIZER_DEVICE"), "cpu");
  EXPECT_EQ(o.extra_env.at("DIFFTRAIN_OFFLOAD_PARAM_DEVICE"), "none");
  ASSERT_EQ(lines.size(), 1u) << all_lines(lines);
  EXPECT_EQ(lines[0].rfind("difftrain launch: config " + yaml + ": distributed_type: FSDP", 0), 0u)
      << lines[0];

  // A DeepSpeed file replaces the YAML's sharding; --sharding_strategy and --mixed_precision
  // win over both.
  const std::string ds = dir + "/ds.json";
  std::ofstream(ds) << R"({"zero_optimization": {"stage": 1}, "fp16": {"enabled": true},
                          "gradient_accumulation_steps": 4, "gradient_clipping": 1.0})";
  flags.deepspeed_config_file = ds;
  lines.clear();
  const auto d = difftrain::launch::resolve_launch_options(flags, report);
  EXPECT_EQ(d.extra_env.at("DIFFTRAIN_SHARDING_STRATEGY"), "SHARD_OPTIMIZER");
  EXPECT_EQ(d.extra_env.at("DIFFTRAIN_FSDP_FORWARD_PREFETCH"), "true");
  EXPECT_EQ(d.mixed_precision, "fp16");
  EXPECT_EQ(d.gradient_accumulation_steps, 4);
  ASSERT_EQ(lines.size(), 2u) << all_lines(lines);
  EXPECT_EQ(lines[1].rfind("difftrain launch: note: gradient_clipping", 0), 0u) << lines[1];
  flags.given.insert({"sharding_strategy", "mixed_precision"});
  flags.sharding_strategy = "zero3";
  flags.options.mixed_precision = "no";
  const auto f = difftrain::launch::resolve_launch_options(flags, report);
  EXPECT_EQ(f.extra_env.at("DIFFTRAIN_SHARDING_STRATEGY"), "FULL_SHARD");
  EXPECT_EQ(f.mixed_precision, "no");
  std::filesystem::remove_all(dir);
}

TEST(LaunchResolve, NoConfigFileNoSharding) {
  const char* saved = std::getenv("XDG_CACHE_HOME");
  const std::string keep = saved ? saved : "";
  const auto dir = merge_temp_dir("xdg");
  setenv("XDG_CACHE_HOME", dir.c_str(), 1);
  difftrain::launch::LaunchFlags flags;
  flags.options.num_processes = 2;
  flags.given = {"num_processes"};
  int reported = 0;
  const auto o =
      difftrain::launch::resolve_launch_options(flags, [&](const std::string&) { ++reported; });
  EXPECT_EQ(o.num_processes, 2);
  EXPECT_EQ(o.mixed_precision, "no");
  EXPECT_TRUE(o.extra_env.empty());
  EXPECT_EQ(reported, 0);
  if (saved) {
    setenv("XDG_CACHE_HOME", keep.c_str(), 1);
  } else {
    unsetenv("XDG_CACHE_HOME");
  }
  std::filesystem::remove_all(dir);
}

}  // namespace
