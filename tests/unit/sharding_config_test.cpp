// Configs users already have: DeepSpeed JSON and Accelerate YAML read into ShardingOptions and
// training values; every key difftrain cannot honour is a warning, every bad value a one-line
// error. Also the strategy names, the DIFFTRAIN_* environment round trip and plan_units().

#include "difftrain/settings/sharding_config.h"
#include "difftrain/accel/sharding.h"
#include "difftrain/core/error.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/nn/modules/container/sequential.h>
#include <torch/nn/modules/linear.h>

#include <cstdlib>
#include <fstream>

namespace {

using difftrain::accel::AutoWrapPolicy;
using difftrain::accel::parse_sharding_strategy;
using difftrain::accel::ShardingOptions;
using difftrain::accel::ShardingStrategy;
using difftrain::settings::ExternalTrainingConfig;
using difftrain::settings::parse_accelerate_config;
using difftrain::settings::parse_deepspeed_config;
using difftrain::test::error_of;
using difftrain::test::temp_dir;

std::string all_lines(const std::vector<std::string>& lines) {
  std::string out;
  for (const auto& l : lines) out += l + "\n";
  return out;
}

// Every warning is one line that starts with the file it came from.
void expect_one_line_each(const ExternalTrainingConfig& c, const std::string& origin) {
  for (const auto& w : c.warnings) {
    EXPECT_EQ(w.find('\n'), std::string::npos) << w;
    EXPECT_EQ(w.rfind(origin + ": ", 0), 0u) << w;
  }
}

TEST(ShardingConfig, DeepSpeedStagesMapToStrategies) {
  const ShardingStrategy expected[] = {
      ShardingStrategy::kNoShard, ShardingStrategy::kShardOptimizer, ShardingStrategy::kShardGradOp,
      ShardingStrategy::kFullShard};
  for (int stage = 0; stage <= 3; ++stage) {
    const auto c = parse_deepspeed_config(
        "{\"zero_optimization\": {\"stage\": " + std::to_string(stage) + "}}", "ds.json");
    EXPECT_TRUE(c.sharding_set);
    EXPECT_EQ(c.sharding.strategy, expected[stage]) << "stage " << stage;
    EXPECT_TRUE(c.warnings.empty()) << all_lines(c.warnings);
  }
  const auto none = parse_deepspeed_config("{}", "ds.json");
  EXPECT_FALSE(none.sharding_set);
  EXPECT_FALSE(none.mixed_precision.has_value());
}

TEST(ShardingConfig, DeepSpeedTrainingValues) {
  const auto c = parse_deepspeed_config(R"({
    "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
    "gradient_accumulation_steps": 4, "gradient_clipping": 0.5,
    "fp16": {"enabled": true, "loss_scale": 0, "initial_scale_power": 16},
    "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "none"}},
    "zero_allow_untested_optimizer": true, "wall_clock_breakdown": false})",
                                        "ds.json");
  EXPECT_EQ(c.sharding.strategy, ShardingStrategy::kShardGradOp);
  EXPECT_EQ(c.mixed_precision.value_or("?"), "fp16");
  EXPECT_EQ(c.gradient_accumulation_steps.value_or(0), 4);
  EXPECT_DOUBLE_EQ(c.gradient_clipping.value_or(-1), 0.5);
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value_or(0), 8);
  EXPECT_TRUE(c.warnings.empty()) << all_lines(c.warnings);  // 64 = 8 x 4 x 2 processes

  EXPECT_EQ(parse_deepspeed_config(R"({"bf16": {"enabled": true}})", "a").mixed_precision, "bf16");
  EXPECT_EQ(parse_deepspeed_config(R"({"bfloat16": {"enabled": true}})", "a").mixed_precision,
            "bf16");
  EXPECT_EQ(parse_deepspeed_config(R"({"fp16": {"enabled": false}})", "a").mixed_precision, "no");
  EXPECT_EQ(
      parse_deepspeed_config(R"({"fp16": {"enabled": false}, "bf16": {"enabled": false}})", "a")
          .mixed_precision,
      "no");
}

