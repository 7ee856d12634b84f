// `difftrain train --sharding_strategy` end to end in real processes under `difftrain launch`:
// FULL_SHARD gives NO_SHARD's weights, its checkpoint resumes on another number of ranks
// (re-sharded), `difftrain merge-weights` consolidates it into a folder `difftrain sample` loads,
// and run_info reports per-rank bytes that shrink with the world.

#include "train_util.h"

#include "difftrain/io/atomic_file.h"
#include "difftrain/io/sharded_tensors.h"

#include <nlohmann/json.hpp>

#include <filesystem>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

nlohmann::json state_bytes(const std::string& out, int rank) {
  std::ifstream in(out + "/logs/run_info.rank" + std::to_string(rank) + ".json");
  return nlohmann::json::parse(in).at("state_bytes");
}

// `difftrain estimate-memory --json` for the model a checkpoint holds.
nlohmann::json estimate(const std::string& model, int world, const std::string& strategy) {
  const auto r = run({kDifftrain, "estimate-memory", "--model", model, "--num_processes",
                      std::to_string(world), "--sharding_strategy", strategy, "--json"},
                     {}, 120);
  EXPECT_EQ(r.exit_code, 0) << r.log();
  return nlohmann::json::parse(r.out);
}

// The estimate is the measured state exactly between steps, and bounds the measured peaks.
void expect_estimate_matches(const nlohmann::json& est, const nlohmann::json& measured) {
  for (const char* key : {"param_bytes", "grad_bytes", "optimizer_bytes"}) {
    EXPECT_EQ(est.at(key).get<int64_t>(), measured.at(key).get<int64_t>()) << key;
  }
  for (const char* key : {"param_peak_bytes", "grad_peak_bytes"}) {
    EXPECT_LE(measured.at(key).get<int64_t>(), est.at(key).get<int64_t>()) << key;
  }
}

