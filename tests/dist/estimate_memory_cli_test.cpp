// `difftrain estimate-memory` end to end: --json on a tiny UNet folder gives the library's numbers
// for the requested strategy and every other one; the table names every quantity; bad input exits
// 1 with a one-line message.

#include "subprocess.h"

#include "difftrain/models/unets/unet.h"
#include "difftrain/models/unets/unet_config.h"
#include "program_paths.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <set>

namespace difftrain::testing {
namespace {

const std::string kDifftrain = difftrain_test::difftrain_bin();
const std::string kUNet =
    std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/unet_cond";

int64_t numel_of_unet(const std::string& dir) {
  models::UNet unet(models::UNetConfig::load(dir + "/config.json"));
  int64_t n = 0;
  for (const auto& p : unet->parameters()) n += p.numel();
  return n;
}

TEST(EstimateMemoryCommand, JsonGivesEveryStrategyOfTheTinyUNet) {
  auto r = run({kDifftrain, "estimate-memory", "--model", kUNet, "--num_processes", "2",
                "--sharding_strategy", "FULL_SHARD", "--mixed_precision", "bf16", "--use_8bit_adam",
                "--batch_size", "2", "--json"},
               {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  nlohmann::json j;
  ASSERT_NO_THROW(j = nlohmann::json::parse(r.out)) << r.log();
  const int64_t P = numel_of_unet(kUNet);
  EXPECT_EQ(j.at("strategy"), "FULL_SHARD");
  EXPECT_EQ(j.at("num_processes"), 2);
  EXPECT_EQ(j.at("trainable_params").get<int64_t>(), P);
  EXPECT_EQ(j.at("frozen_param_bytes").get<int64_t>(), 0);
  const int64_t Sh = j.at("shard_params").get<int64_t>();
  EXPECT_GE(2 * Sh, P);
  EXPECT_EQ(j.at("padded_params").get<int64_t>(), 2 * Sh);
  EXPECT_EQ(j.at("param_bytes").get<int64_t>(), 4 * Sh);
  EXPECT_EQ(j.at("grad_bytes").get<int64_t>(), 4 * Sh);
  EXPECT_EQ(j.at("grad_peak_bytes").get<int64_t>(), 4 * Sh + 8 * Sh);
  EXPECT_LT(j.at("optimizer_bytes").get<int64_t>(), 8 * Sh);  // 8-bit moments
  EXPECT_GT(j.at("activation_bytes").get<int64_t>(), 0);
  EXPECT_EQ(j.at("activation_bytes").get<int64_t>() % 2, 0);  // batch 1 measured, times 2
  EXPECT_EQ(j.at("total_peak_bytes").get<int64_t>(),
            j.at("param_peak_bytes").get<int64_t>() + j.at("grad_peak_bytes").get<int64_t>() +
                j.at("optimizer_bytes").get<int64_t>() + j.at("frozen_param_bytes").get<int64_t>() +
                j.at("activation_bytes").get<int64_t>());
  EXPECT_EQ(j.at("num_units").get<size_t>(), j.at("units").size());
  EXPECT_GT(j.at("num_units").get<int64_t>(), 1);

  ASSERT_EQ(j.at("comparison").size(), 4u) << j.dump(2);
  std::set<std::string> strategies;
  for (const auto& row : j.at("comparison")) {
    strategies.insert(row.at("strategy").get<std::string>());
    EXPECT_EQ(row.at("activation_bytes"), j.at("activation_bytes"));
    if (row.at("strategy") == "NO_SHARD") {
      EXPECT_EQ(row.at("param_bytes").get<int64_t>(), 4 * P);
      EXPECT_GT(row.at("optimizer_bytes").get<int64_t>(), j.at("optimizer_bytes").get<int64_t>());
    }
    if (row.at("strategy") == "FULL_SHARD") {
      EXPECT_EQ(row.at("param_bytes"), j.at("param_bytes"));
    }
  }
  EXPECT_EQ(strategies,
            (std::set<std::string>{"NO_SHARD", "SHARD_OPTIMIZER", "SHARD_GRAD_OP", "FULL_SHARD"}));

  // LoRA: only the adapters train, the UNet is frozen; one process is NO_SHARD.
  r = run({kDifftrain, "estimate-memory", "--model", kUNet + "/config.json", "--lora", "--rank",
           "2", "--sharding_strategy", "SHARD_GRAD_OP", "--json"},
          {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("strategy"), "NO_SHARD");
  EXPECT_EQ(j.at("frozen_params").get<int64_t>(), P);
  EXPECT_GT(j.at("trainable_params").get<int64_t>(), 0);
  EXPECT_LT(j.at("trainable_params").get<int64_t>(), P / 10);
  EXPECT_EQ(j.at("comparison").size(), 1u);
  const int64_t frozen_fp32 = j.at("frozen_param_bytes").get<int64_t>();
  EXPECT_EQ(frozen_fp32, 4 * P);

  // Under bf16 the trainer holds the frozen base in bf16 (2 bytes), the adapters stay fp32.
  r = run({kDifftrain, "estimate-memory", "--model", kUNet + "/config.json", "--lora", "--rank",
           "2", "--mixed_precision", "bf16", "--json"},
          {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  j = nlohmann::json::parse(r.out);
  EXPECT_EQ(j.at("frozen_param_bytes").get<int64_t>(), 2 * P);
  EXPECT_EQ(j.at("param_bytes").get<int64_t>(), 4 * j.at("trainable_params").get<int64_t>());
}

TEST(EstimateMemoryCommand, TableNamesEveryQuantity) {
  auto r = run({kDifftrain, "estimate-memory", "--model", kUNet, "--num_processes", "4",
                "--sharding_strategy", "zero2", "--fsdp_auto_wrap_policy", "size_based_wrap",
                "--fsdp_min_num_params", "50000"},
               {}, 120);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  for (const char* text :
       {"SHARD_GRAD_OP on 4 processes", "parameter peak", "gradient peak", "optimizer state",
        "frozen weights", "activations (batch 1)", "total peak",
        "units: ", "Every strategy on 4 processes", "FULL_SHARD", "NO_SHARD"}) {
    EXPECT_NE(r.out.find(text), std::string::npos) << text << "\n" << r.log();
  }
}

TEST(EstimateMemoryCommand, BadInputIsOneLine) {
  struct Case {
    std::vector<std::string> args;
    std::string expected;
  };
  const std::vector<Case> cases = {
      {{"--model", "/nonexistent/unet"}, "/nonexistent/unet' does not exist"},
      {{"--model", kUNet, "--sharding_strategy", "ZERO9"}, "'ZERO9' is not a sharding strategy"},
      {{"--model", kUNet, "--num_processes", "0"}, "num_processes must be at least 1, got 0"},
      {{"--model", kUNet, "--num_processes", "2", "--fsdp_transformer_layer_cls_to_wrap",
        "NoSuchBlock"},
       "NoSuchBlock"},
  };
  for (const auto& c : cases) {
    std::vector<std::string> argv = {kDifftrain, "estimate-memory"};
    argv.insert(argv.end(), c.args.begin(), c.args.end());
    const auto r = run(argv, {}, 60);
    EXPECT_EQ(r.exit_code, 1) << r.log();
    EXPECT_NE(r.err.find("difftrain: error: "), std::string::npos) << r.log();
    EXPECT_NE(r.err.find(c.expected), std::string::npos) << r.log();
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.log();
    EXPECT_TRUE(r.out.empty()) << r.log();
  }
}

}  // namespace
}  // namespace difftrain::testing