TEST(ShardingConfig, DeepSpeedAutoKeepsDifftrainValues) {
  // The shape of Hugging Face's ds_config_zero3.json templates.
  const auto c = parse_deepspeed_config(R"({
    "fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000,
             "initial_scale_power": 16, "hysteresis": 2, "min_loss_scale": 1},
    "bf16": {"enabled": "auto"},
    "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto",
                          "stage3_prefetch_bucket_size": "auto",
                          "stage3_param_persistence_threshold": "auto",
                          "stage3_gather_16bit_weights_on_model_save": false},
    "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
    "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto"})",
                                        "ds.json");
  EXPECT_EQ(c.sharding.strategy, ShardingStrategy::kFullShard);
  EXPECT_FALSE(c.mixed_precision.has_value());
  EXPECT_FALSE(c.gradient_accumulation_steps.has_value());
  EXPECT_FALSE(c.gradient_clipping.has_value());
  EXPECT_FALSE(c.train_micro_batch_size_per_gpu.has_value());
  // fp16 "auto" may turn fp16 on, so its loss-scale knobs that differ from difftrain's scaler
  // are reported: window 1000 (difftrain 2000), hysteresis 2 (1), min_loss_scale.
  ASSERT_EQ(c.warnings.size(), 3u) << all_lines(c.warnings);
  // (JSON objects are read in key order.)
  EXPECT_HAS(c.warnings[0], "fp16.hysteresis=2");
  EXPECT_HAS(c.warnings[1], "fp16.loss_scale_window=1000");
  EXPECT_HAS(c.warnings[2], "fp16.min_loss_scale=1");
  // A section that is off: its knobs change nothing and pass quietly.
  EXPECT_TRUE(parse_deepspeed_config(R"({"fp16": {"enabled": false, "loss_scale": 128}})", "a")
                  .warnings.empty());
}

TEST(ShardingConfig, DeepSpeedWarnsEveryUnhonouredKeyOnce) {
  const auto c = parse_deepspeed_config(R"({
    "train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2,
    "fp16": {"enabled": true, "loss_scale": 128},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}},
    "scheduler": {"type": "WarmupLR"},
    "steps_per_print": 10,
    "zero_optimisation": {"stage": 2},
    "zero_optimization": {
      "stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": true},
      "offload_param": {"device": "nvme", "nvme_path": "/nvme"},
      "overlap_comm": true, "contiguous_gradients": true, "reduce_bucket_size": 500000000,
      "stage3_max_live_parameters": 1e9, "stage3_gather_16bit_weights_on_model_save": true,
      "stage3_new_knob": 1, "bucket_magic": 3}})",
                                        "ds.json");
  EXPECT_EQ(c.sharding.strategy, ShardingStrategy::kFullShard);
  // Offload is honoured (pin_memory and nvme_path pass quietly; nvme runs as cpu, warned).
  EXPECT_TRUE(c.sharding.offload_optimizer);
  EXPECT_TRUE(c.sharding.offload_params);
  expect_one_line_each(c, "ds.json");
  const std::vector<std::string> expected = {
      "fp16.loss_scale=128: static loss scales are not supported",
      "optimizer=\"AdamW\": not used: difftrain's own optimizer",
      "scheduler=\"WarmupLR\": not used: difftrain's own schedule",
      "steps_per_print=10: difftrain prints progress every --logging_steps",
      "zero_optimisation={\"stage\":2}: unknown key",
      "zero_optimization.offload_param.device=\"nvme\": NVMe offload is not supported: "
      "offloading to CPU memory instead",
      "zero_optimization.overlap_comm=true: no effect",
      "zero_optimization.contiguous_gradients=true: no effect",
      "zero_optimization.reduce_bucket_size=500000000: no effect",
      "zero_optimization.stage3_max_live_parameters=1000000000.0: ZeRO-3 tuning knob",
      "zero_optimization.stage3_gather_16bit_weights_on_model_save=true: difftrain always writes "
      "sharded checkpoints; `difftrain merge-weights`",
      "zero_optimization.stage3_new_knob=1: ZeRO-3 tuning knob",
      "zero_optimization.bucket_magic=3: unknown zero_optimization key",
      "train_batch_size=30: inconsistent: not a multiple of train_micro_batch_size_per_gpu 4 x "
      "gradient_accumulation_steps 2",
  };
  const std::string all = all_lines(c.warnings);
  EXPECT_EQ(c.warnings.size(), expected.size()) << all;
  for (const auto& e : expected) EXPECT_HAS(all, "ds.json: " + e);
  // A total without a per-process batch cannot be honoured either.
  const auto total_only = parse_deepspeed_config(R"({"train_batch_size": 32})", "t.json");
  ASSERT_EQ(total_only.warnings.size(), 1u);
  EXPECT_HAS(total_only.warnings[0], "t.json: train_batch_size=32: not used");
  // apex AMP.
  const auto amp = parse_deepspeed_config(R"({"amp": {"enabled": true}})", "t.json");
  ASSERT_EQ(amp.warnings.size(), 1u);
  EXPECT_HAS(amp.warnings[0], "apex AMP is not supported");
}

