// A training program run under `difftrain launch` by the Accelerator's dist tests: trains a
// small conv + GroupNorm + linear model on synthetic data with the Accelerator and writes the
// final parameters (float64, registration order) of this rank to <out>.rank<r>.
//
//   accel_worker --out PATH [--steps S] [--batch B] [--samples N] [--accum K]
//                [--bucket_cap_mb X] [--precision no|bf16|fp16] [--even_batches 0|1]
//                [--split_batches 0|1] [--drop_last 0|1] [--workers W] [--overlap 0|1]
//                [--inject_inf_rank R --inject_inf_step T]

#include "difftrain/accel/accelerator.h"
#include "difftrain/core/error.h"

#include <torch/torch.h>

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <limits>
#include <map>
#include <string>

namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    conv1 =
        register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1)));
    norm1 = register_module("norm1", torch::nn::GroupNorm(torch::nn::GroupNormOptions(4, 8)));
    conv2 =
        register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(8, 8, 3).padding(1)));
    norm2 = register_module("norm2", torch::nn::GroupNorm(torch::nn::GroupNormOptions(4, 8)));
    head = register_module("head", torch::nn::Linear(8 * 8 * 8, 4));
  }
  // x: [B, 1, 8, 8] -> [B, 4]
  torch::Tensor forward(const torch::Tensor& x) {
    auto h = torch::silu(norm1->forward(conv1->forward(x)));
    h = torch::silu(norm2->forward(conv2->forward(h)));
    return head->forward(h.flatten(1));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::GroupNorm norm1{nullptr}, norm2{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(Net);

std::map<std::string, std::string> parse(int argc, char** argv) {
  std::map<std::string, std::string> args;
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string key = argv[i];
    if (key.rfind("--", 0) != 0) throw difftrain::Error("unexpected argument " + key);
    args[key.substr(2)] = argv[i + 1];
  }
  return args;
}

int run(int argc, char** argv) {
  auto args = parse(argc, argv);
  auto get = [&](const std::string& k, const std::string& d) {
    return args.count(k) ? args[k] : d;
  };
  const int64_t steps = std::stoll(get("steps", "6"));
  const int64_t batch = std::stoll(get("batch", "4"));
  const int64_t samples = std::stoll(get("samples", "96"));
  const std::string out = get("out", "");
  const int inject_rank = std::stoi(get("inject_inf_rank", "-1"));
  const int64_t inject_step = std::stoll(get("inject_inf_step", "-1"));

  difftrain::accel::AcceleratorOptions options;
  options.gradient_accumulation_steps = std::stoll(get("accum", "1"));
  options.mixed_precision = get("precision", "no");
  options.even_batches = get("even_batches", "1") == "1";
  options.split_batches = get("split_batches", "0") == "1";
  options.ddp.bucket_cap_mb = std::stod(get("bucket_cap_mb", "25"));
  options.ddp.overlap = get("overlap", "1") == "1";
  options.scaler.growth_interval = std::stoll(get("growth_interval", "2000"));
  difftrain::accel::Accelerator acc(options);

  // Synthetic regression data, identical on every rank.
  torch::manual_seed(1234);
  auto x = torch::randn({samples, 1, 8, 8});
  // A learnable target: 4 x the mean of each 4x4 quadrant (unit variance).
  auto y = 4 * torch::stack({x.slice(2, 0, 4).slice(3, 0, 4).mean({1, 2, 3}),
                             x.slice(2, 0, 4).slice(3, 4, 8).mean({1, 2, 3}),
                             x.slice(2, 4, 8).slice(3, 0, 4).mean({1, 2, 3}),
                             x.slice(2, 4, 8).slice(3, 4, 8).mean({1, 2, 3})},
                            1);
  auto dataset = std::make_shared<difftrain::data::TensorDataset>(
      difftrain::data::Example{{"x", x}, {"y", y}});
  difftrain::data::DataLoaderOptions lopts;
  lopts.batch_size = batch;
  lopts.shuffle = true;
  lopts.seed = 42;
  lopts.drop_last = get("drop_last", "0") == "1";
  lopts.num_workers = std::stoi(get("workers", "0"));
  auto loader = std::make_shared<difftrain::data::DataLoader>(dataset, lopts);

  torch::manual_seed(7);
  Net model;
  auto optimizer = std::make_shared<torch::optim::SGD>(
      model->parameters(), torch::optim::SGDOptions(0.05).momentum(0.9));
  int64_t scheduler_steps = 0;
  auto counter = std::make_shared<std::function<void()>>([&]() { ++scheduler_steps; });
  struct Sched {
    std::shared_ptr<std::function<void()>> f;
    void step() { (*f)(); }
  };
  auto [m, opt, dl, sched] =
      acc.prepare(model, optimizer, loader, std::make_shared<Sched>(Sched{counter}));

  int64_t micro = 0, updates = 0, skipped = 0;
  bool done = false;
  while (!done) {
    for (const auto& b : *dl) {
      auto step = acc.accumulate(m);
      torch::Tensor loss;
      {
        auto autocast = acc.autocast();
        loss = torch::mse_loss(m->forward(b.at("x")).to(torch::kFloat), b.at("y"));
      }
      acc.backward(loss);
      if (acc.sync_gradients() && updates + skipped == inject_step &&
          acc.process_index() == inject_rank) {
        acc.wait_for_gradients();
        m->head->weight.grad()[0][0] = std::numeric_limits<float>::infinity();
      }
      opt->step();
      sched->step();
      opt->zero_grad();
      ++micro;
      if (acc.sync_gradients()) {
        if (acc.optimizer_step_was_skipped()) {
          ++skipped;
        } else {
          ++updates;
        }
        const double mean_loss = acc.reduce(loss.detach().to(torch::kFloat), "mean").item<double>();
        acc.print("step {} loss {:.6f} scale {}", updates + skipped, mean_loss, acc.loss_scale());
        if (updates + skipped >= steps) {
          done = true;
          break;
        }
      }
    }
  }
  acc.print("done: updates {} skipped {} scheduler_steps {} micro_steps {}", updates, skipped,
            scheduler_steps, micro);
  std::printf("rank %d: updates %lld skipped %lld scheduler_steps %lld scale %g\n",
              acc.process_index(), static_cast<long long>(updates), static_cast<long long>(skipped),
              static_cast<long long>(scheduler_steps), acc.loss_scale());
  if (!out.empty()) {
    std::ofstream file(out + ".rank" + std::to_string(acc.process_index()), std::ios::binary);
    for (const auto& p : m->parameters()) {
      auto d = p.detach().to(torch::kDouble).contiguous();
      file.write(reinterpret_cast<const char*>(d.data_ptr<double>()),
                 static_cast<std::streamsize>(d.numel() * sizeof(double)));
    }
    if (!file) throw difftrain::Error("cannot write " + out);
  }
  acc.wait_for_everyone();
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
