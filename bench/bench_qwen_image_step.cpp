// One Qwen-Image-sized LoRA training step through the Accelerator, against Diffusers' own
// QwenImageTransformer2DModel + PEFT (bench/py/diffusers_qwen_image_step.py on refstack2, torch
// 2.6), side by side (bench/qwen_image_vs_diffusers.sh): the transformer of configs/qwen-image
// (Qwen-Image's real width: 24 heads x 128 = 3072, Qwen2.5-VL's 3584-wide captions, axes_dims_rope
// 16/56/56) with its depth reduced (default 1 block of 60), random latents [B, 16, H, W] and
// caption states [B, L, 3584] with their mask; train_dreambooth_lora_qwen_image.py's step: the
// noisy latents at a random sigma, packed into 2x2 patches [B, H/2 * W/2, 64] with img_shapes
// (1, H/2, W/2), the model at timestep sigma (the script's timesteps / 1000), its output unpacked
// against noise - x0 (MSE), backward, clip_grad_norm_(1.0), AdamW; LoRA (rank r, alpha r) on the
// script's default targets to_k/to_q/to_v/to_out.0, the frozen base in the training dtype.
//
//   bench_qwen_image_step [--lora_rank 16] [--latent 64] [--text_tokens 128] [--text_padding 0]
//                         [--num_layers 1] [--batch 1] [--mixed_precision no|bf16]
//                         [--gradient_checkpointing 0|1] [--steps 3] [--warmup 1] [--threads 0]
//                         [--profile FILE]
//
// --layers is another name for --num_layers. --text_padding N marks the last N caption tokens as
// padding in the mask (0: every token real, what the script's one-caption batch gives).
// Prints one JSON line: ms per step and its parts (forward+backward, optimizer step), the
// transformer's weight count, the trainable count, the peak RSS (run one configuration per
// process) and the final loss.

#include "bench_util.h"
#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/transformers/qwen_image_transformer.h"
#include "difftrain/optim/adamw.h"
#include "source_dir.h"

#include <torch/csrc/autograd/profiler.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <string>

namespace {

using namespace difftrain;

// QwenImagePipeline._pack_latents: [B, C, H, W] -> [B, H/2 * W/2, 4C] (2x2 patches).
torch::Tensor pack_latents(const torch::Tensor& x) {
  const int64_t B = x.size(0), C = x.size(1), h = x.size(2), w = x.size(3);
  return x.view({B, C, h / 2, 2, w / 2, 2})
      .permute({0, 2, 4, 1, 3, 5})
      .reshape({B, (h / 2) * (w / 2), C * 4});
}

// QwenImagePipeline._unpack_latents: the inverse.
torch::Tensor unpack_latents(const torch::Tensor& p, int64_t h, int64_t w) {
  const int64_t B = p.size(0), C = p.size(2) / 4;
  return p.view({B, h / 2, w / 2, C, 2, 2}).permute({0, 3, 1, 4, 2, 5}).reshape({B, C, h, w});
}

int run(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) args[std::string(argv[i]).substr(2)] = argv[i + 1];
  auto get = [&](const std::string& k, const std::string& d) {
    return args.count(k) ? args[k] : d;
  };
  auto num = [&](const std::string& k, int64_t d) { return std::stoll(get(k, std::to_string(d))); };
  const int64_t lora_rank = num("lora_rank", 16), batch = num("batch", 1);
  const int64_t latent = num("latent", 64), text_tokens = num("text_tokens", 128);
  const int64_t text_padding = num("text_padding", 0);
  const int64_t steps = num("steps", 3), warmup = num("warmup", 1);
  const std::string precision = get("mixed_precision", "no");
  if (latent % 2 != 0 || text_padding < 0 || text_padding >= text_tokens) {
    throw Error("--latent must be even and --text_padding in [0, --text_tokens)");
  }
  torch::manual_seed(0);