TEST(ShardingConfig, DeepSpeedBadValuesAreOneLineErrors) {
  auto error = [](const std::string& text) {
    const std::string e = error_of([&] { parse_deepspeed_config(text, "ds.json"); });
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    EXPECT_HAS(e, "DeepSpeed config ds.json: ");
    return e;
  };
  EXPECT_EQ(error(R"({"zero_optimization": {"stage": 4}})"),
            "DeepSpeed config ds.json: zero_optimization.stage is 4: expected 0, 1, 2 or 3 (ZeRO "
            "stage: 0 = DDP, 1 = optimizer state, 2 = + gradients, 3 = + parameters); fix the "
            "file");
  EXPECT_HAS(error(R"({"zero_optimization": {"stage": "3"}})"), "zero_optimization.stage is \"3\"");
  EXPECT_EQ(error(R"({"gradient_accumulation_steps": "two"})"),
            "DeepSpeed config ds.json: gradient_accumulation_steps is \"two\": expected a whole "
            "number >= 1 or \"auto\"; fix the file");
  EXPECT_HAS(error(R"({"train_micro_batch_size_per_gpu": 0})"),
             "train_micro_batch_size_per_gpu is 0: expected a whole number >= 1");
  EXPECT_HAS(error(R"({"gradient_clipping": -1})"), "gradient_clipping is -1: expected a number");
  EXPECT_HAS(error(R"({"fp16": {"enabled": "yes"}})"),
             "fp16.enabled is \"yes\": expected true, false or \"auto\"");
  EXPECT_HAS(error(R"({"fp16": {"enabled": true}, "bf16": {"enabled": true}})"),
             "fp16.enabled and bf16.enabled are both true");
  EXPECT_HAS(error(R"({"zero_optimization": {"offload_param": {"device": "disk"}}})"),
             "zero_optimization.offload_param.device is \"disk\"");
  EXPECT_HAS(error(R"({"zero_optimization": 3})"), "zero_optimization is 3: expected an object");
  EXPECT_HAS(error("{\"fp16\": {\"enabled\": true,}\n}"), "invalid JSON at byte");
  EXPECT_HAS(error("[1, 2]"), "expected a JSON object");
  EXPECT_HAS(error_of([] { difftrain::settings::read_deepspeed_config("/nonexistent/ds.json"); }),
             "DeepSpeed config /nonexistent/ds.json cannot be read: no such file");
}

// What `accelerate config` writes for FSDP (Accelerate 0.3x).
const char* kFsdpYaml = R"(compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: false
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: false
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_sharding_strategy: SHARD_GRAD_OP
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: ResnetBlock2D, Transformer2DModel
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 2
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
gradient_accumulation_steps: 3
)";

TEST(ShardingConfig, AccelerateFsdpYamlMapsKeyByKey) {
  const auto c = parse_accelerate_config(kFsdpYaml, "acc.yaml");
  EXPECT_TRUE(c.warnings.empty()) << all_lines(c.warnings);
  ASSERT_TRUE(c.sharding_set);
  EXPECT_EQ(c.sharding.strategy, ShardingStrategy::kShardGradOp);
  EXPECT_EQ(c.sharding.auto_wrap.policy, "TRANSFORMER_BASED_WRAP");
  EXPECT_EQ(c.sharding.auto_wrap.classes,
            (std::vector<std::string>{"ResnetBlock2D", "Transformer2DModel"}));
  EXPECT_FALSE(c.sharding.forward_prefetch);
  EXPECT_TRUE(c.sharding.backward_prefetch);
  EXPECT_EQ(c.mixed_precision.value_or("?"), "bf16");
  EXPECT_EQ(c.gradient_accumulation_steps.value_or(0), 3);
  EXPECT_FALSE(c.gradient_clipping.has_value());
}

