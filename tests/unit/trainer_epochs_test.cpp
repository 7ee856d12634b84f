// The epoch cadences of the Trainer (kohya's --save_every_n_epochs / --save_last_n_epochs,
// Diffusers' --validation_epochs) on the fake regression task (fake_task.h): 48 examples in
// batches of 8, so an epoch is 6 updates and epoch e (1-based) ends at step 6 e.
#include "difftrain/train/trainer.h"

#include "difftrain/io/atomic_file.h"
#include "difftrain/io/safetensors.h"
#include "fake_task.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <set>
#include <string>
#include <vector>

namespace difftrain::test {
namespace {
namespace fs = std::filesystem;

train::TrainerOptions epochs_options(const std::string& dir, int64_t epochs) {
  auto o = options(dir);
  o.max_train_steps = 0;  // the epochs decide
  o.num_train_epochs = epochs;
  return o;
}

// The entries of `dir` whose names start with `prefix`.
std::set<std::string> entries(const std::string& dir, const std::string& prefix) {
  std::set<std::string> names;
  for (const auto& e : fs::directory_iterator(dir)) {
    const std::string name = e.path().filename().string();
    if (name.rfind(prefix, 0) == 0) names.insert(name);
  }
  return names;
}

nlohmann::json epoch_meta(const std::string& run_dir, const std::string& name) {
  return nlohmann::json::parse(io::read_file(run_dir + "/" + name + "/epoch.json"));
}

torch::Tensor exported_weight(const std::string& folder) {
  return io::load_safetensors(folder + "/model.safetensors").tensors.at("weight").clone();
}

// kohya: epoch e saves when e % N == 0, but not the last epoch (the run's end is its save). Each
// epoch save is the export of the weights after that epoch, plus a checkpoint of its step.
TEST(TrainerEpochs, SaveEveryNEpochsExportsAndCheckpointsAfterThoseEpochs) {
  const auto dir = temp_dir("epochs_save");
  auto o = epochs_options(dir + "/run", 5);
  o.save_every_n_epochs = 2;
  const auto r = run(o);
  EXPECT_EQ(r.result.global_step, 30);
  const std::string run_dir = dir + "/run";
  EXPECT_EQ(entries(run_dir, "epoch-"), (std::set<std::string>{"epoch-000002", "epoch-000004"}));
  EXPECT_EQ(entries(run_dir, "checkpoint-"),
            (std::set<std::string>{"checkpoint-12", "checkpoint-24", "checkpoint-30"}));
  EXPECT_EQ(r.calls->export_dirs,
            (std::vector<std::string>{"epoch-000002.tmp", "epoch-000004.tmp", "run"}));
  const auto meta = epoch_meta(run_dir, "epoch-000004");
  EXPECT_EQ(meta.at("epoch"), 4);
  EXPECT_EQ(meta.at("global_step"), 24);
  EXPECT_EQ(meta.at("checkpoint"), "checkpoint-24");
  EXPECT_EQ(meta.at("owns_checkpoint"), true);
  // epoch-000002 holds the weights after 12 updates: those a 12-update run exports.
  auto twelve = options(dir + "/twelve");
  twelve.max_train_steps = 12;
  const auto t = run(twelve);
  EXPECT_TRUE(torch::equal(exported_weight(run_dir + "/epoch-000002"), t.weight));
  EXPECT_FALSE(torch::equal(exported_weight(run_dir + "/epoch-000004"), t.weight));
}

// --save_last_n_epochs keeps the newest epoch saves and removes the checkpoints they made, apart
// from the step cadence's own --checkpoints_total_limit.
TEST(TrainerEpochs, SaveLastNEpochsPrunesEpochSavesApartFromTheStepLimit) {
  const auto dir = temp_dir("epochs_last");
  auto o = epochs_options(dir + "/run", 7);
  o.save_every_n_epochs = 2;  // epochs 2, 4, 6: steps 12, 24, 36 (42 is the end)
  o.save_last_n_epochs = 2;
  o.checkpointing_steps = 5;  // 5, 10, ..., 40, each removed by the next (limit 1)
  o.checkpoints_total_limit = 1;
  const auto r = run(o);
  const std::string run_dir = dir + "/run";
  EXPECT_EQ(entries(run_dir, "epoch-"), (std::set<std::string>{"epoch-000004", "epoch-000006"}));
  EXPECT_EQ(entries(run_dir, "checkpoint-"),
            (std::set<std::string>{"checkpoint-24", "checkpoint-36", "checkpoint-42"}));
  // Every update's checkpoint was written once: 8 step ones, 3 epoch ones, the final one.
  EXPECT_EQ(r.calls->checkpoint_writes, 12);
}

// A step due by both cadences saves once and validates once; the epoch save then leaves its
// checkpoint to the step cadence. The last epoch's validation is the final one.
TEST(TrainerEpochs, AStepDueByBothCadencesSavesAndValidatesOnce) {
  const auto dir = temp_dir("epochs_both");
  auto o = epochs_options(dir + "/run", 3);
  o.save_every_n_epochs = 1;
  o.checkpointing_steps = 6;
  o.validation_epochs = 1;
  o.validation_steps = 6;
  o.num_validation_images = 2;
  o.final_validation = "auto";
  const auto r = run(o);
  const std::string run_dir = dir + "/run";
  EXPECT_EQ(r.calls->checkpoint_writes, 3);  // 6, 12 and the final 18
  EXPECT_EQ(r.calls->renders, 3);            // 6, 12 and the final one
  EXPECT_EQ(entries(run_dir, "epoch-"), (std::set<std::string>{"epoch-000001", "epoch-000002"}));
  EXPECT_EQ(epoch_meta(run_dir, "epoch-000001").at("owns_checkpoint"), false);
  EXPECT_EQ(entries(run_dir + "/samples", "step-"),
            (std::set<std::string>{"step-000006.png", "step-000012.png", "step-000018.png"}));
}

// Diffusers counts epochs from 0: --validation_epochs 2 validates after the 1st, 3rd, 5th ...
// epoch (1-based), and --final_validation auto renders the end of such a run.
TEST(TrainerEpochs, ValidationEpochsCountsFromTheFirstEpochAsDiffusers) {
  const auto dir = temp_dir("epochs_validation");
  auto o = epochs_options(dir + "/run", 5);
  o.validation_epochs = 2;
  o.num_validation_images = 1;
  o.final_validation = "auto";
  const auto r = run(o);
  EXPECT_EQ(r.calls->renders, 3);
  EXPECT_EQ(entries(dir + "/run/samples", "step-"),
            (std::set<std::string>{"step-000006.png", "step-000018.png", "step-000030.png"}));
}

// Under accumulation the epoch ends on the update of its last micro-batch, a partial window
// included: 6 micro-batches in windows of 4 are 2 updates (4 + 2) per epoch.
TEST(TrainerEpochs, AnEpochEndsOnItsPartialAccumulationWindow) {
  const auto dir = temp_dir("epochs_accum");
  auto o = epochs_options(dir + "/run", 3);
  o.gradient_accumulation_steps = 4;
  o.save_every_n_epochs = 1;
  const auto r = run(o);
  EXPECT_EQ(r.result.global_step, 6);
  const std::string run_dir = dir + "/run";
  EXPECT_EQ(entries(run_dir, "epoch-"), (std::set<std::string>{"epoch-000001", "epoch-000002"}));
  EXPECT_EQ(epoch_meta(run_dir, "epoch-000001").at("global_step"), 2);
  EXPECT_EQ(epoch_meta(run_dir, "epoch-000002").at("global_step"), 4);
}

// A run resumed inside an epoch saves and validates at the same epochs as an uninterrupted one,
// prunes the first run's epoch saves, and ends with the same weights; resumed from the
// checkpoint of an epoch save, it does not save that epoch again.
TEST(TrainerEpochs, AResumedRunKeepsTheCadenceAndEndsTheSame) {
  const auto dir = temp_dir("epochs_resume");
  const auto cadence = [](train::TrainerOptions o) {
    o.save_every_n_epochs = 2;  // epochs 2, 4, 6: steps 12, 24, 36
    o.save_last_n_epochs = 2;
    o.validation_epochs = 3;  // after epochs 0, 3 (0-based): steps 6, 24; the end 42
    o.num_validation_images = 1;
    o.final_validation = "always";
    return o;
  };
  const auto whole = run(cadence(epochs_options(dir + "/whole", 7)));

  auto first = cadence(epochs_options(dir + "/split", 7));
  first.max_train_steps = 15;  // stops inside epoch 3 (1-based)
  run(first);
  ASSERT_TRUE(fs::exists(dir + "/split/epoch-000002"));
  auto second = cadence(epochs_options(dir + "/split", 7));
  second.resume_from_checkpoint = "latest";  // checkpoint-15
  const auto resumed = run(second);
  EXPECT_EQ(resumed.calls->losses, 42 - 15);
  EXPECT_EQ(resumed.calls->export_dirs,
            (std::vector<std::string>{"epoch-000004.tmp", "epoch-000006.tmp", "split"}));
  EXPECT_EQ(resumed.calls->renders, 2);  // step 24 and the end
  for (const std::string d : {"/whole", "/split"}) {
    EXPECT_EQ(entries(dir + d, "epoch-"), (std::set<std::string>{"epoch-000004", "epoch-000006"}))
        << d;
    EXPECT_TRUE(fs::exists(dir + d + "/samples/step-000024.png")) << d;
    EXPECT_FALSE(fs::exists(dir + d + "/checkpoint-12")) << d << ": pruned with epoch-000002";
  }
  EXPECT_TRUE(torch::equal(whole.weight, resumed.weight))
      << "max diff " << max_abs(whole.weight, resumed.weight);
  EXPECT_TRUE(torch::equal(whole.bias, resumed.bias));
  for (const char* e : {"/epoch-000004", "/epoch-000006"}) {
    EXPECT_TRUE(
        torch::equal(exported_weight(dir + "/whole" + e), exported_weight(dir + "/split" + e)))
        << e;
  }

  // From epoch 4's own checkpoint (its export is written before it): epoch 4 is not saved again.
  auto from_epoch_end = cadence(epochs_options(dir + "/from24", 7));
  from_epoch_end.resume_from_checkpoint = dir + "/whole/checkpoint-24";
  const auto r24 = run(from_epoch_end);
  EXPECT_EQ(r24.calls->losses, 42 - 24);
  EXPECT_EQ(r24.calls->export_dirs, (std::vector<std::string>{"epoch-000006.tmp", "from24"}));
  EXPECT_TRUE(torch::equal(whole.weight, r24.weight));
}

}  // namespace
}  // namespace difftrain::test
