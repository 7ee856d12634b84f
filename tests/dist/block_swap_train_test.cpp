// --blocks_to_swap through `difftrain train` on the tiny FLUX.1 folder: a 2-rank ZeRO-2 LoRA
// run over an int8 base with gradient checkpointing gives the same losses and the same LoRA file,
// bit for bit, with and without the swap; run_info.json's measured bytes equal what
// `difftrain estimate-memory --blocks_to_swap` counts; the same for Z-Image, Qwen-Image and Wan
// on 1 rank.

#include "train_util.h"

#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <iostream>

namespace difftrain::testing {
namespace {

const std::string kSwapFlux =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";

std::vector<std::string> swap_train_cmd(const std::string& data, const std::string& out,
                                        const std::string& blocks) {
  return {"train",
          "--pretrained_model_name_or_path",
          kSwapFlux,
          "--dataset",
          "imagefolder",
          "--train_data_dir",
          data,
          "--resolution",
          "32",
          "--resolution_buckets",
          "--bucket_step",
          "16",
          "--lora",
          "--rank",
          "4",
          "--max_sequence_length",
          "16",
          "--learning_rate",
          "1e-2",
          "--lr_scheduler",
          "constant",
          "--max_train_steps",
          "3",
          "--train_batch_size",
          "1",
          "--num_validation_images",
          "0",
          "--logging_steps",
          "1",
          "--gradient_checkpointing",
          "--base_weights_dtype",
          "int8",
          "--sharding_strategy",
          "SHARD_GRAD_OP",
          "--blocks_to_swap",
          blocks,
          "--output_dir",
          out};
}

TEST(BlockSwapTrain, ShardedLoraIsBitIdenticalAndSavesWhatTheEstimateSays) {
  const std::string dir = make_temp_dir("block_swap");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto plain = train(swap_train_cmd(data, dir + "/plain", "0"), 2, 600);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  auto swapped = train(swap_train_cmd(data, dir + "/swap", "2"), 2, 600);
  ASSERT_EQ(swapped.exit_code, 0) << swapped.log();
  EXPECT_NE(swapped.log().find("block swap: 3 block(s) in host memory"), std::string::npos)
      << swapped.log();

  const auto a = losses(dir + "/plain"), b = losses(dir + "/swap");
  ASSERT_EQ(a.size(), 3u);
  EXPECT_EQ(a, b) << "losses differ with the swap";
  const std::string file = "/pytorch_lora_weights.safetensors";
  const auto wa = io::load_safetensors(dir + "/plain" + file).tensors;
  const auto wb = io::load_safetensors(dir + "/swap" + file).tensors;
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [key, t] : wa) EXPECT_TRUE(torch::equal(t, wb.at(key))) << key;
  std::cout << "LoRA with and without --blocks_to_swap 2: max abs " << max_abs_diff(wa, wb)
            << " (0)\n";