// Same global batch (12) on 2 and 3 ranks; 4 updates; a checkpoint at 2. Tolerance 1e-4 as in
// TrainCommand.TwoRanksEqualOneRankWithTheGlobalBatch (Adam magnifies summation-order rounding).
TEST(ShardedTraining, FullShardMatchesDdpAndResumesOnThreeRanks) {
  const auto dir = make_temp_dir("sharded_train");
  const std::vector<std::string> common = {"--max_train_steps",     "4", "--use_ema",       "false",
                                           "--checkpointing_steps", "2", "--max_grad_norm", "0.5"};
  auto ddp = train_cmd(dir, dir + "/ddp", common);
  ddp.insert(ddp.end(), {"--train_batch_size", "6"});
  auto fsdp = train_cmd(dir, dir + "/fsdp", common);
  fsdp.insert(fsdp.end(), {"--train_batch_size", "6", "--sharding_strategy", "FULL_SHARD"});
  const auto r1 = train(ddp, 2);
  ASSERT_EQ(r1.exit_code, 0) << r1.log();
  const auto r2 = train(fsdp, 2);
  ASSERT_EQ(r2.exit_code, 0) << r2.log();
  const double same = max_abs_diff(unet_weights(dir + "/ddp"), unet_weights(dir + "/fsdp"));
  std::printf("FULL_SHARD vs NO_SHARD on 2 ranks: max abs diff %.3g (tol 1e-4)\n", same);
  EXPECT_LT(same, 1e-4);
  ASSERT_TRUE(fs::exists(dir + "/fsdp/checkpoint-2/model.index.json"))
      << "a FULL_SHARD checkpoint is written as per-rank shards plus an index";

  // Resume the 2-rank FULL_SHARD checkpoint on 3 ranks (4 per rank: the same global batch).
  fs::create_directories(dir + "/resumed");
  fs::copy(dir + "/fsdp/checkpoint-2", dir + "/resumed/checkpoint-2", fs::copy_options::recursive);
  auto resumed = train_cmd(dir, dir + "/resumed", common);
  resumed.insert(resumed.end(), {"--train_batch_size", "4", "--sharding_strategy", "FULL_SHARD",
                                 "--resume_from_checkpoint", "latest"});
  const auto r3 = train(resumed, 3);
  ASSERT_EQ(r3.exit_code, 0) << r3.log();
  const double reshard = max_abs_diff(unet_weights(dir + "/ddp"), unet_weights(dir + "/resumed"));
  std::printf("saved on 2 ranks, resumed on 3: max abs diff %.3g from the 2-rank run (tol 1e-4)\n",
              reshard);
  EXPECT_LT(reshard, 1e-4);

  // merge-weights: the final sharded checkpoint becomes the exported UNet, exactly.
  const auto merged = dir + "/merged";
  const auto m = run({kDifftrain, "merge-weights", dir + "/resumed/checkpoint-4", merged}, {}, 120);
  ASSERT_EQ(m.exit_code, 0) << m.log();
  const auto merged_weights =
      io::load_safetensors(merged + "/diffusion_pytorch_model.safetensors").tensors;
  EXPECT_EQ(max_abs_diff(unet_weights(dir + "/resumed"), merged_weights), 0.0);
  const auto s = run({kDifftrain, "sample", "--model", merged, "--num_images", "2",
                      "--num_inference_steps", "3", "--class_labels", "0,1", "--output",
                      merged + "/grid.png", "--save_tensors", merged + "/samples.safetensors"},
                     {}, 120);
  ASSERT_EQ(s.exit_code, 0) << s.log();
  EXPECT_TRUE(fs::exists(merged + "/grid.png"));

  // Memory per rank: FULL_SHARD holds 1/N of NO_SHARD's parameters, gradients and optimizer
  // state between steps (+ padding: < N elements per unit), on 2 and on 3 ranks.
  const auto none = state_bytes(dir + "/ddp", 0);
  for (const auto& [out, world] :
       {std::pair<std::string, int>{dir + "/fsdp", 2}, {dir + "/resumed", 3}}) {
    for (int r = 0; r < world; ++r) {
      const auto b = state_bytes(out, r);
      const int64_t padding = 64 * world * 4;
      std::printf("rank %d/%d: params %lld (NO_SHARD %lld), grads %lld, optimizer %lld (%lld)\n", r,
                  world, static_cast<long long>(b["param_bytes"].get<int64_t>()),
                  static_cast<long long>(none["param_bytes"].get<int64_t>()),
                  static_cast<long long>(b["grad_bytes"].get<int64_t>()),
                  static_cast<long long>(b["optimizer_bytes"].get<int64_t>()),
                  static_cast<long long>(none["optimizer_bytes"].get<int64_t>()));
      EXPECT_LE(b["param_bytes"].get<int64_t>(),
                none["param_bytes"].get<int64_t>() / world + padding);
      EXPECT_LE(b["grad_bytes"].get<int64_t>(),
                none["grad_bytes"].get<int64_t>() / world + padding);
      EXPECT_LE(b["optimizer_bytes"].get<int64_t>(),
                none["optimizer_bytes"].get<int64_t>() / world + 2 * padding);
      EXPECT_LT(b["param_peak_bytes"].get<int64_t>(), none["param_bytes"].get<int64_t>());
    }
    expect_estimate_matches(estimate(merged, world, "FULL_SHARD"), state_bytes(out, 0));
  }
  expect_estimate_matches(estimate(merged, 2, "NO_SHARD"), none);
}

