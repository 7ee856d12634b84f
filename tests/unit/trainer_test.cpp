// The Trainer driven through a small fake TrainingTask (no diffusion, no CLI): the seam a new
// model family plugs into. A linear regression task checks gradient accumulation against one
// big batch, an exact resume from a checkpoint, the checkpoint and validation hooks, and the
// export, with the Trainer's own loop on a world of one.
#include "difftrain/train/trainer.h"

#include "difftrain/core/error.h"
#include "difftrain/data/dataset.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "fake_task.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::test {
namespace {
namespace fs = std::filesystem;

TEST(Trainer, RunsAFakeTaskThroughEveryHookAndLearns) {
  const auto dir = temp_dir("trainer_fake");
  auto o = options(dir + "/run");
  o.max_train_steps = 60;
  o.checkpointing_steps = 25;
  o.validation_steps = 20;
  o.num_validation_images = 3;
  o.final_validation = "always";
  const auto r = run(o);
  EXPECT_EQ(r.result.global_step, 60);
  EXPECT_EQ(r.calls->builds, 1);
  EXPECT_EQ(r.calls->losses, 60);
  // 48 examples in batches of 8: an epoch is 6 updates, set before each.
  ASSERT_FALSE(r.calls->epochs.empty());
  EXPECT_EQ(r.calls->epochs.front(), 0);
  EXPECT_EQ(r.calls->epochs.back(), 9);
  // Validation at steps 20 and 40, then the final one (60 is the end: not twice).
  EXPECT_EQ(r.calls->renders, 3);
  EXPECT_EQ(r.calls->rendered_images, (std::vector<int64_t>{0, 1, 2, 0, 1, 2, 0, 1, 2}));
  for (const char* grid : {"step-000020.png", "step-000040.png", "step-000060.png"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / "run" / "samples" / grid)) << grid;
  }
  // Checkpoints at 25 and 50 and the final one, each with the task's own file.
  EXPECT_EQ(r.calls->checkpoint_writes, 3);
  for (const char* ckpt : {"checkpoint-25", "checkpoint-50", "checkpoint-60"}) {
    EXPECT_TRUE(fs::exists(fs::path(dir) / "run" / ckpt / "fake_task.txt")) << ckpt;
  }
  EXPECT_EQ(r.calls->exports, 1);
  // The model card beside the export names the final render's 3 images, written next to it
  // (the grey level of the last bias: not the step-20/40 renders').
  const auto run_dir = fs::path(dir) / "run";
  const std::string card = io::read_file((run_dir / "README.md").string());
  EXPECT_NE(card.find("library_name: diffusers"), std::string::npos) << card;
  EXPECT_NE(card.find("url: image_2.png"), std::string::npos) << card;
  EXPECT_NE(card.find("| updates | 60 |"), std::string::npos) << card;
  const auto level =
      static_cast<uint8_t>(std::lround(255.0 * torch::sigmoid(r.bias.flatten()[0]).item<double>()));
  for (int i = 0; i < 3; ++i) {
    const auto png = run_dir / ("image_" + std::to_string(i) + ".png");
    ASSERT_TRUE(fs::exists(png)) << png;
    EXPECT_NEAR(io::load_image(png.string())[0][0][0].item<uint8_t>(), level, 1) << png;
  }
  EXPECT_FALSE(fs::exists(run_dir / "image_3.png"));
  // The regression is learnt: the loss from about 15 (the targets' variance) to below 0.2 in 60
  // updates (0.054 here), the weights within 0.2 of the true ones (0.05 here).
  const auto w = r.weight.flatten();
  std::printf("fake task: final loss %.5f, weight [%.3f %.3f %.3f %.3f] (true [1 -2 0.5 3])\n",
              r.result.last_loss, w[0].item<double>(), w[1].item<double>(), w[2].item<double>(),
              w[3].item<double>());
  EXPECT_LT(r.result.last_loss, 0.2);
  EXPECT_LT(max_abs(r.weight.flatten(), torch::tensor({1.0, -2.0, 0.5, 3.0})), 0.2);
}

