// The training step of a Diffusers UNet through the Accelerator, the loop Diffusers' training
// scripts run per batch: noise and timesteps drawn, DDPMScheduler.add_noise, the UNet forward
// under autocast, the epsilon MSE loss in fp32, accelerator.backward, clip_grad_norm_(1.0),
// AdamW step, zero_grad. Inputs are random (latents [B, C, R, R], and [B, L, D] text states for a
// UNet2DConditionModel or class labels for a class-conditional UNet2DModel; for SDXL's
// addition_embed_type "text_time" also a pooled text embedding [B, D'] and the micro-conditioning
// time ids [B, 6]): this measures the step, not data loading. bench/py/diffusers_unet_step.py is
// the same step in Diffusers + Accelerate (+ PEFT for LoRA); bench/gpu_train.sh runs both side by
// side.
//
//   bench_unet_step --config unet_config.json [--batch 8] [--resolution 64] [--text_len 77]
//                   [--mixed_precision no|bf16|fp16] [--lora_rank 0] [--steps 20] [--warmup 5]
//                   [--device auto|cpu|cuda] [--gradient_checkpointing 0|1] [--seed 0]
//                   [--profile trace.json]
//
// --profile records the timed steps with LibTorch's autograd profiler into a Chrome trace;
// bench/py/op_profile.py sums it per operator (where a step's time goes).
//
// Prints one JSON line: samples/s over the timed steps, ms per step, the peak memory (CUDA: the
// caching allocator's peak allocated bytes, torch.cuda.max_memory_allocated; CPU: peak RSS),
// parameter counts and the device.

#include "bench_util.h"
#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"
#include "difftrain/diffusion/noise_scheduler.h"
#include "difftrain/diffusion/scheduler_config.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/unets/unet.h"
#include "difftrain/optim/adamw.h"

#include <torch/csrc/autograd/profiler_legacy.h>
#include <torch/cuda.h>
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <map>
#include <memory>
#include <string>

namespace {

using namespace difftrain;

int run(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) args[std::string(argv[i]).substr(2)] = argv[i + 1];
  auto get = [&](const std::string& k, const std::string& d) {
    return args.count(k) ? args[k] : d;
  };
  auto num = [&](const std::string& k, int64_t d) { return std::stoll(get(k, std::to_string(d))); };
  const std::string config_path = get("config", "");
  if (config_path.empty()) throw Error("bench_unet_step needs --config unet_config.json");
  const int64_t batch = num("batch", 8), resolution = num("resolution", 64);
  const int64_t text_len = num("text_len", 77), lora_rank = num("lora_rank", 0);
  const int64_t steps = num("steps", 20), warmup = num("warmup", 5);
  const std::string precision = get("mixed_precision", "no");
  const std::string device_arg = get("device", "auto");
  torch::manual_seed(static_cast<uint64_t>(num("seed", 0)));

  accel::AcceleratorOptions o;
  o.mixed_precision = precision;
  o.gradient_accumulation_steps = 1;
  o.cpu = device_arg == "cpu";
  accel::Accelerator acc(o);
  const torch::Device device = acc.device();
  if (device_arg == "cuda" && !device.is_cuda()) {
    throw Error("--device cuda: no CUDA device is visible (see `difftrain env`)");
  }

  models::UNet unet(models::UNetConfig::load(config_path));
  const auto& cfg = unet->config();
  unet->set_gradient_checkpointing(num("gradient_checkpointing", 0) != 0);
  std::shared_ptr<torch::nn::Module> trainable;
  models::LoraLayers lora{nullptr};
  if (lora_rank > 0) {
    // train_text_to_image_lora.py: the frozen base in the weight dtype, adapters in fp32.
    for (auto& p : unet->parameters()) p.requires_grad_(false);
    unet->to(device);
    if (precision == "bf16") unet->to(torch::kBFloat16);
    if (precision == "fp16") unet->to(torch::kHalf);
    models::LoraConfig lc;
    lc.rank = lora_rank;
    lc.alpha = static_cast<double>(lora_rank);
    lora = models::LoraLayers(*unet, lc);
    trainable = lora.ptr();
  } else {
    trainable = unet.ptr();
  }
  std::vector<torch::Tensor> params;
  int64_t total = 0, trainable_count = 0;
  for (const auto& p : unet->parameters()) total += p.numel();
  for (const auto& p : trainable->parameters()) {
    if (p.requires_grad()) params.push_back(p), trainable_count += p.numel();
  }
  if (lora_rank > 0) total += trainable_count;
  torch::optim::AdamWOptions ao(1e-4);
  ao.weight_decay(1e-2);
  auto optimizer = std::make_shared<optim::AdamW>(params, ao);
  acc.prepare_module(*trainable);
  auto opt = acc.prepare_optimizer(optimizer);
  if (lora_rank > 0) unet->to(device);  // the frozen base is not prepared; it is moved

