// The gpu label for --blocks_to_swap (models/block_swap.h) on a CUDA device: a LoRA training step
// of a FLUX.1-width transformer (hidden 3072, 24 heads of 128, 2 double-stream and 4
// single-stream blocks, bf16, checkpointing) with 2 of kohya's block units swapped (1 double, 2
// single) against the same step without the swap: the loss and the adapters' gradients agree,
// the peak CUDA memory falls by about the swapped blocks' bytes less the staging, and both step
// times are printed (docs/PERFORMANCE.md, "Block swap on a GPU").

#include "cuda_required.h"

#include "difftrain/models/block_swap.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/transformers/flux_transformer.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#ifdef DIFFTRAIN_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <chrono>
#include <cstdio>

namespace {

namespace dm = difftrain::models;

#ifdef DIFFTRAIN_WITH_CUDA
struct Timed {
  double seconds = 0;
  int64_t peak_bytes = 0;
  float loss = 0;
  std::vector<torch::Tensor> grads;
};

// `steps` LoRA steps (after one warm-up) at 1024 image + 256 text tokens: mean time, peak memory.
Timed run_steps(dm::FluxTransformer2DModel& model, dm::LoraLayers& lora, int steps) {
  const auto cuda = torch::TensorOptions().device(torch::kCUDA).dtype(torch::kBFloat16);
  torch::manual_seed(0);
  const int64_t L = 1024, S = 256;
  const auto x = torch::randn({1, L, 64}, cuda), c = torch::randn({1, S, 4096}, cuda);
  const auto p = torch::randn({1, 768}, cuda), t = torch::full({1}, 0.5, cuda);
  const auto img_ids = torch::randint(0, 32, {L, 3}).to(torch::kCUDA);
  const auto txt_ids = torch::zeros({S, 3}, torch::TensorOptions().device(torch::kCUDA));
  Timed out;
  auto one = [&] {
    const auto pred = model->forward(x, c, p, t, {}, img_ids, txt_ids);
    const auto loss = (pred.to(torch::kFloat32) - x.to(torch::kFloat32)).pow(2).mean();
    loss.backward();
    out.loss = loss.item<float>();
  };
  one();
  torch::cuda::synchronize();
  c10::cuda::CUDACachingAllocator::resetPeakStats(0);
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    for (auto& q : lora->parameters()) q.mutable_grad() = torch::Tensor();
    one();
  }
  torch::cuda::synchronize();
  out.seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / steps;
  out.peak_bytes = c10::cuda::CUDACachingAllocator::getDeviceStats(0).allocated_bytes[0].peak;
  for (auto& q : lora->parameters()) out.grads.push_back(q.grad().to(torch::kFloat32).cpu());
  return out;
}
#endif

}  // namespace

TEST(BlockSwapGpu, FluxWidthStepTimeAndPeakMemory) {
  REQUIRE_CUDA();
#ifndef DIFFTRAIN_WITH_CUDA
  FAIL() << "this build has no CUDA support (configure with -DDIFFTRAIN_CUDA=ON, as "
            "scripts/gpu_build does)";
#else
  auto o = dm::FluxTransformer2DModelOptions()
               .num_layers(2)
               .num_single_layers(4)
               .attention_head_dim(128)
               .num_attention_heads(24)
               .joint_attention_dim(4096)
               .pooled_projection_dim(768);
  torch::manual_seed(1);
  dm::FluxTransformer2DModel model(o);
  model->to(torch::kCUDA, torch::kBFloat16);
  for (auto& q : model->parameters()) q.set_requires_grad(false);
  dm::LoraConfig lc;
  lc.rank = 16;
  lc.alpha = 16;
  lc.target_modules = {"to_q", "to_k", "to_v", "to_out.0"};
  dm::LoraLayers lora(*model, lc);
  lora->to(torch::kCUDA);
  {
    torch::NoGradGuard no_grad;
    for (auto& q : lora->parameters()) q.normal_(0, 0.01);
  }
  model->train();
  model->set_gradient_checkpointing(true);
  const int steps = 5;
  const Timed plain = run_steps(model, lora, steps);
  model->enable_block_swap(2);
  const dm::BlockSwapBytes bytes = model->block_swap()->bytes();
  const Timed swapped = run_steps(model, lora, steps);
  const int64_t measured_staging = model->block_swap()->peak_staged_bytes();
  model->enable_block_swap(0);

  double grad_diff = 0;
  for (size_t i = 0; i < plain.grads.size(); ++i)
    grad_diff = std::max(grad_diff, (plain.grads[i] - swapped.grads[i]).abs().max().item<double>());
  const double mib = 1024.0 * 1024.0;
  std::printf(
      "block swap, FLUX.1 width (2 double + 4 single blocks, bf16, LoRA r16, checkpointing, "
      "1024 + 256 tokens), --blocks_to_swap 2 (%lld blocks, %.1f MiB on the host, %.1f MiB "
      "staging, measured %.1f MiB):\n"
      "  step %.4f s -> %.4f s (%.2fx), peak %.1f MiB -> %.1f MiB (saved %.1f MiB, counted "
      "%.1f MiB); loss %.6f vs %.6f, LoRA gradients max abs %.3g (0)\n",
      static_cast<long long>(bytes.blocks), bytes.host_bytes / mib, bytes.staging_bytes / mib,
      measured_staging / mib, plain.seconds, swapped.seconds, swapped.seconds / plain.seconds,
      plain.peak_bytes / mib, swapped.peak_bytes / mib,
      (plain.peak_bytes - swapped.peak_bytes) / mib, bytes.saved_bytes() / mib, plain.loss,
      swapped.loss, grad_diff);
  EXPECT_EQ(plain.loss, swapped.loss);
  EXPECT_EQ(grad_diff, 0.0);
  EXPECT_EQ(measured_staging, bytes.staging_bytes);
  EXPECT_LT(swapped.peak_bytes, plain.peak_bytes);
  // The frozen weights saved show up in the peak (activations are the same in both).
  EXPECT_GE(plain.peak_bytes - swapped.peak_bytes, bytes.saved_bytes() * 9 / 10);
#endif
}