// Prodigy's step-size estimate sums over every parameter: under FULL_SHARD each rank holds a
// shard and the two sums are added across the ranks, so the run follows NO_SHARD's; its state
// (s, p0, moments, d) re-shards to 3 ranks and continues. A straight run and one interrupted and
// resumed on the same ranks are equal bit for bit.
TEST(ShardedTraining, ProdigyUnderFullShardFollowsNoShardAndResumesResharded) {
  const auto dir = make_temp_dir("sharded_prodigy");
  const std::vector<std::string> common = {
      "--max_train_steps",          "4",     "--use_ema",          "false",
      "--checkpointing_steps",      "2",     "--optimizer",        "prodigy",
      "--prodigy_safeguard_warmup", "false", "--learning_rate",    "1.0",
      "--lr_warmup_steps",          "0",     "--train_batch_size", "6"};
  const auto r1 = train(train_cmd(dir, dir + "/ddp", common), 2);
  ASSERT_EQ(r1.exit_code, 0) << r1.log();
  auto fsdp = train_cmd(dir, dir + "/fsdp", common);
  fsdp.insert(fsdp.end(), {"--sharding_strategy", "FULL_SHARD"});
  const auto r2 = train(fsdp, 2);
  ASSERT_EQ(r2.exit_code, 0) << r2.log();
  const double same = max_abs_diff(unet_weights(dir + "/ddp"), unet_weights(dir + "/fsdp"));
  std::printf("Prodigy FULL_SHARD vs NO_SHARD on 2 ranks: max abs diff %.3g (tol 1e-4)\n", same);
  EXPECT_LT(same, 1e-4);
  // One estimate on every rank, from sums over the whole model: the sharded run's d̂ and
  // numerator are the unsharded run's (a shard's own sums would differ: half the parameters).
  const auto unsharded_json =
      nlohmann::json::parse(io::read_file(dir + "/ddp/checkpoint-4/optimizer.json"))["prodigy"];
  const auto sharded_json = nlohmann::json::parse(io::read_file(
      dir + "/fsdp/checkpoint-4/optimizer.index.json"))["metadata"]["optimizer"]["prodigy"];
  for (const char* key : {"d", "d_hat", "d_numerator"}) {
    const double a = unsharded_json.at(key).get<double>(), b = sharded_json.at(key).get<double>();
    EXPECT_NEAR(b / a, 1.0, 1e-4) << key << ": " << a << " vs " << b;
  }
  // Prodigy's s and p0 are saved element by element in the units' numbering (re-shardable).
  const io::ShardedTensorReader opt_state(dir + "/fsdp/checkpoint-2", "optimizer");
  int with_s = 0, with_p0 = 0;
  for (const auto& name : opt_state.names()) {
    with_s += name.size() > 2 && name.compare(name.size() - 2, 2, ".s") == 0;
    with_p0 += name.size() > 3 && name.compare(name.size() - 3, 3, ".p0") == 0;
  }
  EXPECT_GT(with_s, 0);
  EXPECT_EQ(with_s, with_p0);

  fs::create_directories(dir + "/resumed");
  fs::copy(dir + "/fsdp/checkpoint-2", dir + "/resumed/checkpoint-2", fs::copy_options::recursive);
  auto resumed = train_cmd(dir, dir + "/resumed", common);
  resumed.erase(resumed.end() - 2, resumed.end());  // --train_batch_size 6
  resumed.insert(resumed.end(), {"--train_batch_size", "4", "--sharding_strategy", "FULL_SHARD",
                                 "--resume_from_checkpoint", "latest"});
  const auto r3 = train(resumed, 3);
  ASSERT_EQ(r3.exit_code, 0) << r3.log();
  const double reshard = max_abs_diff(unet_weights(dir + "/fsdp"), unet_weights(dir + "/resumed"));
  std::printf("Prodigy saved on 2 ranks, resumed on 3: max abs diff %.3g (tol 1e-4)\n", reshard);
  EXPECT_LT(reshard, 1e-4);

  // NO_SHARD interrupted at 2 and resumed on the same 2 ranks: bit for bit.
  fs::create_directories(dir + "/again");
  fs::copy(dir + "/ddp/checkpoint-2", dir + "/again/checkpoint-2", fs::copy_options::recursive);
  auto again = train_cmd(dir, dir + "/again", common);
  again.insert(again.end(), {"--resume_from_checkpoint", "latest"});
  const auto r4 = train(again, 2);
  ASSERT_EQ(r4.exit_code, 0) << r4.log();
  EXPECT_EQ(max_abs_diff(unet_weights(dir + "/ddp"), unet_weights(dir + "/again")), 0.0);
}