TEST(ShardingConfig, AccelerateFsdpNumericStrategiesAndClassLists) {
  auto strategy = [](const std::string& value) {
    return parse_accelerate_config(
               "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: " + value + "\n",
               "a.yaml")
        .sharding.strategy;
  };
  EXPECT_EQ(strategy("1"), ShardingStrategy::kFullShard);
  EXPECT_EQ(strategy("2"), ShardingStrategy::kShardGradOp);
  EXPECT_EQ(strategy("3"), ShardingStrategy::kNoShard);
  EXPECT_EQ(strategy("FULL_SHARD"), ShardingStrategy::kFullShard);
  EXPECT_EQ(strategy("NO_SHARD"), ShardingStrategy::kNoShard);
  // Hybrid sharding has no machine split here: over all ranks, with a warning.
  const auto hybrid = parse_accelerate_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: HYBRID_SHARD_ZERO2\n",
      "a.yaml");
  EXPECT_EQ(hybrid.sharding.strategy, ShardingStrategy::kShardGradOp);
  ASSERT_EQ(hybrid.warnings.size(), 1u);
  EXPECT_HAS(hybrid.warnings[0], "a.yaml: fsdp_config.fsdp_sharding_strategy=HYBRID_SHARD_ZERO2");
  EXPECT_EQ(strategy("4"), ShardingStrategy::kFullShard);  // HYBRID_SHARD
  // FSDP without a section: Accelerate's default FULL_SHARD. FSDP2's reshard_after_forward.
  EXPECT_EQ(parse_accelerate_config("distributed_type: FSDP\n", "a").sharding.strategy,
            ShardingStrategy::kFullShard);
  EXPECT_EQ(parse_accelerate_config("distributed_type: FSDP\nfsdp_config:\n  fsdp_version: 2\n"
                                    "  fsdp_reshard_after_forward: false\n",
                                    "a")
                .sharding.strategy,
            ShardingStrategy::kShardGradOp);
  const auto list = parse_accelerate_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: size_based_wrap\n"
      "  fsdp_min_num_params: 2000\n  fsdp_backward_prefetch: NO_PREFETCH\n"
      "  fsdp_transformer_layer_cls_to_wrap: [DownBlock2D, 'UpBlock2D,UNetMidBlock2D']\n",
      "a.yaml");
  EXPECT_EQ(list.sharding.auto_wrap.policy, "SIZE_BASED_WRAP");
  EXPECT_EQ(list.sharding.auto_wrap.min_num_params, 2000);
  EXPECT_FALSE(list.sharding.backward_prefetch);
  EXPECT_EQ(list.sharding.auto_wrap.classes,
            (std::vector<std::string>{"DownBlock2D", "UpBlock2D", "UNetMidBlock2D"}));
  EXPECT_TRUE(list.warnings.empty()) << all_lines(list.warnings);
}

TEST(ShardingConfig, AccelerateFsdpWarnsWhatItCannotHonour) {
  const auto c = parse_accelerate_config(R"(distributed_type: FSDP
num_procesess: 2
fsdp_config:
  fsdp_offload_params: true
  fsdp_activation_checkpointing: true
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_cpu_ram_efficient_loading: true
  fsdp_sync_module_states: false
  fsdp_backward_prefetch: BACKWARD_POST
  fsdp_shard_everything: true
)",
                                         "acc.yaml");
  EXPECT_TRUE(c.sharding.offload_optimizer);  // FULL_SHARD, Accelerate's default: both
  EXPECT_TRUE(c.sharding.offload_params);
  expect_one_line_each(c, "acc.yaml");
  const std::vector<std::string> expected = {
      "num_procesess=2: unknown key",
      "fsdp_config.fsdp_activation_checkpointing=true: not applied: use `difftrain train "
      "--gradient_checkpointing`",
      "fsdp_config.fsdp_state_dict_type=FULL_STATE_DICT: difftrain always writes sharded "
      "checkpoints; `difftrain merge-weights` consolidates them",
      "fsdp_config.fsdp_cpu_ram_efficient_loading=true: not supported",
      "fsdp_config.fsdp_sync_module_states=false: rank 0's weights are always broadcast",
      "fsdp_config.fsdp_backward_prefetch=BACKWARD_POST: difftrain prefetches when a unit's "
      "backward begins",
      "fsdp_config.fsdp_shard_everything=true: unknown fsdp_config key",
  };
  const std::string all = all_lines(c.warnings);
  EXPECT_EQ(c.warnings.size(), expected.size()) << all;
  for (const auto& e : expected) EXPECT_HAS(all, "acc.yaml: " + e);
  EXPECT_TRUE(c.sharding.backward_prefetch);
  // An fsdp_config under another distributed_type is not used, and says so.
  const auto ddp = parse_accelerate_config(
      "distributed_type: MULTI_CPU\nfsdp_config:\n  fsdp_sharding_strategy: FULL_SHARD\n"
      "deepspeed_config: {}\n",
      "m.yaml");
  EXPECT_FALSE(ddp.sharding_set);
  ASSERT_EQ(ddp.warnings.size(), 1u) << all_lines(ddp.warnings);
  EXPECT_EQ(ddp.warnings[0],
            "m.yaml: fsdp_config is ignored because distributed_type is MULTI_CPU (set "
            "distributed_type: FSDP to use it)");
}