// A run whose final validation is skipped writes its card without a widget: the images of an
// earlier validation are not the exported weights'.
TEST(Trainer, ModelCardWithoutAFinalRenderHasNoWidget) {
  const auto dir = temp_dir("trainer_card");
  auto o = options(dir + "/run");
  o.max_train_steps = 4;
  o.validation_steps = 2;
  o.num_validation_images = 2;
  o.final_validation = "never";
  const auto r = run(o);
  EXPECT_EQ(r.calls->renders, 1);
  EXPECT_TRUE(fs::exists(fs::path(dir) / "run" / "samples" / "step-000002.png"));
  const std::string card = io::read_file(dir + "/run/README.md");
  EXPECT_NE(card.find("license: other"), std::string::npos) << card;
  EXPECT_EQ(card.find("widget:"), std::string::npos) << card;
  EXPECT_FALSE(fs::exists(dir + "/run/image_0.png"));
}

TEST(Trainer, AccumulatedMicroBatchesEqualOneBigBatch) {
  // 2 micro-batches of 4 per update are the same 8 samples as one batch of 8: the loss mean
  // and so every update agree up to float32 summation order.
  const auto dir = temp_dir("trainer_accum");
  auto big = options(dir + "/big");
  auto accumulated = options(dir + "/accumulated");
  accumulated.train_batch_size = 4;
  accumulated.gradient_accumulation_steps = 2;
  const auto a = run(big);
  const auto b = run(accumulated);
  EXPECT_EQ(b.calls->losses, 2 * a.calls->losses);
  const double diff = std::max(max_abs(a.weight, b.weight), max_abs(a.bias, b.bias));
  std::printf("batch 8 vs 2 x 4 accumulated: max |weight diff| %.3g (tolerance 1e-5)\n", diff);
  EXPECT_LT(diff, 1e-5);
  EXPECT_NEAR(a.result.last_loss, b.result.last_loss, 1e-5);
}

TEST(Trainer, ResumeFromACheckpointContinuesBitExactly) {
  const auto dir = temp_dir("trainer_resume");
  // One run of 9 updates (across an epoch boundary at 6), and the same run stopped at 4 and
  // resumed from its checkpoint.
  auto whole = options(dir + "/whole");
  whole.max_train_steps = 9;
  const auto a = run(whole);

  auto first = options(dir + "/split");
  first.max_train_steps = 4;
  run(first);
  ASSERT_TRUE(fs::exists(fs::path(dir) / "split" / "checkpoint-4" / "fake_task.txt"));
  auto second = options(dir + "/split");
  second.max_train_steps = 9;
  second.resume_from_checkpoint = "latest";
  const auto b = run(second);
  EXPECT_EQ(b.result.global_step, 9);
  EXPECT_EQ(b.calls->losses, 5);  // only the updates after step 4
  EXPECT_TRUE(torch::equal(a.weight, b.weight)) << "max diff " << max_abs(a.weight, b.weight);
  EXPECT_TRUE(torch::equal(a.bias, b.bias));
  EXPECT_EQ(a.result.last_loss, b.result.last_loss);
}

TEST(Trainer, AResumeWithADifferentStructuralSettingIsRefused) {
  const auto dir = temp_dir("trainer_structural");
  auto first = options(dir + "/run");
  first.max_train_steps = 2;
  first.config = {{"task", "fake"}, {"width", 4}};
  first.structural_keys = {"width"};
  run(first);
  auto second = options(dir + "/run");
  second.max_train_steps = 4;
  second.resume_from_checkpoint = "latest";
  second.config = {{"task", "fake"}, {"width", 8}};
  second.structural_keys = {"width"};
  const std::string message = error_of([&] { run(second); });
  EXPECT_NE(message.find("width"), std::string::npos) << message;
}

}  // namespace
}  // namespace difftrain::test
