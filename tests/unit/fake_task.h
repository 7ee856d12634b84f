#pragma once
// A small fake TrainingTask for driving the Trainer without diffusion or the CLI (trainer_test.cpp,
// trainer_epochs_test.cpp): a Linear(4, 1) fitted to y = x . w_true + 0.5 on 48 fixed points,
// counting the hooks the Trainer calls.
#include "difftrain/train/trainer.h"

#include "difftrain/data/dataset.h"
#include "difftrain/io/safetensors.h"

#include <torch/torch.h>

#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::test {

// What the fake task saw: shared with the test, which keeps it after the Trainer is gone.
struct Calls {
  int64_t builds = 0, losses = 0, renders = 0, checkpoint_writes = 0, exports = 0;
  std::vector<int64_t> rendered_images;  // every image index asked for, in order
  std::vector<int64_t> epochs;           // set_epoch() arguments
  std::vector<std::string> export_dirs;  // the folder name of every export_to(), in order
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

  void write_to_checkpoint(const std::filesystem::path& dir) const override {
    ++calls_->checkpoint_writes;
    std::ofstream(dir / "fake_task.txt") << "fake task checkpoint\n";
  }
  void export_to(const std::filesystem::path& out_dir) override {
    ++calls_->exports;
    calls_->export_dirs.push_back(out_dir.filename().string());
    io::save_safetensors(
        (out_dir / "model.safetensors").string(),
        {{"weight", model_->weight.detach().clone()}, {"bias", model_->bias.detach().clone()}});
  }

 private:
  std::shared_ptr<Calls> calls_;
  std::shared_ptr<torch::nn::LinearImpl> model_;
  std::shared_ptr<data::TensorDataset> dataset_;
};

inline train::TrainerOptions options(const std::string& dir) {
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

inline Run run(train::TrainerOptions o) {
  Run r;
  r.calls = std::make_shared<Calls>();
  train::Trainer trainer(std::move(o), std::make_unique<FakeTask>(r.calls));
  r.result = trainer.run();
  const auto exported = io::load_safetensors(r.result.output_dir + "/model.safetensors");
  r.weight = exported.tensors.at("weight").clone();
  r.bias = exported.tensors.at("bias").clone();
  return r;
}

}  // namespace difftrain::test