TEST(ShardingConfig, AccelerateDeepSpeedSectionAndRelativeConfigFile) {
  const auto inline_section = parse_accelerate_config(R"(distributed_type: DEEPSPEED
mixed_precision: fp16
deepspeed_config:
  gradient_accumulation_steps: 2
  gradient_clipping: 1.5
  offload_optimizer_device: cpu
  offload_param_device: none
  zero3_init_flag: false
  zero_stage: 1
  deepspeed_multinode_launcher: standard
)",
                                                      "ds.yaml");
  ASSERT_TRUE(inline_section.sharding_set);
  EXPECT_EQ(inline_section.sharding.strategy, ShardingStrategy::kShardOptimizer);
  EXPECT_EQ(inline_section.gradient_accumulation_steps.value_or(0), 2);
  EXPECT_DOUBLE_EQ(inline_section.gradient_clipping.value_or(0), 1.5);
  EXPECT_EQ(inline_section.mixed_precision.value_or("?"), "fp16");
  EXPECT_TRUE(inline_section.warnings.empty()) << all_lines(inline_section.warnings);
  EXPECT_TRUE(inline_section.sharding.offload_optimizer);
  EXPECT_FALSE(inline_section.sharding.offload_params);

  // deepspeed_config_file is relative to the YAML's folder, not the working directory.
  const auto dir = temp_dir("sharding_config_ds");
  std::filesystem::create_directories(dir + "/sub");
  std::ofstream(dir + "/sub/zero3.json")
      << R"({"zero_optimization": {"stage": 3}, "bf16": {"enabled": true},
            "train_micro_batch_size_per_gpu": 6, "optimizer": {"type": "Adam"}})";
  std::ofstream(dir + "/accelerate.yaml")
      << "distributed_type: DEEPSPEED\nnum_processes: 2\ndeepspeed_config:\n"
         "  deepspeed_config_file: sub/zero3.json\n  zero3_init_flag: true\n";
  const auto c = difftrain::settings::read_accelerate_config(dir + "/accelerate.yaml");
  ASSERT_TRUE(c.sharding_set);
  EXPECT_EQ(c.sharding.strategy, ShardingStrategy::kFullShard);
  EXPECT_EQ(c.mixed_precision.value_or("?"), "bf16");
  EXPECT_EQ(c.train_micro_batch_size_per_gpu.value_or(0), 6);
  const std::string all = all_lines(c.warnings);
  ASSERT_EQ(c.warnings.size(), 2u) << all;
  EXPECT_HAS(all, dir + "/sub/zero3.json: optimizer=\"Adam\": not used");
  EXPECT_HAS(all, dir + "/accelerate.yaml: deepspeed_config.zero3_init_flag=true: no zero.Init");
  // A missing file names the resolved path.
  std::ofstream(dir + "/missing.yaml")
      << "distributed_type: DEEPSPEED\ndeepspeed_config:\n  deepspeed_config_file: nope.json\n";
  EXPECT_HAS(error_of([&] { difftrain::settings::read_accelerate_config(dir + "/missing.yaml"); }),
             "DeepSpeed config " + dir + "/nope.json cannot be read");
}

