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

// What the fake task saw: shared with the test, which keeps it after the Trainer is gone.
struct Calls {
  int64_t builds = 0, losses = 0, renders = 0, checkpoint_writes = 0, exports = 0;
  std::vector<int64_t> rendered_images;  // every image index asked for, in order
  std::vector<int64_t> epochs;           // set_epoch() arguments
};

// y = x . w_true + 0.5 on 48 fixed points, fitted by a Linear(4, 1).
class FakeTask : public train::TrainingTask {
 public:
  explicit FakeTask(std::shared_ptr<Calls> calls) : calls_(std::move(calls)) {}

  std::string name() const override { return "fake regression"; }

  void build(accel::Accelerator& acc, const std::string& output_dir) override {
    (void)acc;
    (void)output_dir;
    ++calls_->builds;
    torch::manual_seed(7);
    model_ = std::make_shared<torch::nn::LinearImpl>(4, 1);
    auto gen = at::detail::createCPUGenerator(11);
    auto x = torch::randn({48, 4}, gen);
    auto y = x.matmul(torch::tensor({1.0f, -2.0f, 0.5f, 3.0f})) + 0.5;
    dataset_ = std::make_shared<data::TensorDataset>(
        data::Example{{"index", torch::arange(48)}, {"x", x}, {"y", y.unsqueeze(1)}});
  }
  std::shared_ptr<data::Dataset> dataset() const override { return dataset_; }
  void set_epoch(int64_t epoch) override { calls_->epochs.push_back(epoch); }
  std::shared_ptr<torch::nn::Module> trainable() const override { return model_; }
  std::string parameter_summary() const override { return "parameters 5 (trainable 5)"; }
  int64_t frozen_bytes() const override { return 0; }

  torch::Tensor loss(const data::Batch& batch, int64_t epoch, torch::Device device) override {
    (void)epoch;
    ++calls_->losses;
    auto pred = model_->forward(batch.at("x").to(device));
    return torch::mse_loss(pred.to(torch::kFloat), batch.at("y").to(device));
  }

  train::ValidationImages render_validation(const std::vector<int64_t>& mine, int64_t begin,
                                            const SamplerStepCallback& on_step) override {
    (void)begin;
    ++calls_->renders;
    for (int64_t step = 1; step <= 3; ++step) on_step(step, 3);
    calls_->rendered_images.insert(calls_->rendered_images.end(), mine.begin(), mine.end());
    // A grey level per image from the current bias: [k, 8, 8, 3] in [0, 1].
    const double level = torch::sigmoid(model_->bias.detach()).item<double>();
    return {torch::full({static_cast<int64_t>(mine.size()), 8, 8, 3}, level)};
  }
  std::vector<std::string> validation_labels(int64_t K) const override {
    return std::vector<std::string>(static_cast<size_t>(K), "fake");
  }

  void write_to_checkpoint(const fs::path& dir) const override {
    ++calls_->checkpoint_writes;
    std::ofstream(dir / "fake_task.txt") << "fake task checkpoint\n";
  }
  void export_to(const fs::path& out_dir) override {
    ++calls_->exports;
    io::save_safetensors(
        (out_dir / "model.safetensors").string(),
        {{"weight", model_->weight.detach().clone()}, {"bias", model_->bias.detach().clone()}});
  }

 private:
  std::shared_ptr<Calls> calls_;
  std::shared_ptr<torch::nn::LinearImpl> model_;
  std::shared_ptr<data::TensorDataset> dataset_;
};

train::TrainerOptions options(const std::string& dir) {
  train::TrainerOptions o;
  o.mixed_precision = "no";
  o.seed = 3;
  o.train_batch_size = 8;
  o.learning_rate = 5e-2;
  o.lr_scheduler = "constant";
  o.lr_warmup_steps = 0;
  o.max_train_steps = 6;
  o.use_ema = false;
  o.output_dir = dir;
  o.report_to = "jsonl";
  o.logging_steps = 1;
  o.checkpointing_steps = 0;
  o.validation_steps = 0;
  o.num_validation_images = 0;
  o.final_validation = "never";
  o.config = {{"task", "fake"}};
  return o;
}

struct Run {
  train::TrainResult result;
  std::shared_ptr<Calls> calls;
  torch::Tensor weight, bias;  // the exported model
};

Run run(train::TrainerOptions o) {
  Run r;
  r.calls = std::make_shared<Calls>();
  train::Trainer trainer(std::move(o), std::make_unique<FakeTask>(r.calls));
  r.result = trainer.run();
  const auto exported = io::load_safetensors(r.result.output_dir + "/model.safetensors");
  r.weight = exported.tensors.at("weight").clone();
  r.bias = exported.tensors.at("bias").clone();
  return r;
}

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