  // DDPMScheduler's defaults: 1000 steps, linear betas.
  auto scheduler = diffusion::make_scheduler(
      diffusion::SchedulerConfig::from_json(nlohmann::json::object(), "default"), "ddpm");
  const int64_t channels = cfg.in_channels;
  auto latents = torch::randn({batch, channels, resolution, resolution}).to(device);
  models::UNetConditioning cond;
  if (cfg.kind == models::UNetKind::kUNet2DCondition) {
    const int64_t dim = cfg.cross_attention_dim.empty() ? 1280 : cfg.cross_attention_dim.front();
    cond.encoder_hidden_states = torch::randn({batch, text_len, dim}).to(device);
  }
  if (cfg.num_class_embeds.has_value()) {
    cond.class_labels = torch::randint(*cfg.num_class_embeds, {batch}, torch::kLong).to(device);
  }
  if (unet->needs_added_conditioning()) {
    // SDXL's added_cond_kwargs: text_embeds [B, D] with D = projection_class_embeddings_input_dim
    // - 6 * addition_time_embed_dim, and time_ids [B, 6] = (original size, crop top-left, target
    // size) in pixels, as train_text_to_image_sdxl.py builds them for uncropped images.
    TORCH_CHECK(cfg.projection_class_embeddings_input_dim && cfg.addition_time_embed_dim,
                "addition_embed_type text_time needs projection_class_embeddings_input_dim and "
                "addition_time_embed_dim in ",
                config_path);
    const int64_t dim =
        *cfg.projection_class_embeddings_input_dim - 6 * *cfg.addition_time_embed_dim;
    const double px = 8.0 * static_cast<double>(resolution);
    cond.text_embeds = torch::randn({batch, dim}).to(device);
    cond.time_ids =
        torch::tensor({px, px, 0.0, 0.0, px, px}, torch::kFloat).repeat({batch, 1}).to(device);
  }

  auto step = [&]() {
    auto noise = torch::randn_like(latents);
    auto t =
        torch::randint(1000, {batch}, torch::TensorOptions().dtype(torch::kLong).device(device));
    auto noisy = scheduler->add_noise(latents, noise, t);
    torch::Tensor loss;
    {
      auto autocast = acc.autocast();
      auto pred = unet->forward(noisy, t, cond);
      loss = torch::mse_loss(pred.to(torch::kFloat), noise);
    }
    acc.backward(loss);
    acc.clip_grad_norm_(params, 1.0);
    opt->step();
    opt->zero_grad();
    return loss;
  };
  for (int64_t i = 0; i < warmup; ++i) step();
  bench::synchronize(device);
  bench::reset_peak_memory(device);
  const auto start = std::chrono::steady_clock::now();
  torch::Tensor loss;
  {
    std::unique_ptr<torch::autograd::profiler::RecordProfile> profile;
    if (!get("profile", "").empty()) {
      profile = std::make_unique<torch::autograd::profiler::RecordProfile>(get("profile", ""));
    }
    for (int64_t i = 0; i < steps; ++i) loss = step();
    bench::synchronize(device);
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  nlohmann::json out;
  out["impl"] = "difftrain";
  out["config"] = config_path;
  out["device"] = device.str();
  const auto peak = bench::peak_memory(device);
  if (!peak.device_name.empty()) out["device_name"] = peak.device_name;
  out["batch"] = batch;
  out["resolution"] = resolution;
  out["mixed_precision"] = precision;
  out["lora_rank"] = lora_rank;
  out["gradient_checkpointing"] = num("gradient_checkpointing", 0) != 0;
  out["params"] = total;
  out["trainable"] = trainable_count;
  out["steps"] = steps;
  out["samples_per_s"] = static_cast<double>(steps * batch) / seconds;
  out["ms_per_step"] = 1000.0 * seconds / static_cast<double>(steps);
  out["peak_mem_gib"] = peak.gib;
  out["peak_mem_kind"] = peak.kind;
  out["final_loss"] = loss.item<double>();
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return difftrain::bench::run_main("bench_unet_step", [&] { return run(argc, argv); });
}