TEST(ShardingConfig, AccelerateBadValuesAreOneLineErrors) {
  auto error = [](const std::string& yaml) {
    const std::string e = error_of([&] { parse_accelerate_config(yaml, "a.yaml"); });
    EXPECT_EQ(e.find('\n'), std::string::npos) << e;
    return e;
  };
  EXPECT_EQ(error("distributed_type: FSDP\nfsdp_config:\n  fsdp_auto_wrap_policy: LAYER_WRAP\n"),
            "Accelerate config a.yaml: fsdp_config.fsdp_auto_wrap_policy is 'LAYER_WRAP': "
            "expected TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP or NO_WRAP; fix the file");
  EXPECT_HAS(error("distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: 7\n"),
             "Accelerate config a.yaml: fsdp_config.fsdp_sharding_strategy: '7' is not a "
             "sharding strategy");
  EXPECT_HAS(error("distributed_type: DEEPSPEED\ndeepspeed_config:\n  zero_stage: 4\n"),
             "deepspeed_config.zero_stage is '4': expected 0, 1, 2 or 3");
  EXPECT_HAS(error("distributed_type: FSDP\nfsdp_config:\n  fsdp_min_num_params: lots\n"),
             "fsdp_config.fsdp_min_num_params is 'lots': expected a whole number >= 1");
  EXPECT_HAS(error("distributed_type: FSDP\nfsdp_config:\n  fsdp_forward_prefetch: maybe\n"),
             "fsdp_config.fsdp_forward_prefetch is 'maybe': expected true or false");
  EXPECT_HAS(error("mixed_precision: fp32\n"), "mixed_precision is 'fp32': expected no, fp16");
  EXPECT_HAS(error("distributed_type: FSDP\nfsdp_config: [1\n"),
             "Accelerate config a.yaml: line 3: invalid YAML");
}

TEST(ShardingConfig, ParseShardingStrategyNames) {
  EXPECT_EQ(parse_sharding_strategy("full_shard"), ShardingStrategy::kFullShard);
  EXPECT_EQ(parse_sharding_strategy("SHARD_OPTIMIZER"), ShardingStrategy::kShardOptimizer);
  EXPECT_EQ(parse_sharding_strategy("zero2"), ShardingStrategy::kShardGradOp);
  EXPECT_EQ(parse_sharding_strategy("ZERO0"), ShardingStrategy::kNoShard);
  EXPECT_EQ(parse_sharding_strategy("1"), ShardingStrategy::kFullShard);
  EXPECT_EQ(parse_sharding_strategy("3"), ShardingStrategy::kNoShard);
  EXPECT_STREQ(difftrain::accel::to_string(ShardingStrategy::kShardGradOp), "SHARD_GRAD_OP");
  EXPECT_HAS(error_of([] { parse_sharding_strategy("zero4", "--sharding_strategy"); }),
             "--sharding_strategy: 'zero4' is not a sharding strategy; use NO_SHARD");
}

