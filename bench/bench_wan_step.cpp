// One Wan-2.1-sized LoRA training step through the Accelerator, against Diffusers' own
// WanTransformer3DModel + PEFT (bench/py/diffusers_wan_step.py on refstack2, torch 2.6), side by
// side (bench/wan_vs_diffusers.sh): the transformer of configs/wan-2.1-t2v-14b (Wan 2.1 T2V 14B's
// real width: 40 heads x 128 = 5120, FFN 13824, UMT5's 4096-wide captions; --model 1.3b: 12 heads
// x 128 = 1536, FFN 8960) with its depth reduced (default 1 block of 40), random latents
// [B, 16, F, H, W] and caption states [B, L, 4096]; the flow-matching step of musubi-tuner's
// wan_train_network.py / a Diffusers-style LoRA script: the noisy latents (1 - s) x0 + s noise at
// a uniform sigma s, the model at timestep s * 1000, its output against noise - x0 (MSE),
// backward, clip_grad_norm_(1.0), AdamW; LoRA (rank r, alpha r) on musubi-tuner's default Wan
// targets (every Linear of a WanAttentionBlock: self- and cross-attention q/k/v/o and the FFN's
// two layers; in Diffusers' names attn1/attn2 to_q, to_k, to_v, to_out.0, ffn.net.0.proj,
// ffn.net.2), the frozen base in the training dtype.
//
//   bench_wan_step [--model 14b|1.3b] [--lora_rank 16] [--frames 5] [--height 16] [--width 28]
//                  [--latent N] [--text_tokens 512] [--num_layers 1] [--batch 1]
//                  [--mixed_precision no|bf16] [--gradient_checkpointing 0|1] [--steps 3]
//                  [--warmup 1] [--threads 0] [--profile FILE]
//
// --frames, --height, --width are latent units (Wan's VAE: 4x in time after the first frame, 8x in
// space): the default 5 x 16 x 28 is 17 video frames of 128 x 224 px, 560 patch tokens (the real
// 81 x 480 x 832 clip is 21 x 60 x 104: 32,760 tokens); --latent N sets height = width = N.
// --layers is another name for --num_layers. 512 caption tokens: UMT5's fixed length.
// Prints one JSON line: ms per step and its parts (forward+backward, optimizer step), the
// transformer's weight count, the trainable count, the peak RSS (run one configuration per
// process) and the final loss.

#include "bench_util.h"
#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/transformers/wan_transformer.h"
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

int run(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) args[std::string(argv[i]).substr(2)] = argv[i + 1];
  auto get = [&](const std::string& k, const std::string& d) {
    return args.count(k) ? args[k] : d;
  };
  auto num = [&](const std::string& k, int64_t d) { return std::stoll(get(k, std::to_string(d))); };
  const std::string model_name = get("model", "14b");
  if (model_name != "14b" && model_name != "1.3b") throw Error("--model must be 14b or 1.3b");
  const int64_t lora_rank = num("lora_rank", 16), batch = num("batch", 1);
  const int64_t frames = num("frames", 5), text_tokens = num("text_tokens", 512);
  const int64_t height = num("height", num("latent", 16)), width = num("width", num("latent", 28));
  const int64_t steps = num("steps", 3), warmup = num("warmup", 1);
  const std::string precision = get("mixed_precision", "no");
  if (frames < 1 || height % 2 != 0 || width % 2 != 0 || height < 2 || width < 2 ||
      text_tokens < 1) {
    throw Error("--frames must be >= 1, --height and --width even, --text_tokens >= 1");
  }
  torch::manual_seed(0);

  accel::AcceleratorOptions o;
  o.mixed_precision = precision;
  o.cpu = true;
  accel::Accelerator acc(o);
  const torch::Device device = acc.device();
  // After the Accelerator, whose thread policy (OMP_NUM_THREADS, else cores) would override it.
  if (num("threads", 0) > 0) at::set_num_threads(static_cast<int>(num("threads", 0)));

  // Wan 2.1 T2V's transformer config, depth reduced.
  auto wo = models::WanTransformerOptions::load(std::string(difftrain_test::source_dir()) +
                                                "/configs/wan-2.1-t2v-" + model_name +
                                                "/transformer/config.json");
  wo.num_layers = num("num_layers", num("layers", 1));
  models::WanTransformer3DModel model(wo);
  model->set_gradient_checkpointing(num("gradient_checkpointing", 0) != 0);
  model->train();
  int64_t weight_count = 0;
  for (auto& p : model->parameters()) p.requires_grad_(false), weight_count += p.numel();
  if (precision == "bf16") model->to_dtype(torch::kBFloat16);
  models::LoraConfig lc;
  lc.rank = lora_rank;
  lc.alpha = static_cast<double>(lora_rank);
  // musubi-tuner's networks/lora_wan.py: every Linear in a WanAttentionBlock.
  lc.target_modules = {"to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"};
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

  const auto x0 = torch::randn({batch, wo.in_channels, frames, height, width});
  const auto caps = torch::randn({batch, text_tokens, wo.text_dim});
  const auto dtype = model->dtype();
  auto step = [&](bench::StepTimer& timer) {
    timer.start();
    auto noise = torch::randn_like(x0);
    auto sigma = torch::rand({batch});
    const auto s = sigma.view({batch, 1, 1, 1, 1});
    auto noisy = ((1 - s) * x0 + s * noise).to(dtype);
    torch::Tensor loss;
    {
      auto autocast = acc.autocast();
      const auto pred = model->forward(noisy, sigma * 1000, caps.to(dtype)).to(torch::kFloat);
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
  out["model"] = model_name;
  out["threads"] = at::get_num_threads();
  out["blocks"] = wo.num_layers;
  out["width"] = wo.inner_dim();
  out["latent"] = {frames, height, width};
  out["tokens"] = {frames * (height / 2) * (width / 2), text_tokens};
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
  return difftrain::bench::run_main("bench_wan_step", [&] { return run(argc, argv); });
}