  // Measured (run_info.json) against counted (estimate-memory), bytes for bytes.
  auto est = run({kDifftrain, "estimate-memory", "--model", kSwapFlux, "--lora", "--rank", "4",
                  "--base_weights_dtype", "int8", "--blocks_to_swap", "2", "--resolution", "4",
                  "--encoder_sequence_length", "4", "--json"},
                 {}, 300);
  ASSERT_EQ(est.exit_code, 0) << est.log();
  const auto e = nlohmann::json::parse(est.out);
  EXPECT_GT(e.at("block_swap_saved_bytes").get<int64_t>(), 0);
  for (const char* rank : {"0", "1"}) {
    std::ifstream in(dir + "/swap/logs/run_info.rank" + std::string(rank) + ".json");
    ASSERT_TRUE(in) << "no run_info for rank " << rank;
    const auto info = nlohmann::json::parse(in);
    ASSERT_TRUE(info.contains("block_swap")) << info.dump(2);
    const auto& s = info["block_swap"];
    std::cout << "rank " << rank << " block swap: " << s.dump() << "\n";
    EXPECT_EQ(s["blocks"].get<int64_t>(), 3);
    EXPECT_EQ(s["saved_device_bytes"].get<int64_t>(),
              s["host_bytes"].get<int64_t>() - s["staging_bytes"].get<int64_t>());
    EXPECT_EQ(e.at("block_swap_host_bytes").get<int64_t>(), s["host_bytes"].get<int64_t>());
    EXPECT_EQ(e.at("block_swap_saved_bytes").get<int64_t>(),
              s["saved_device_bytes"].get<int64_t>());
  }
  EXPECT_EQ(plain.log().find("block swap:"), std::string::npos);
}

// The one-stack transformers (musubi-tuner's choice: the last N blocks): a 1-rank bf16 LoRA run
// with gradient checkpointing on each tiny folder, the same bits with --blocks_to_swap 1 of its 2
// blocks, and run_info.json's bytes equal to estimate-memory's.
class BlockSwapFamilies : public ::testing::TestWithParam<std::string> {};

TEST_P(BlockSwapFamilies, LoraIsBitIdenticalAndSavesWhatTheEstimateSays) {
  const std::string model =
      std::string(difftrain_test::source_dir()) + "/tests/golden/" + GetParam();
  const std::string dir = make_temp_dir("block_swap_family");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  const auto cmd = [&](const std::string& out, const std::string& blocks) {
    return folder_train_cmd(model, data, out,
                            {"--resolution",
                             "32",
                             "--center_crop",
                             "--lora",
                             "--rank",
                             "4",
                             "--max_sequence_length",
                             "32",
                             "--learning_rate",
                             "1e-2",
                             "--max_train_steps",
                             "2",
                             "--train_batch_size",
                             "1",
                             "--num_validation_images",
                             "0",
                             "--logging_steps",
                             "1",
                             "--gradient_checkpointing",
                             "--mixed_precision",
                             "bf16",
                             "--blocks_to_swap",
                             blocks,
                             "--cache_dir",
                             dir + "/cache"});
  };
  auto plain = train(cmd(dir + "/plain", "0"), 1, 600);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  auto swapped = train(cmd(dir + "/swap", "1"), 1, 600);
  ASSERT_EQ(swapped.exit_code, 0) << swapped.log();
  EXPECT_NE(swapped.log().find("block swap: 1 block(s) in host memory"), std::string::npos)
      << swapped.log();
  const auto a = losses(dir + "/plain"), b = losses(dir + "/swap");
  ASSERT_EQ(a.size(), 2u);
  EXPECT_EQ(a, b) << "losses differ with the swap";
  const std::string file = "/pytorch_lora_weights.safetensors";
  const auto wa = io::load_safetensors(dir + "/plain" + file).tensors;
  const auto wb = io::load_safetensors(dir + "/swap" + file).tensors;
  ASSERT_EQ(wa.size(), wb.size());
  for (const auto& [key, t] : wa) EXPECT_TRUE(torch::equal(t, wb.at(key))) << key;

  std::vector<std::string> estimate = {
      kDifftrain, "estimate-memory",  "--model", model,
      "--lora",   "--rank",           "4",       "--mixed_precision",
      "bf16",     "--blocks_to_swap", "1",       "--json"};
  if (GetParam().rfind("wan/", 0) == 0) {  // a video family sizes clips
    estimate.insert(estimate.end(), {"--num_frames", "1", "--height", "32", "--width", "32"});
  } else {
    estimate.insert(estimate.end(), {"--resolution", "32", "--encoder_sequence_length", "8"});
  }
  auto est = run(estimate, {}, 300);
  ASSERT_EQ(est.exit_code, 0) << est.log();
  const auto e = nlohmann::json::parse(est.out);
  std::ifstream in(dir + "/swap/logs/run_info.rank0.json");
  ASSERT_TRUE(in) << "no run_info";
  const auto info = nlohmann::json::parse(in);
  ASSERT_TRUE(info.contains("block_swap")) << info.dump(2);
  const auto& s = info["block_swap"];
  std::cout << GetParam() << " block swap: " << s.dump() << "\n";
  EXPECT_EQ(s["blocks"].get<int64_t>(), 1);
  EXPECT_GT(s["host_bytes"].get<int64_t>(), 0);
  EXPECT_EQ(e.at("block_swap_host_bytes").get<int64_t>(), s["host_bytes"].get<int64_t>());
  EXPECT_EQ(e.at("block_swap_saved_bytes").get<int64_t>(), s["saved_device_bytes"].get<int64_t>());
  // Too many blocks is one line naming the count.
  auto many = train(cmd(dir + "/many", "2"), 1, 600);
  EXPECT_NE(many.exit_code, 0);
  EXPECT_NE(many.err.find("--blocks_to_swap 2 is too many for this transformer: it has 2 "
                          "blocks, and at least one stays on the device; use --blocks_to_swap 1 "
                          "or fewer"),
            std::string::npos)
      << many.log();
}

INSTANTIATE_TEST_SUITE_P(OneStack, BlockSwapFamilies,
                         ::testing::Values("z_image/tiny_z_image", "qwen_image/tiny_qwen_image",
                                           "wan/tiny_wan"),
                         [](const ::testing::TestParamInfo<std::string>& i) {
                           return i.param.substr(0, i.param.find('/'));
                         });

}  // namespace
}  // namespace difftrain::testing