// Sets or unsets the DIFFTRAIN_* sharding variables for one test and restores them after.
class ScopedShardingEnv {
 public:
  ScopedShardingEnv() {
    for (const auto& [name, value] : difftrain::settings::sharding_env(ShardingOptions{})) {
      const char* old = std::getenv(name.c_str());
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
    }
    saved_.emplace_back("DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP", std::nullopt);
    if (const char* old = std::getenv("DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP")) {
      saved_.back().second = old;
    }
    for (const auto& s : saved_) ::unsetenv(s.first.c_str());
  }
  ~ScopedShardingEnv() {
    for (const auto& [name, value] : saved_) {
      if (value) {
        ::setenv(name.c_str(), value->c_str(), 1);
      } else {
        ::unsetenv(name.c_str());
      }
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

TEST(ShardingConfig, ShardingEnvRoundTripsThroughFromEnv) {
  ScopedShardingEnv scope;
  ShardingOptions o;
  o.strategy = ShardingStrategy::kShardGradOp;
  o.auto_wrap.policy = "SIZE_BASED_WRAP";
  o.auto_wrap.classes = {"ResnetBlock2D", "DownBlock2D"};
  o.auto_wrap.min_num_params = 12345;
  o.forward_prefetch = false;
  o.backward_prefetch = false;
  o.sync_each_batch = true;
  o.offload_optimizer = true;
  const auto env = difftrain::settings::sharding_env(o);
  const std::vector<std::pair<std::string, std::string>> expected = {
      {"DIFFTRAIN_SHARDING_STRATEGY", "SHARD_GRAD_OP"},
      {"DIFFTRAIN_FSDP_AUTO_WRAP_POLICY", "SIZE_BASED_WRAP"},
      {"DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP", "ResnetBlock2D,DownBlock2D"},
      {"DIFFTRAIN_FSDP_MIN_NUM_PARAMS", "12345"},
      {"DIFFTRAIN_FSDP_FORWARD_PREFETCH", "false"},
      {"DIFFTRAIN_FSDP_BACKWARD_PREFETCH", "false"},
      {"DIFFTRAIN_SYNC_EACH_BATCH", "true"},
      {"DIFFTRAIN_OFFLOAD_OPTIMIZER_DEVICE", "cpu"},
      {"DIFFTRAIN_OFFLOAD_PARAM_DEVICE", "none"},
  };
  EXPECT_EQ(env, expected);

  // Unset: from_env returns the base unchanged.
  const ShardingOptions unchanged = ShardingOptions::from_env(o);
  EXPECT_EQ(unchanged.strategy, ShardingStrategy::kShardGradOp);
  EXPECT_EQ(ShardingOptions::from_env().strategy, ShardingStrategy::kNoShard);

  for (const auto& [name, value] : env) ::setenv(name.c_str(), value.c_str(), 1);
  const ShardingOptions back = ShardingOptions::from_env();
  EXPECT_EQ(back.strategy, o.strategy);
  EXPECT_EQ(back.auto_wrap.policy, o.auto_wrap.policy);
  EXPECT_EQ(back.auto_wrap.classes, o.auto_wrap.classes);
  EXPECT_EQ(back.auto_wrap.min_num_params, 12345);
  EXPECT_FALSE(back.forward_prefetch);
  EXPECT_FALSE(back.backward_prefetch);
  EXPECT_TRUE(back.sync_each_batch);
  EXPECT_TRUE(back.offload_optimizer);
  EXPECT_FALSE(back.offload_params);

  ::setenv("DIFFTRAIN_SHARDING_STRATEGY", "zero4", 1);
  EXPECT_HAS(error_of([] { ShardingOptions::from_env(); }),
             "DIFFTRAIN_SHARDING_STRATEGY: 'zero4' is not a sharding strategy");
  ::setenv("DIFFTRAIN_SHARDING_STRATEGY", "full_shard", 1);
  ::setenv("DIFFTRAIN_FSDP_MIN_NUM_PARAMS", "0", 1);
  EXPECT_HAS(error_of([] { ShardingOptions::from_env(); }),
             "DIFFTRAIN_FSDP_MIN_NUM_PARAMS='0' is not a positive number");
  ::setenv("DIFFTRAIN_FSDP_MIN_NUM_PARAMS", "7", 1);
  ::setenv("DIFFTRAIN_SYNC_EACH_BATCH", "perhaps", 1);
  EXPECT_HAS(error_of([] { ShardingOptions::from_env(); }),
             "DIFFTRAIN_SYNC_EACH_BATCH='perhaps' is not a boolean");
  ::setenv("DIFFTRAIN_SYNC_EACH_BATCH", "false", 1);
  ::setenv("DIFFTRAIN_OFFLOAD_PARAM_DEVICE", "nvme", 1);
  EXPECT_HAS(error_of([] { ShardingOptions::from_env(); }),
             "DIFFTRAIN_OFFLOAD_PARAM_DEVICE: 'nvme': NVMe offload is not supported; use cpu");
}

TEST(ShardingConfig, OffloadDevicesAndTheirCombinations) {
  using difftrain::settings::check_offload;
  using difftrain::settings::parse_offload_device;
  EXPECT_FALSE(parse_offload_device("none", "x"));
  EXPECT_FALSE(parse_offload_device("", "x"));
  EXPECT_TRUE(parse_offload_device("cpu", "x"));
  EXPECT_TRUE(parse_offload_device("CPU", "x"));
  EXPECT_HAS(error_of([] { parse_offload_device("gpu", "--offload_param_device"); }),
             "--offload_param_device: 'gpu' is not an offload device; use none or cpu");
  ShardingOptions o;
  o.offload_optimizer = true;
  EXPECT_HAS(error_of([&] { check_offload(o); }),
             "offload_optimizer_device cpu needs a sharding strategy (ZeRO stage 1-3)");
  for (auto s : {ShardingStrategy::kShardOptimizer, ShardingStrategy::kShardGradOp,
                 ShardingStrategy::kFullShard}) {
    o.strategy = s;
    EXPECT_NO_THROW(check_offload(o));
  }
  o.offload_params = true;
  EXPECT_NO_THROW(check_offload(o));  // FULL_SHARD
  o.strategy = ShardingStrategy::kShardGradOp;
  EXPECT_HAS(error_of([&] { check_offload(o); }),
             "offload_param_device cpu needs FULL_SHARD (ZeRO-3): under SHARD_GRAD_OP");
  o.strategy = ShardingStrategy::kFullShard;
  o.offload_optimizer = false;
  EXPECT_HAS(error_of([&] { check_offload(o); }),
             "offload_param_device cpu needs offload_optimizer_device cpu too");

  // DeepSpeed's old cpu_offload flag, and FSDP's offload_params per strategy.
  EXPECT_TRUE(parse_deepspeed_config(R"({"zero_optimization": {"stage": 2, "cpu_offload": true}})",
                                     "old.json")
                  .sharding.offload_optimizer);
  const auto zero2 = parse_accelerate_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: SHARD_GRAD_OP\n"
      "  fsdp_offload_params: true\n",
      "a.yaml");
  EXPECT_TRUE(zero2.sharding.offload_optimizer);
  EXPECT_FALSE(zero2.sharding.offload_params);  // the full parameters stay on the device
  EXPECT_TRUE(zero2.warnings.empty()) << all_lines(zero2.warnings);
  const auto none = parse_accelerate_config(
      "distributed_type: FSDP\nfsdp_config:\n  fsdp_sharding_strategy: NO_SHARD\n"
      "  fsdp_offload_params: true\n",
      "a.yaml");
  EXPECT_FALSE(none.sharding.offload_optimizer);
  ASSERT_EQ(none.warnings.size(), 1u);
  EXPECT_HAS(none.warnings[0], "fsdp_offload_params=true: offload needs a sharded strategy");
  const auto partial = parse_deepspeed_config(
      R"({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}})",
      "p.json");
  ASSERT_EQ(partial.warnings.size(), 1u);
  EXPECT_HAS(partial.warnings[0], "zero_optimization.offload_optimizer.ratio=0.3: no effect");
}

// Linear(4, 8): 40 parameters, Linear(8, 8): 72, Linear(8, 2): 18; 130 in all.
torch::nn::Sequential tiny_model() {
  return torch::nn::Sequential(torch::nn::Linear(4, 8), torch::nn::Linear(8, 8),
                               torch::nn::Linear(8, 2));
}

std::vector<std::string> names(const std::vector<difftrain::accel::UnitPlan>& units) {
  std::vector<std::string> out;
  for (const auto& u : units) out.push_back(u.name + ":" + std::to_string(u.numel));
  return out;
}

TEST(ShardingConfig, PlanUnitsOnATinySequential) {
  auto model = tiny_model();
  EXPECT_EQ(difftrain::accel::wrap_class_name(*model[0]), "Linear");

  AutoWrapPolicy size;
  size.policy = "SIZE_BASED_WRAP";
  size.min_num_params = 50;  // only the middle layer (72) reaches it
  const auto by_size = difftrain::accel::plan_units(*model, size);
  EXPECT_EQ(names(by_size), (std::vector<std::string>{"1:72", ":58"}));
  EXPECT_EQ(by_size[1].params,
            (std::vector<std::string>{"0.weight", "0.bias", "2.weight", "2.bias"}));
  EXPECT_EQ(by_size[1].module_class, "root");

  AutoWrapPolicy layers;
  layers.classes = {"Linear"};
  const auto by_class = difftrain::accel::plan_units(*model, layers);
  EXPECT_EQ(names(by_class), (std::vector<std::string>{"0:40", "1:72", "2:18"}));
  EXPECT_EQ(by_class[2].module_class, "Linear");
  EXPECT_EQ(by_class[2].params, (std::vector<std::string>{"2.weight", "2.bias"}));

  // Frozen parameters are in no unit.
  model[1]->as<torch::nn::Linear>()->bias.set_requires_grad(false);
  AutoWrapPolicy none;
  none.policy = "NO_WRAP";
  const auto whole = difftrain::accel::plan_units(*model, none);
  EXPECT_EQ(names(whole), (std::vector<std::string>{":122"}));
  EXPECT_EQ(whole[0].params.size(), 5u);

  AutoWrapPolicy typo;
  typo.classes = {"Linear", "Linaer"};
  EXPECT_HAS(error_of([&] { difftrain::accel::plan_units(*model, typo); }),
             "fsdp_transformer_layer_cls_to_wrap: class 'Linaer' matches no module");
  AutoWrapPolicy unknown;
  unknown.policy = "LAYER_WRAP";
  EXPECT_HAS(error_of([&] { difftrain::accel::plan_units(*model, unknown); }),
             "auto-wrap policy 'LAYER_WRAP' is not one of");
}

}  // namespace
