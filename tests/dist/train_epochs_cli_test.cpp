// `difftrain train`'s epoch cadences end to end on 2 ranks: kohya's --save_every_n_epochs and
// --save_last_n_epochs (epoch-<e>/ pipeline folders with their checkpoints) and Diffusers'
// --validation_epochs, uninterrupted and resumed inside an epoch. The tiny 8x8 UNet on 16
// Fashion-MNIST images in global batches of 8: an epoch is 2 updates.

#include "subprocess.h"
#include "train_util.h"

#include "difftrain/io/safetensors.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <vector>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

std::set<std::string> names_starting(const std::string& dir, const std::string& prefix) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) names.insert(name);
  }
  return names;
}

std::vector<std::string> epochs_cmd(const std::string& dir, const std::string& out,
                                    std::vector<std::string> extra) {
  auto cmd = train_cmd(
      dir, out,
      {"--max_train_samples", "16", "--train_batch_size", "4", "--lr_scheduler", "constant",
       "--lr_warmup_steps", "0", "--num_train_epochs", "4", "--validation_inference_steps", "2"});
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

TEST(TrainEpochs, EpochSavesAndValidationsKeepTheirCadenceAcrossAResume) {
  const auto dir = make_temp_dir("train_epochs");
  const std::vector<std::string> cadence = {
      "--save_every_n_epochs", "1", "--save_last_n_epochs",    "2",
      "--validation_epochs",   "2", "--num_validation_images", "2"};
  const auto whole = train(epochs_cmd(dir, dir + "/whole", cadence), 2);
  ASSERT_EQ(whole.exit_code, 0) << whole.log();
  const std::string out = dir + "/whole";
  // Epochs 1-3 saved (steps 2, 4, 6; epoch 4 is the run's end), the oldest pruned with the
  // checkpoint it made; --checkpointing_steps' default is off beside the epoch cadence.
  EXPECT_EQ(names_starting(out, "epoch-"), (std::set<std::string>{"epoch-000002", "epoch-000003"}));
  EXPECT_EQ(names_starting(out, "checkpoint-"),
            (std::set<std::string>{"checkpoint-4", "checkpoint-6", "checkpoint-8"}));
  for (const char* e : {"/epoch-000002", "/epoch-000003"}) {
    EXPECT_TRUE(fs::exists(out + e + "/model_index.json")) << e;
    EXPECT_TRUE(fs::exists(out + e + "/unet/diffusion_pytorch_model.safetensors")) << e;
  }
  const auto meta = nlohmann::json::parse(std::ifstream(out + "/epoch-000003/epoch.json"));
  EXPECT_EQ(meta.at("global_step"), 6);
  EXPECT_EQ(meta.at("owns_checkpoint"), true);
  // Diffusers counts epochs from 0: after epochs 0 and 2 (steps 2 and 6), and the final render.
  EXPECT_EQ(names_starting(out + "/samples", "step-"),
            (std::set<std::string>{"step-000002.png", "step-000006.png", "step-000008.png"}));
  // An epoch save is a DDPMPipeline folder that `difftrain sample` loads.
  const auto s =
      run({kDifftrain, "sample", "--model", out + "/epoch-000002", "--num_inference_steps", "2",
           "--num_images", "1", "--class_labels", "0", "--output", dir + "/s.png"});
  EXPECT_EQ(s.exit_code, 0) << s.log();

  // Stopped inside epoch 2, then resumed: the same saves and renders, the same weights.
  auto first = epochs_cmd(dir, dir + "/split", cadence);
  first.insert(first.end(), {"--max_train_steps", "3"});
  const auto a = train(first, 2);
  ASSERT_EQ(a.exit_code, 0) << a.log();
  auto second = epochs_cmd(dir, dir + "/split", cadence);
  second.insert(second.end(), {"--resume_from_checkpoint", "latest"});
  const auto b = train(second, 2);
  ASSERT_EQ(b.exit_code, 0) << b.log();
  const std::string split = dir + "/split";
  EXPECT_EQ(names_starting(split, "epoch-"),
            (std::set<std::string>{"epoch-000002", "epoch-000003"}));
  EXPECT_TRUE(fs::exists(split + "/samples/step-000006.png"));
  EXPECT_FALSE(fs::exists(split + "/samples/step-000004.png"));
  EXPECT_FALSE(fs::exists(split + "/checkpoint-2")) << "pruned with the first run's epoch-000001";
  for (const std::string folder : {"", "/epoch-000003"}) {
    const double diff = max_abs_diff(unet_weights(out + folder), unet_weights(split + folder));
    std::printf("uninterrupted vs resumed at step 3, %s: max abs diff %.3g (must be 0)\n",
                folder.empty() ? "final export" : folder.c_str() + 1, diff);
    EXPECT_EQ(diff, 0.0) << folder;
  }

  // The epoch saves leave training as it was: the same final weights without them.
  const auto plain = train(epochs_cmd(dir, dir + "/plain", {"--num_validation_images", "2"}), 2);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  EXPECT_EQ(max_abs_diff(unet_weights(out), unet_weights(dir + "/plain")), 0.0);
}

}  // namespace
}  // namespace difftrain::testing
