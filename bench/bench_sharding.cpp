// Sharded training throughput and memory: samples/s of a UNet2DModel training step (forward,
// backward with the strategy's reductions, clipping, AdamW step) and the per-rank bytes the
// Accelerator measured, for one sharding strategy on however many ranks `difftrain launch` starts.
// bench/sharding_compare.sh runs every strategy side by side at 2 ranks.
//
//   bench_sharding [--strategy NO_SHARD|SHARD_OPTIMIZER|SHARD_GRAD_OP|FULL_SHARD]
//                  [--channels 64] [--resolution 32] [--batch 8] [--iters 10] [--warmup 2]
//                  [--prefetch 0|1]
//
// The model is the default trainer's UNet2DModel shape scaled by --channels (c, 2c, 2c; attention
// at the lowest level). Prints one JSON line from rank 0, including the process's peak resident
// memory (VmHWM) and the Accelerator's parameter/gradient/optimizer bytes.

#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"
#include "difftrain/models/unets/unet.h"
#include "difftrain/optim/adamw.h"

#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <map>
#include <string>

namespace {

int64_t peak_rss_bytes() {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.rfind("VmHWM:", 0) == 0) return std::stoll(line.substr(6)) * 1024;
  }
  return 0;
}

int run(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) args[std::string(argv[i]).substr(2)] = argv[i + 1];
  auto get = [&](const std::string& k, const std::string& d) {
    return args.count(k) ? args[k] : d;
  };
  const int64_t c = std::stoll(get("channels", "64"));
  const int64_t res = std::stoll(get("resolution", "32"));
  const int64_t batch = std::stoll(get("batch", "8"));
  const int iters = std::stoi(get("iters", "10"));
  const int warmup = std::stoi(get("warmup", "2"));

  difftrain::accel::AcceleratorOptions options;
  options.mixed_precision = "no";
  difftrain::accel::ShardingOptions sharding;
  sharding.strategy = difftrain::accel::parse_sharding_strategy(get("strategy", "NO_SHARD"));
  sharding.forward_prefetch = sharding.backward_prefetch = get("prefetch", "1") == "1";
  options.sharding = sharding;
  difftrain::accel::Accelerator acc(options);

  nlohmann::json config = {{"_class_name", "UNet2DModel"},
                           {"sample_size", res},
                           {"in_channels", 1},
                           {"out_channels", 1},
                           {"layers_per_block", 1},
                           {"block_out_channels", {c, 2 * c, 2 * c}},
                           {"down_block_types", {"DownBlock2D", "DownBlock2D", "AttnDownBlock2D"}},
                           {"up_block_types", {"AttnUpBlock2D", "UpBlock2D", "UpBlock2D"}},
                           {"norm_num_groups", 32},
                           {"attention_head_dim", 8}};
  torch::manual_seed(0);
  difftrain::models::UNet unet(difftrain::models::UNetConfig::from_json(config, "bench"));
  unet->train();
  int64_t params = 0;
  for (const auto& p : unet->parameters()) params += p.numel();
  auto optimizer = std::make_shared<difftrain::optim::AdamW>(unet->parameters(),
                                                             torch::optim::AdamWOptions(1e-4));
  acc.prepare_module(*unet);
  auto opt = acc.prepare_optimizer(optimizer);

  auto x = torch::randn({batch, 1, res, res});
  auto t = torch::randint(0, 1000, {batch}, torch::kLong);
  auto target = torch::randn({batch, 1, res, res});
  auto step = [&]() {
    auto loss = torch::mse_loss(unet->forward(x, t), target);
    acc.backward(loss);
    acc.clip_grad_norm_(unet->parameters(), 1.0);
    opt->step();
    opt->zero_grad();
  };
  for (int i = 0; i < warmup; ++i) step();
  acc.wait_for_everyone();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) step();
  acc.wait_for_everyone();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto m = acc.memory();
  if (acc.is_main_process()) {
    nlohmann::json out = {{"strategy", difftrain::accel::to_string(acc.sharding().strategy)},
                          {"ranks", acc.num_processes()},
                          {"threads_per_rank", at::get_num_threads()},
                          {"params", params},
                          {"batch_per_rank", batch},
                          {"prefetch", sharding.forward_prefetch},
                          {"step_ms", 1000.0 * seconds / iters},
                          {"samples_per_s", iters * batch * acc.num_processes() / seconds},
                          {"param_bytes", m.param_bytes},
                          {"param_peak_bytes", m.param_peak_bytes},
                          {"grad_bytes", m.grad_bytes},
                          {"grad_peak_bytes", m.grad_peak_bytes},
                          {"optimizer_bytes", m.optimizer_bytes},
                          {"peak_rss_bytes", peak_rss_bytes()}};
    std::printf("%s\n", out.dump().c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "bench_sharding: %s\n", e.what());
    return 1;
  }
}
