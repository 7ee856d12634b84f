// One Z-Image-sized LoRA training step through the Accelerator, against Diffusers' own
// ZImageTransformer2DModel + PEFT (bench/py/diffusers_z_image_step.py on refstack2, torch 2.6),
// side by side (bench/z_image_vs_diffusers.sh): the transformer at Z-Image's real width (dim
// 3840, 30 heads, Qwen3-4B's 2560-wide captions, axes_dims 32/48/48) with a few of its blocks
// (default 1 layer + 1 noise refiner + 1 context refiner), random latents [16, 1, H, W] and
// caption states [L, 2560]; train_dreambooth_lora_z_image.py's step: the noisy input at a random
// sigma, the model on lists with t = 1 - sigma, the negated output against noise - x0 (MSE),
// backward, clip_grad_norm_(1.0), AdamW; LoRA (rank r, alpha r) on the script's targets
// to_q/to_k/to_v/to_out.0, the frozen base in the training dtype.
//
//   bench_z_image_step [--lora_rank 16] [--latent 64] [--text_tokens 128] [--num_layers 1]
//                      [--num_refiner_layers 1] [--batch 1] [--mixed_precision no|bf16]
//                      [--gradient_checkpointing 0|1] [--steps 3] [--warmup 1] [--threads 0]
//                      [--profile FILE]
//
// Prints one JSON line: ms per step and its parts (forward+backward, optimizer step), the
// trainable count, the peak RSS (run one configuration per process) and the final loss.

#include "bench_util.h"
#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/transformers/z_image_transformer.h"
#include "difftrain/optim/adamw.h"

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

int run(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) args[std::string(argv[i]).substr(2)] = argv[i + 1];
  auto get = [&](const std::string& k, const std::string& d) {
    return args.count(k) ? args[k] : d;
  };
  auto num = [&](const std::string& k, int64_t d) { return std::stoll(get(k, std::to_string(d))); };
  const int64_t lora_rank = num("lora_rank", 16), batch = num("batch", 1);
  const int64_t latent = num("latent", 64), text_tokens = num("text_tokens", 128);
  const int64_t steps = num("steps", 3), warmup = num("warmup", 1);
  const std::string precision = get("mixed_precision", "no");
  if (num("threads", 0) > 0) at::set_num_threads(static_cast<int>(num("threads", 0)));
  torch::manual_seed(0);

  accel::AcceleratorOptions o;
  o.mixed_precision = precision;
  o.cpu = true;
  accel::Accelerator acc(o);
  const torch::Device device = acc.device();

  // Z-Image-Turbo's transformer config, depth reduced.
  models::ZImageTransformerOptions zo;
  zo.dim = 3840;
  zo.n_heads = 30;
  zo.n_kv_heads = 30;
  zo.cap_feat_dim = 2560;
  zo.axes_dims = {32, 48, 48};
  zo.axes_lens = {1024, 512, 512};
  zo.n_layers = num("num_layers", 1);
  zo.n_refiner_layers = num("num_refiner_layers", 1);
  models::ZImageTransformer2DModel model(zo);
  model->set_gradient_checkpointing(num("gradient_checkpointing", 0) != 0);
  model->train();
  for (auto& p : model->parameters()) p.requires_grad_(false);
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

  std::vector<torch::Tensor> x0, caps;
  for (int64_t b = 0; b < batch; ++b) {
    x0.push_back(torch::randn({zo.in_channels, 1, latent, latent}));
    caps.push_back(torch::randn({text_tokens, zo.cap_feat_dim}));
  }
  const auto dtype = model->dtype();
  auto step = [&](bench::StepTimer& timer) {
    timer.start();
    auto sigma = torch::rand({batch});
    std::vector<torch::Tensor> noisy, noise, c;
    for (int64_t b = 0; b < batch; ++b) {
      noise.push_back(torch::randn_like(x0[static_cast<size_t>(b)]));
      const double s = sigma[b].item<double>();
      noisy.push_back(((1 - s) * x0[static_cast<size_t>(b)] + s * noise.back()).to(dtype));
      c.push_back(caps[static_cast<size_t>(b)].to(dtype));
    }
    torch::Tensor loss;
    {
      auto autocast = acc.autocast();
      const auto out = model->forward(noisy, 1 - sigma, c);
      auto pred = -torch::stack(out).to(torch::kFloat);
      auto target = torch::stack(noise) - torch::stack(x0);
      loss = torch::mse_loss(pred, target);
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
  out["blocks"] = {zo.n_layers, zo.n_refiner_layers};
  out["width"] = zo.dim;
  out["tokens"] = {(latent / 2) * (latent / 2), text_tokens};
  out["batch"] = batch;
  out["mixed_precision"] = precision;
  out["lora_rank"] = lora_rank;
  out["trainable"] = trainable_count;
  bench::run_timed_steps(step, warmup, steps, get("profile", ""), device, out);
  std::cout << out.dump() << std::endl;
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  return difftrain::bench::run_main("bench_z_image_step", [&] { return run(argc, argv); });
}