TEST(ShardedTraining, ShardOptimizerThroughTheLauncherAndRefusedCrossings) {
  const auto dir = make_temp_dir("sharded_launch");
  const std::vector<std::string> common = {
      "--max_train_steps",     "2", "--use_ema",          "true",
      "--checkpointing_steps", "2", "--train_batch_size", "4"};
  // The launcher passes --sharding_strategy to the ranks (as Accelerate's FSDP config would).
  std::vector<std::string> argv = {
      kDifftrain,        "launch",  "--num_processes", "2", "--sharding_strategy",
      "SHARD_OPTIMIZER", kDifftrain};
  const auto cmd = train_cmd(dir, dir + "/zero1", common);
  argv.insert(argv.end(), cmd.begin(), cmd.end());
  const auto r = run(argv, {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.log().find("sharding SHARD_OPTIMIZER"), std::string::npos) << r.log();
  EXPECT_GT(state_bytes(dir + "/zero1", 1).at("optimizer_bytes").get<int64_t>(), 0);
  nlohmann::json info;
  {
    std::ifstream in(dir + "/zero1/logs/run_info.rank1.json");
    info = nlohmann::json::parse(in);
  }
  EXPECT_EQ(info.at("sharding"), "SHARD_OPTIMIZER");
  // SHARD_OPTIMIZER keeps 1/N of the optimizer state (+ padding), as estimate-memory predicts.
  const auto est = estimate(dir + "/zero1/checkpoint-2", 2, "SHARD_OPTIMIZER");
  expect_estimate_matches(est, state_bytes(dir + "/zero1", 1));
  int64_t none_optimizer = 0;
  for (const auto& row : est.at("comparison"))
    if (row.at("strategy") == "NO_SHARD") none_optimizer = row.at("optimizer_bytes").get<int64_t>();
  ASSERT_GT(none_optimizer, 0);
  EXPECT_LE(state_bytes(dir + "/zero1", 1).at("optimizer_bytes").get<int64_t>(),
            none_optimizer / 2 + 64 * 2 * 8);
  // Sharded optimizer state cannot resume unsharded: a one-line error, before training.
  auto plain = train_cmd(dir, dir + "/zero1",
                         {"--max_train_steps", "4", "--use_ema", "true", "--train_batch_size", "4",
                          "--resume_from_checkpoint", "latest"});
  const auto bad = train(plain, 2);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.log().find("holds sharded optimizer state"), std::string::npos) << bad.log();
}

}  // namespace
}  // namespace difftrain::testing

namespace difftrain::testing {
namespace {

// LoRA through the trainer: only the adapters are prepared, so only they are sharded; the export
// equals NO_SHARD's (same tolerance as above) and the sharded checkpoint resumes.
TEST(ShardedTraining, LoraFineTuningUnderFullShard) {
  const auto dir = make_temp_dir("sharded_lora");
  const auto base = train(train_cmd(dir, dir + "/base",
                                    {"--max_train_steps", "2", "--train_batch_size", "4",
                                     "--checkpointing_steps", "0", "--use_ema", "false"}));
  ASSERT_EQ(base.exit_code, 0) << base.log();
  auto lora = [&](const std::string& out, const std::string& strategy, const std::string& batch) {
    return std::vector<std::string>{"train",
                                    "--pretrained_model_name_or_path",
                                    dir + "/base",
                                    "--lora",
                                    "--rank",
                                    "2",
                                    "--lr_warmup_steps",
                                    "0",
                                    "--max_train_steps",
                                    "3",
                                    "--train_batch_size",
                                    batch,
                                    "--checkpointing_steps",
                                    "2",
                                    "--learning_rate",
                                    "1e-2",
                                    "--resolution",
                                    "8",
                                    "--max_train_samples",
                                    "64",
                                    "--num_validation_images",
                                    "0",
                                    "--use_ema",
                                    "false",
                                    "--sharding_strategy",
                                    strategy,
                                    "--output_dir",
                                    out,
                                    "--resume_from_checkpoint",
                                    "latest"};
  };
  const auto r1 = train(lora(dir + "/ddp", "NO_SHARD", "6"), 2);
  ASSERT_EQ(r1.exit_code, 0) << r1.log();
  const auto r2 = train(lora(dir + "/fsdp", "FULL_SHARD", "6"), 2);
  ASSERT_EQ(r2.exit_code, 0) << r2.log();
  // The 2-rank FULL_SHARD adapters' checkpoint, resumed on 3 ranks (the same global batch of 12).
  fs::create_directories(dir + "/resumed");
  fs::copy(dir + "/fsdp/checkpoint-2", dir + "/resumed/checkpoint-2", fs::copy_options::recursive);
  const auto resumed = lora(dir + "/resumed", "FULL_SHARD", "4");
  const auto r3 = train(resumed, 3);
  ASSERT_EQ(r3.exit_code, 0) << r3.log();
  auto weights = [&](const std::string& out) {
    return io::load_safetensors(out + "/pytorch_lora_weights.safetensors").tensors;
  };
  const double same = max_abs_diff(weights(dir + "/ddp"), weights(dir + "/fsdp"));
  const double reshard = max_abs_diff(weights(dir + "/ddp"), weights(dir + "/resumed"));
  std::printf(
      "LoRA FULL_SHARD vs NO_SHARD: max abs diff %.3g; resumed on 3 ranks: %.3g (tol 1e-4)\n", same,
      reshard);
  EXPECT_LT(same, 1e-4);
  EXPECT_LT(reshard, 1e-4);
}

}  // namespace
}  // namespace difftrain::testing