  accel::AcceleratorOptions o;
  o.mixed_precision = precision;
  o.cpu = true;
  accel::Accelerator acc(o);
  const torch::Device device = acc.device();
  // After the Accelerator, whose thread policy (OMP_NUM_THREADS, else cores) would override it.
  if (num("threads", 0) > 0) at::set_num_threads(static_cast<int>(num("threads", 0)));

  // Qwen-Image's transformer config, depth reduced.
  auto qo = models::QwenImageTransformerOptions::load(
      std::string(difftrain_test::source_dir()) + "/configs/qwen-image/transformer/config.json");
  qo.num_layers = num("num_layers", num("layers", 1));
  models::QwenImageTransformer2DModel model(qo);
  model->set_gradient_checkpointing(num("gradient_checkpointing", 0) != 0);
  model->train();
  int64_t weight_count = 0;
  for (auto& p : model->parameters()) p.requires_grad_(false), weight_count += p.numel();
  if (precision == "bf16") model->to(torch::kBFloat16);
  models::LoraConfig lc;
  lc.rank = lora_rank;
  lc.alpha = static_cast<double>(lora_rank);
  lc.target_modules = {"to_k", "to_q", "to_v", "to_out.0"};  // the script's defaults
  models::LoraLayers lora(*model, lc);
  std::vector<torch::Tensor> params;
  int64_t trainable_count = 0;
  for (const auto& p : lora->parameters()) {
    if (p.requires_grad()) params.push_back(p), trainable_count += p.numel();
  }
  torch::optim::AdamWOptions ao(1e-4);
  ao.weight_decay(1e-4);
  auto optimizer = std::make_shared<optim::AdamW>(params, ao);
  acc.prepare_module(*lora);
  auto opt = acc.prepare_optimizer(optimizer);

  const int64_t channels = qo.in_channels / 4;  // 16: the VAE's z_dim
  const auto x0 = torch::randn({batch, channels, latent, latent});
  const auto caps = torch::randn({batch, text_tokens, qo.joint_attention_dim});
  auto mask = torch::ones({batch, text_tokens}, torch::kLong);
  if (text_padding > 0) mask.narrow(1, text_tokens - text_padding, text_padding).zero_();
  const std::vector<models::QwenImageGrids> img_shapes(
      static_cast<size_t>(batch), models::QwenImageGrids{{1, latent / 2, latent / 2}});
  const auto dtype = model->dtype();
  auto step = [&](bench::StepTimer& timer) {
    timer.start();
    auto noise = torch::randn_like(x0);
    auto sigma = torch::rand({batch});
    const auto s = sigma.view({batch, 1, 1, 1});
    auto noisy = ((1 - s) * x0 + s * noise).to(dtype);
    torch::Tensor loss;
    {
      auto autocast = acc.autocast();
      const auto out = model->forward(pack_latents(noisy), caps.to(dtype), mask, sigma, img_shapes);
      auto pred = unpack_latents(out, latent, latent).to(torch::kFloat);
      loss = torch::mse_loss(pred, noise - x0);
    }
    acc.backward(loss);
    acc.clip_grad_norm_(params, 1.0);
    timer.backward_done();
    opt->step();
    opt->zero_grad();
    timer.optimizer_done();
    return loss;
  };

  nlohmann::json out;
  out["impl"] = "difftrain";
  out["threads"] = at::get_num_threads();
  out["blocks"] = qo.num_layers;
  out["width"] = qo.inner_dim();
  out["tokens"] = {(latent / 2) * (latent / 2), text_tokens};
  out["text_padding"] = text_padding;
  out["batch"] = batch;
  out["mixed_precision"] = precision;
  out["lora_rank"] = lora_rank;
  out["weights"] = weight_count;
  out["trainable"] = trainable_count;
  bench::run_timed_steps(step, warmup, steps, get("profile", ""), device, out);
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return difftrain::bench::run_main("bench_qwen_image_step", [&] { return run(argc, argv); });
}
