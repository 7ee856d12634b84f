// One FLUX.1-sized training step through the Accelerator, for issue 42's memory tools: a
// FluxTransformer2DModel at FLUX.1's width (24 heads x 128 = 3072, T5 width 4096, CLIP 768,
// guidance embedding) with a few of its blocks (default 2 double-stream + 4 single-stream), on
// random packed latents [B, L, 64] and text states [B, S, 4096]; the flow-matching loss (MSE of
// the velocity noise - x0 at a random sigma), backward, clip_grad_norm_(1.0), optimizer step.
//
//   bench_flux_step --mode lora|full [--lora_rank 16] [--base_weights_dtype none|int8|fp8_e4m3]
//                   [--offload 0|1] [--optimizer adamw|adamw8bit] [--image_tokens 4096]
//                   [--text_tokens 512] [--num_layers 2] [--num_single_layers 4] [--heads 24]
//                   [--batch 1] [--mixed_precision bf16] [--gradient_checkpointing 1]
//                   [--steps 5] [--warmup 2] [--device auto|cpu|cuda] [--threads 0]
//                   [--profile FILE]
//
// lora: the frozen base in the training dtype (bf16 under bf16, as Diffusers' FLUX LoRA script
// keeps it), or 8-bit (--base_weights_dtype, models/quantized_weight.h), adapters on Diffusers'
// 12 default FLUX targets in fp32. full: every weight trains in fp32 (master weights); with
// --offload 1 the optimizer side lives in host memory (SHARD_GRAD_OP over a world of one with
// offload_optimizer, as `difftrain train --offload_optimizer_device cpu` runs on one device).
// Prints one JSON line: ms per step (the median of the timed steps) and its parts
// (forward+backward, optimizer step), the peak memory during the timed steps (CUDA: the caching
// allocator's peak allocated bytes; CPU: the peak RSS, reset after the warm-up, and the RSS before
// them, as the Python peer bench/py/diffusers_flux_step.py measures them; the live heap after the
// steps), the frozen base's bytes, the trainable count and host bytes. bench/flux_vs_diffusers.sh
// runs both.

#include "bench_util.h"
#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"
#include "difftrain/families/flux/lora_layouts.h"
#include "difftrain/models/kernels/packed_matmul.h"
#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/transformers/flux_transformer.h"
#include "difftrain/optim/adamw.h"
#include "difftrain/optim/adamw8bit.h"

#include <torch/cuda.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <malloc.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <string>

namespace {

using namespace difftrain;

// Bytes the heap holds now (glibc's count of allocated blocks and mmapped chunks).
double live_heap_gib() {
  const struct mallinfo2 m = mallinfo2();
  return static_cast<double>(m.uordblks + m.hblkhd) / (1 << 30);
}

int run(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) args[std::string(argv[i]).substr(2)] = argv[i + 1];
  auto get = [&](const std::string& k, const std::string& d) {
    return args.count(k) ? args[k] : d;
  };
  auto num = [&](const std::string& k, int64_t d) { return std::stoll(get(k, std::to_string(d))); };
  const std::string mode = get("mode", "lora");
  if (mode != "lora" && mode != "full") throw Error("--mode is lora or full, got " + mode);
  const int64_t lora_rank = num("lora_rank", 16), batch = num("batch", 1);
  const int64_t image_tokens = num("image_tokens", 4096), text_tokens = num("text_tokens", 512);
  const int64_t steps = num("steps", 5), warmup = num("warmup", 2);
  const bool offload = num("offload", 0) != 0;
  const std::string precision = get("mixed_precision", "bf16");
  const auto storage =
      models::parse_weight_storage(get("base_weights_dtype", "none"), "--base_weights_dtype");
  if (num("threads", 0) > 0) at::set_num_threads(static_cast<int>(num("threads", 0)));
  torch::manual_seed(0);

  accel::AcceleratorOptions o;
  o.mixed_precision = precision;
  o.cpu = get("device", "auto") == "cpu";
  if (offload) {
    if (mode != "full") throw Error("--offload 1 is measured for --mode full");
    accel::ShardingOptions sharding;
    sharding.strategy = accel::ShardingStrategy::kShardGradOp;
    sharding.offload_optimizer = true;
    o.sharding = sharding;
  }
  accel::Accelerator acc(o);
  const torch::Device device = acc.device();

