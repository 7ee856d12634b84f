// DDP throughput: samples/s of a training step (forward, backward with bucketed all-reduce,
// SGD step) for the Accelerator on however many ranks `difftrain launch` starts. Run it through
// bench/ddp_scaling.sh, which compares 1 rank with 2 ranks, overlap on and off, in one run.
//
//   bench_ddp [--model conv|wide] [--batch B] [--iters N] [--warmup W] [--overlap 0|1]
//             [--bucket_cap_mb X] [--ddp 0|1]
//
// conv: a UNet-like stack of 3x3 convolutions + GroupNorm at 32x32 (compute-heavy, 0.15 M
// parameters). wide: the same trunk plus a 2-layer MLP head of 4 M parameters, so that the
// gradient all-reduce (17 MB) is comparable to the backward time and overlap matters.
// Prints one JSON line from rank 0.

#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"

#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <string>

namespace {

struct BenchNetImpl : torch::nn::Module {
  BenchNetImpl(int64_t width, bool wide) : wide_(wide) {
    stem = register_module("stem",
                           torch::nn::Conv2d(torch::nn::Conv2dOptions(3, width, 3).padding(1)));
    for (int i = 0; i < 4; ++i) {
      convs->push_back(torch::nn::Conv2d(torch::nn::Conv2dOptions(width, width, 3).padding(1)));
      norms->push_back(torch::nn::GroupNorm(torch::nn::GroupNormOptions(8, width)));
    }
    register_module("convs", convs);
    register_module("norms", norms);
    const int64_t features = wide ? width * 8 * 8 : width;
    fc1 = register_module("fc1", torch::nn::Linear(features, wide ? 1024 : 64));
    fc2 = register_module("fc2", torch::nn::Linear(wide ? 1024 : 64, 10));
  }
  // x: [B, 3, 32, 32] -> [B, 10]
  torch::Tensor forward(torch::Tensor x) {
    x = stem->forward(x);
    for (size_t i = 0; i < convs->size(); ++i) {
      x = x + convs[i]->as<torch::nn::Conv2d>()->forward(
                  torch::silu(norms[i]->as<torch::nn::GroupNorm>()->forward(x)));
    }
    x = wide_ ? torch::adaptive_avg_pool2d(x, {8, 8}).flatten(1) : x.mean({2, 3});
    return fc2->forward(torch::silu(fc1->forward(x)));
  }
  bool wide_;
  torch::nn::Conv2d stem{nullptr};
  torch::nn::ModuleList convs, norms;
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(BenchNet);

int run(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) args[std::string(argv[i]).substr(2)] = argv[i + 1];
  auto get = [&](const std::string& k, const std::string& d) {
    return args.count(k) ? args[k] : d;
  };
  const std::string model_kind = get("model", "conv");
  const int64_t batch = std::stoll(get("batch", "8"));
  const int iters = std::stoi(get("iters", "20"));
  const int warmup = std::stoi(get("warmup", "3"));

  difftrain::accel::AcceleratorOptions options;
  options.mixed_precision = "no";
  options.gradient_accumulation_steps = 1;
  options.ddp.overlap = get("overlap", "1") == "1";
  options.ddp.bucket_cap_mb = std::stod(get("bucket_cap_mb", "25"));
  difftrain::accel::Accelerator acc(options);

  torch::manual_seed(0);
  BenchNet net(64, model_kind == "wide");
  auto optimizer = std::make_shared<torch::optim::SGD>(net->parameters(), 1e-3);
  // --ddp 0: every rank trains its own copy with no communication at all, the ceiling that
  // machine contention (shared memory bandwidth, other tenants) leaves for 2 ranks.
  const bool ddp = get("ddp", "1") == "1";
  BenchNet model = ddp ? acc.prepare(net) : net;
  auto opt = acc.prepare(optimizer);
  int64_t params = 0;
  for (const auto& p : model->parameters()) params += p.numel();

  auto x = torch::randn({batch, 3, 32, 32});
  auto y = torch::randint(0, 10, {batch}, torch::kLong);
  // Time split of the measured steps: forward, backward (with the all-reduces launched in it),
  // waiting for the all-reduces still in flight, optimizer step.
  using Clock = std::chrono::steady_clock;
  double t_forward = 0, t_backward = 0, t_wait = 0, t_update = 0;
  auto seconds_since = [](Clock::time_point t) {
    return std::chrono::duration<double>(Clock::now() - t).count();
  };
  auto step = [&]() {
    auto t = Clock::now();
    auto loss = torch::cross_entropy_loss(model->forward(x), y);
    t_forward += seconds_since(t);
    t = Clock::now();
    acc.backward(loss);
    t_backward += seconds_since(t);
    t = Clock::now();
    acc.wait_for_gradients();
    t_wait += seconds_since(t);
    t = Clock::now();
    opt->step();
    opt->zero_grad();
    t_update += seconds_since(t);
  };
  for (int i = 0; i < warmup; ++i) step();
  t_forward = t_backward = t_wait = t_update = 0;
  acc.wait_for_everyone();
  const auto start = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) step();
  acc.wait_for_everyone();
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const double samples_per_s = static_cast<double>(iters * batch * acc.num_processes()) / seconds;
  const int64_t buckets =
      acc.reducers().empty() ? 0 : static_cast<int64_t>(acc.reducers()[0]->num_buckets());
  if (acc.is_main_process()) {
    std::printf(
        "{\"model\": \"%s\", \"ranks\": %d, \"threads_per_rank\": %d, \"batch_per_rank\": %lld, "
        "\"params\": %lld, \"buckets\": %lld, \"ddp\": %s, \"overlap\": %s, \"iters\": %d, "
        "\"step_ms\": %.2f, "
        "\"samples_per_s\": %.2f, \"forward_ms\": %.2f, \"backward_ms\": %.2f, \"wait_ms\": %.2f, "
        "\"update_ms\": %.2f}\n",
        model_kind.c_str(), acc.num_processes(), at::get_num_threads(),
        static_cast<long long>(batch), static_cast<long long>(params),
        static_cast<long long>(buckets), ddp ? "true" : "false",
        options.ddp.overlap ? "true" : "false", iters, 1000.0 * seconds / iters, samples_per_s,
        1000.0 * t_forward / iters, 1000.0 * t_backward / iters, 1000.0 * t_wait / iters,
        1000.0 * t_update / iters);
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
