// A plain single-process LibTorch training loop, and the same loop on the Accelerator.
// The difftrain version differs by the lines marked `// +difftrain` (and the two changed ones
// marked `// ~difftrain`); it runs unchanged on 1 process or under
//
//   difftrain launch --num_processes 2 build/examples/example_custom_loop
//
// with mixed precision and gradient accumulation from `difftrain launch --mixed_precision bf16
// --gradient_accumulation_steps 2`. `--plain` runs the plain loop instead.

#include "difftrain/accel/accelerator.h"  // +difftrain

#include <torch/torch.h>

#include <cstdio>
#include <cstring>

namespace {

struct ClassifierImpl : torch::nn::Module {
  ClassifierImpl() {
    conv =
        register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 16, 3).padding(1)));
    norm = register_module("norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(4, 16)));
    head = register_module("head", torch::nn::Linear(16, 3));
  }
  // x: [B, 1, 12, 12] -> logits [B, 3]
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::silu(norm->forward(conv->forward(x)));
    return head->forward(h.mean({2, 3}));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::GroupNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Classifier);

// Three classes of noisy 12x12 images with a 4x4 patch in the middle: bright (class 0), dark
// (class 1) or a checkerboard (class 2).
std::shared_ptr<difftrain::data::TensorDataset> make_data() {
  torch::manual_seed(0);
  const int64_t n = 384;
  auto labels = torch::randint(0, 3, {n}, torch::kLong);
  auto images = torch::randn({n, 1, 12, 12}) * 0.3;
  const auto checker =
      (torch::arange(4).view({4, 1}) + torch::arange(4).view({1, 4})).remainder(2) * 2 - 1;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t c = labels[i].item<int64_t>();
    auto patch = images[i][0].slice(0, 4, 8).slice(1, 4, 8);
    patch += c == 0   ? torch::ones({4, 4})
             : c == 1 ? -torch::ones({4, 4})
                      : checker.to(torch::kFloat);
  }
  return std::make_shared<difftrain::data::TensorDataset>(
      difftrain::data::Example{{"image", images}, {"label", labels}});
}

difftrain::data::DataLoaderOptions loader_options() {
  difftrain::data::DataLoaderOptions options;
  options.batch_size = 32;
  options.shuffle = true;
  options.seed = 1;
  return options;
}

int plain_loop() {
  torch::manual_seed(42);
  Classifier model;
  auto optimizer =
      std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(2e-2));
  auto loader = std::make_shared<difftrain::data::DataLoader>(make_data(), loader_options());
  double loss_value = 0;
  for (int epoch = 0; epoch < 5; ++epoch) {
    for (const auto& batch : *loader) {
      auto loss = torch::cross_entropy_loss(model->forward(batch.at("image")), batch.at("label"));
      loss.backward();
      torch::nn::utils::clip_grad_norm_(model->parameters(), 1.0);
      optimizer->step();
      optimizer->zero_grad();
      loss_value = loss.item<double>();
    }
    std::printf("epoch %d loss %.4f\n", epoch, loss_value);
  }
  std::printf("final loss %.4f\n", loss_value);
  return 0;
}

int accelerated_loop() {
  difftrain::accel::Accelerator accelerator;  // +difftrain: reads `difftrain launch`'s settings
  torch::manual_seed(42);
  Classifier model;
  auto optimizer =
      std::make_shared<torch::optim::AdamW>(model->parameters(), torch::optim::AdamWOptions(2e-2));
  auto loader = std::make_shared<difftrain::data::DataLoader>(make_data(), loader_options());
  auto [m, opt, dl] = accelerator.prepare(model, optimizer, loader);  // +difftrain
  double loss_value = 0;
  for (int epoch = 0; epoch < 5; ++epoch) {
    for (const auto& batch : *dl) {
      auto step = accelerator.accumulate(m);  // +difftrain
      torch::Tensor loss;
      {
        auto autocast = accelerator.autocast();  // +difftrain
        loss = torch::cross_entropy_loss(m->forward(batch.at("image")).to(torch::kFloat),
                                         batch.at("label"));
      }
      accelerator.backward(loss);  // ~difftrain
      if (accelerator.sync_gradients())
        accelerator.clip_grad_norm_(m->parameters(), 1.0);  // ~difftrain
      opt->step();
      opt->zero_grad();
      loss_value = accelerator.reduce(loss.detach(), "mean").item<double>();  // +difftrain
    }
    accelerator.print("epoch {} loss {:.4f}", epoch, loss_value);  // ~difftrain
  }
  accelerator.print("final loss {:.4f}", loss_value);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    if (argc > 1 && std::strcmp(argv[1], "--plain") == 0) return plain_loop();
    return accelerated_loop();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