  models::FluxTransformer2DModelOptions fo;
  fo.num_layers(num("num_layers", 2))
      .num_single_layers(num("num_single_layers", 4))
      .num_attention_heads(num("heads", 24))
      .guidance_embeds(true);
  models::FluxTransformer2DModel model(fo);
  model->set_gradient_checkpointing(num("gradient_checkpointing", 1) != 0);
  model->train();
  std::shared_ptr<torch::nn::Module> trainable = model.ptr();
  models::LoraLayers lora{nullptr};
  int64_t frozen_bytes = 0;
  if (mode == "lora") {
    for (auto& p : model->parameters()) p.requires_grad_(false);
    if (precision == "bf16") model->to(torch::kBFloat16);
    models::quantize_frozen_weights(*model, storage);
    model->to(device);
    models::LoraConfig lc;
    lc.rank = lora_rank;
    lc.alpha = static_cast<double>(lora_rank);
    lc.target_modules = families::flux::diffusers_flux_lora_targets();  // Diffusers' FLUX script's
    lora = models::LoraLayers(*model, lc);
    trainable = lora.ptr();
    for (const auto& p : model->parameters()) {
      if (!p.requires_grad()) frozen_bytes += static_cast<int64_t>(p.nbytes());
    }
    frozen_bytes += models::quantized_weight_bytes(*model);
  }
  std::vector<torch::Tensor> params;
  int64_t trainable_count = 0;
  for (const auto& p : trainable->parameters()) {
    if (p.requires_grad()) params.push_back(p), trainable_count += p.numel();
  }
  torch::optim::AdamWOptions ao(1e-4);
  ao.weight_decay(1e-2);
  std::shared_ptr<optim::FlatOptimizer> optimizer;
  if (get("optimizer", "adamw") == "adamw8bit") {
    optimizer = std::make_shared<optim::AdamW8bit>(params, ao);
  } else {
    optimizer = std::make_shared<optim::AdamW>(params, ao);
  }
  acc.prepare_module(*trainable);
  auto opt = acc.prepare_optimizer(optimizer);
  model->to(device);  // the frozen base of a LoRA run is not prepared: it is moved

  const auto on = torch::TensorOptions().device(device);
  auto x0 = torch::randn({batch, image_tokens, fo.in_channels()}, on);
  auto text = torch::randn({batch, text_tokens, fo.joint_attention_dim()}, on);
  auto pooled = torch::randn({batch, fo.pooled_projection_dim()}, on);
  auto guidance = torch::full({batch}, 3.5, on);
  // Ids as FluxPipeline's: text ids zero, image ids (0, row, column) of a square latent grid.
  const int64_t side = static_cast<int64_t>(std::sqrt(static_cast<double>(image_tokens)));
  auto rows = torch::arange(image_tokens, on.dtype(torch::kFloat)).div(side, "floor");
  auto cols = torch::arange(image_tokens, on.dtype(torch::kFloat)).remainder(side);
  auto img_ids = torch::stack({torch::zeros_like(rows), rows, cols}, 1);
  auto txt_ids = torch::zeros({text_tokens, 3}, on);

  // With bench/alloc_peak.c preloaded: the heap in use before the step and after its forward (what
  // the graph keeps for the backward, with the prediction and the loss).
  const bench::HeapCounter heap;
  double heap_step_start = 0, heap_after_forward = 0;
  auto step = [&](bench::StepTimer& timer) {
    if (heap.present()) heap_step_start = static_cast<double>(heap.live());
    timer.start();
    auto sigma = torch::rand({batch}, on);
    auto noise = torch::randn_like(x0);
    auto s = sigma.view({batch, 1, 1});
    auto noisy = (1 - s) * x0 + s * noise;
    torch::Tensor loss;
    {
      auto autocast = acc.autocast();
      auto pred = model->forward(noisy, text, pooled, sigma, guidance, img_ids, txt_ids);
      loss = torch::mse_loss(pred.to(torch::kFloat), noise - x0);
    }
    if (heap.present()) heap_after_forward = static_cast<double>(heap.live());
    acc.backward(loss);
    acc.clip_grad_norm_(params, 1.0);
    bench::synchronize(device);
    timer.backward_done();
    opt->step();
    opt->zero_grad(/*set_to_none=*/true);  // as torch 2's optimizer.zero_grad(), the peer's
    bench::synchronize(device);
    timer.optimizer_done();
    return loss;
  };
  nlohmann::json out;
  bench::run_timed_steps(step, warmup, steps, get("profile", ""), device, out);

  out["impl"] = "difftrain";
  out["mode"] = mode;
  out["device"] = device.str();
  out["threads"] = at::get_num_threads();
  // Frozen layers' input gradients through the packed weight (models/kernels/packed_matmul.h).
  out["packed_grad_products"] = models::packed_linear_grad_calls();
  const auto mem = acc.memory();
  out["blocks"] = {fo.num_layers(), fo.num_single_layers()};
  out["width"] = fo.inner_dim();
  out["tokens"] = {image_tokens, text_tokens};
  out["batch"] = batch;
  out["mixed_precision"] = precision;
  out["lora_rank"] = mode == "lora" ? lora_rank : 0;
  out["base_weights_dtype"] = models::to_string(storage);
  out["offload"] = offload;
  out["gradient_checkpointing"] = num("gradient_checkpointing", 1) != 0;
  out["optimizer"] = get("optimizer", "adamw");
  out["trainable"] = trainable_count;
  out["frozen_bytes"] = frozen_bytes;
  out["host_bytes"] = mem.host_bytes;
  // CPU: what the heap holds after the timed steps (weights, adapters, optimizer state).
  out["live_heap_gib"] = live_heap_gib();
  if (heap.present()) out["forward_keeps_gib"] = (heap_after_forward - heap_step_start) / (1 << 30);
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return difftrain::bench::run_main("bench_flux_step", [&] { return run(argc, argv); });
}
