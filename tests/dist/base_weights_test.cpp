// `--base_weights_dtype int8` end to end: a FLUX.1 LoRA run on an 8-bit frozen base against the
// bf16 base on the same data and seeds (the loss curves, the frozen bytes of run_info), its LoRA
// loading in `difftrain sample` over the original base, the SD UNet (convolutions too), and the
// refusals.

#include "train_util.h"

#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>

namespace difftrain::testing {
namespace {

const std::string kBaseFlux =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";
const std::string kBaseSd = std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd";

std::vector<std::string> base_cmd(const std::string& model, const std::string& data,
                                  const std::string& out, std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--pretrained_model_name_or_path",
                                  model,
                                  "--dataset",
                                  "imagefolder",
                                  "--train_data_dir",
                                  data,
                                  "--resolution",
                                  "32",
                                  "--center_crop",
                                  "--lora",
                                  "--rank",
                                  "4",
                                  "--learning_rate",
                                  "1e-2",
                                  "--lr_scheduler",
                                  "constant",
                                  "--lr_warmup_steps",
                                  "0",
                                  "--use_ema",
                                  "false",
                                  "--num_validation_images",
                                  "0",
                                  "--logging_steps",
                                  "1",
                                  "--mixed_precision",
                                  "bf16",
                                  "--output_dir",
                                  out};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

int64_t frozen_bytes_of_run(const std::string& out) {
  const auto info = nlohmann::json::parse(std::ifstream(out + "/logs/run_info.rank0.json"));
  return info["state_bytes"]["frozen_param_bytes"].get<int64_t>();
}

TEST(BaseWeights, FluxLoraOnAnInt8BaseFollowsTheBf16Run) {
  const std::string dir = make_temp_dir("base_int8_flux");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  const std::vector<std::string> common = {
      "--max_train_steps", "30", "--max_sequence_length", "16", "--train_batch_size", "2"};
  auto dense = train(base_cmd(kBaseFlux, data, dir + "/bf16", common), 2, 600);
  ASSERT_EQ(dense.exit_code, 0) << dense.log();
  auto c = base_cmd(kBaseFlux, data, dir + "/int8", common);
  c.insert(c.end(), {"--base_weights_dtype", "int8"});
  auto q = train(c, 2, 600);
  ASSERT_EQ(q.exit_code, 0) << q.log();
  EXPECT_NE(q.err.find("frozen base in int8:"), std::string::npos) << q.log();

  const auto a = losses(dir + "/bf16"), b = losses(dir + "/int8");
  ASSERT_EQ(a.size(), 30u);
  ASSERT_EQ(b.size(), 30u);
  double worst = 0, mean_a = 0, mean_b = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    worst = std::max(worst, std::abs(a[i] - b[i]) / a[i]);
    mean_a += a[i] / 30;
    mean_b += b[i] / 30;
  }
  double last_a = 0, last_b = 0;
  for (size_t i = 20; i < 30; ++i) last_a += a[i] / 10, last_b += b[i] / 10;
  std::cout << "FLUX LoRA loss, bf16 base vs int8 base: mean " << mean_a << " vs " << mean_b
            << ", last 10 " << last_a << " vs " << last_b << ", largest per-step gap "
            << worst * 100 << " %\n";
  EXPECT_LE(std::abs(mean_b - mean_a) / mean_a, 0.05);
  EXPECT_LT(last_b, a.front());  // it trains

  // The frozen transformer base in 8 bits: fewer bytes in run_info (both runs hold the VAE in
  // bf16 and no text encoder, released after caching).
  const int64_t fa = frozen_bytes_of_run(dir + "/bf16"), fb = frozen_bytes_of_run(dir + "/int8");
  std::cout << "frozen bytes: bf16 base " << fa << ", int8 base " << fb << "\n";
  EXPECT_LT(fb, fa);

  // The LoRA is relative to the original base: `difftrain sample` merges it into the folder's
  // weights.
  auto s = run({kDifftrain, "sample", "--model", kBaseFlux, "--lora",
                dir + "/int8/pytorch_lora_weights.safetensors", "--prompt", "a red square picture",
                "--height", "32", "--width", "32", "--num_inference_steps", "2",
                "--max_sequence_length", "16", "--output", dir + "/s.png"},
               {}, 120);
  EXPECT_EQ(s.exit_code, 0) << s.log();
}

TEST(BaseWeights, SdUnetAndTextEncoderLoraOnAnInt8BaseAndTheRefusals) {
  const std::string dir = make_temp_dir("base_int8_sd");
  const std::string data = make_mixed_aspect_folder(dir + "/data");
  auto r = train(base_cmd(kBaseSd, data, dir + "/run",
                          {"--max_train_steps", "4", "--train_text_encoder", "--base_weights_dtype",
                           "int8", "--gradient_checkpointing"}));
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("frozen base in int8:"), std::string::npos) << r.log();
  for (double l : losses(dir + "/run")) EXPECT_TRUE(std::isfinite(l));
  EXPECT_TRUE(std::filesystem::exists(dir + "/run/pytorch_lora_weights.safetensors"));

  auto fc = base_cmd(kBaseSd, data, dir + "/full", {"--base_weights_dtype", "int8"});
  fc.erase(std::find(fc.begin(), fc.end(), "--lora"));
  fc.erase(std::find(fc.begin(), fc.end(), "--rank"),
           std::find(fc.begin(), fc.end(), "--rank") + 2);
  auto full = train(fc);
  EXPECT_NE(full.exit_code, 0);
  EXPECT_NE(full.err.find("add --lora"), std::string::npos) << full.log();
  auto c = base_cmd(kBaseSd, data, dir + "/bad", {"--base_weights_dtype", "int4"});
  auto bad = train(c);
  EXPECT_NE(bad.exit_code, 0);
  EXPECT_NE(bad.err.find("expected one of none, int8, fp8_e4m3"), std::string::npos) << bad.log();
}

}  // namespace
}  // namespace difftrain::testing
