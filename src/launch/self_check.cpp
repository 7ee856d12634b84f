#include "difftrain/launch/self_check.h"

#include "difftrain/core/error.h"
#include "difftrain/distributed/collectives.h"

#include <torch/torch.h>

#include <fmt/format.h>

#include <functional>
#include <ostream>

namespace difftrain::launch {

namespace {

// A check returns "" when it passes, else what it saw.
using Check = std::function<std::string(distributed::ProcessGroup&)>;

std::string expect_close(const torch::Tensor& got, const torch::Tensor& want, double tolerance) {
  if (got.sizes() != want.sizes()) {
    return fmt::format("shape {} != expected {}", c10::str(got.sizes()), c10::str(want.sizes()));
  }
  const double diff = (got.to(torch::kDouble) - want.to(torch::kDouble)).abs().max().item<double>();
  if (diff > tolerance)
    return fmt::format("max abs difference {:g} > tolerance {:g}", diff, tolerance);
  return "";
}

std::string check_all_reduce(distributed::ProcessGroup& g, distributed::ReduceOp op,
                             torch::Dtype dtype) {
  const int w = g.size(), r = g.rank();
  auto t = (torch::arange(6, torch::kDouble) + r).to(dtype);
  distributed::all_reduce(t, op, g);
  const auto i = torch::arange(6, torch::kDouble);
  torch::Tensor want;
  switch (op) {
    case distributed::ReduceOp::kSum: want = i * w + w * (w - 1) / 2.0; break;
    case distributed::ReduceOp::kMean: want = (i * w + w * (w - 1) / 2.0) / w; break;
    case distributed::ReduceOp::kMax: want = i + (w - 1); break;
    case distributed::ReduceOp::kMin: want = i; break;
  }
  return expect_close(t, want, 0.0);
}

// Deterministic values that differ per `seed`, with no global RNG (ranks may be threads).
torch::Tensor pattern(std::vector<int64_t> shape, double seed) {
  int64_t n = 1;
  for (auto d : shape) n *= d;
  return torch::sin(torch::arange(n, torch::kDouble) * 0.7 + seed).view(shape).to(torch::kFloat);
}

std::string check_broadcast_model(distributed::ProcessGroup& g) {
  torch::nn::Linear model(torch::nn::LinearOptions(5, 3));  // a different model on every rank
  torch::NoGradGuard no_grad;
  model->weight.copy_(pattern({3, 5}, 10.0 * g.rank()));
  model->bias.copy_(pattern({3}, 10.0 * g.rank() + 1));
  for (auto& p : model->parameters()) distributed::broadcast(p, 0, g);
  auto mine = torch::cat({model->weight.flatten(), model->bias.flatten()});
  auto want = torch::cat({pattern({3, 5}, 0.0).flatten(), pattern({3}, 1.0)});
  return expect_close(mine, want, 0.0);
}

std::string check_all_gather(distributed::ProcessGroup& g) {
  auto t = torch::tensor({static_cast<double>(g.rank()), 10.0 * g.rank()});
  const auto gathered = distributed::all_gather(t, g);
  if (static_cast<int>(gathered.size()) != g.size()) return "wrong number of tensors";
  for (int q = 0; q < g.size(); ++q) {
    auto problem = expect_close(gathered[q], torch::tensor({1.0 * q, 10.0 * q}), 0.0);
    if (!problem.empty()) return fmt::format("from rank {}: {}", q, problem);
  }
  return "";
}

std::string check_reduce_scatter(distributed::ProcessGroup& g, distributed::ReduceOp op) {
  const int w = g.size(), r = g.rank();
  const auto j = torch::arange(2 * w, torch::kDouble).view({2 * w, 1}).repeat({1, 3});
  auto input = (j + 100.0 * r).to(torch::kFloat);
  const auto got = distributed::reduce_scatter(input, op, g);
  const auto rows = j.slice(0, 2 * r, 2 * r + 2);
  torch::Tensor want;
  if (op == distributed::ReduceOp::kSum) want = rows * w + 100.0 * w * (w - 1) / 2.0;
  if (op == distributed::ReduceOp::kMax) want = rows + 100.0 * (w - 1);
  return expect_close(got, want, 0.0);
}

std::string check_gradient_all_reduce(distributed::ProcessGroup& g) {
  const int w = g.size(), per_rank = 4;
  // The same data and model on every rank; each rank trains on its own shard of rows.
  const auto x = pattern({per_rank * w, 6}, 0.3);
  const auto y = pattern({per_rank * w, 2}, 0.9);
  torch::nn::Linear model(torch::nn::LinearOptions(6, 2));
  {
    torch::NoGradGuard no_grad;
    model->weight.copy_(pattern({2, 6}, 2.0));
    model->bias.copy_(pattern({2}, 3.0));
  }
  const auto shard_x = x.slice(0, g.rank() * per_rank, (g.rank() + 1) * per_rank);
  const auto shard_y = y.slice(0, g.rank() * per_rank, (g.rank() + 1) * per_rank);
  torch::mse_loss(model->forward(shard_x), shard_y).backward();
  for (auto& p : model->parameters())
    distributed::all_reduce(p.mutable_grad(), distributed::ReduceOp::kMean, g);
  // Reference: the full batch on one process, in float64.
  auto weight = model->weight.detach().to(torch::kDouble).requires_grad_(true);
  auto bias = model->bias.detach().to(torch::kDouble).requires_grad_(true);
  auto prediction = torch::addmm(bias, x.to(torch::kDouble), weight.t());
  torch::mse_loss(prediction, y.to(torch::kDouble)).backward();
  auto problem = expect_close(model->weight.grad(), weight.grad(), 1e-6);
  if (problem.empty()) problem = expect_close(model->bias.grad(), bias.grad(), 1e-6);
  return problem;
}

}  // namespace

int run_self_check(std::ostream& out) { return run_checks(distributed::init_process_group(), out); }

int run_checks(distributed::ProcessGroup& g, std::ostream& out) {
  const bool main = g.rank() == 0;
  if (main) {
    out << fmt::format("difftrain test: {} rank(s), backend {}, rendezvous {}\n", g.size(),
                       g.backend_name(), g.size() > 1 ? g.info().store_description() : "none");
  }
  const std::vector<std::pair<std::string, Check>> checks = {
      {"all_reduce sum (float32)",
       [](auto& g) { return check_all_reduce(g, distributed::ReduceOp::kSum, torch::kFloat); }},
      {"all_reduce sum (int64)",
       [](auto& g) { return check_all_reduce(g, distributed::ReduceOp::kSum, torch::kLong); }},
      {"all_reduce mean (float64)",
       [](auto& g) { return check_all_reduce(g, distributed::ReduceOp::kMean, torch::kDouble); }},
      {"all_reduce max",
       [](auto& g) { return check_all_reduce(g, distributed::ReduceOp::kMax, torch::kFloat); }},
      {"all_reduce min",
       [](auto& g) { return check_all_reduce(g, distributed::ReduceOp::kMin, torch::kFloat); }},
      {"broadcast of a model from rank 0", check_broadcast_model},
      {"all_gather", check_all_gather},
      {"reduce_scatter sum",
       [](auto& g) { return check_reduce_scatter(g, distributed::ReduceOp::kSum); }},
      {"reduce_scatter max",
       [](auto& g) { return check_reduce_scatter(g, distributed::ReduceOp::kMax); }},
      {"barrier",
       [](auto& g) {
         distributed::barrier(g);
         return std::string();
       }},
      {"gradient all-reduce vs. one-process float64 reference", check_gradient_all_reduce},
  };
  int failed = 0;
  for (const auto& [name, check] : checks) {
    std::string problem;
    try {
      problem = check(g);
    } catch (const std::exception& e) {
      // A failed collective leaves the group unusable: report and stop here.
      out << fmt::format("[FAIL] {} (rank {}): {}\n", name, g.rank(), e.what()) << std::flush;
      return failed + 1;
    }
    // Every rank learns whether any rank failed, so all print the same verdict.
    auto any_failed = torch::tensor({problem.empty() ? 0L : 1L});
    distributed::all_reduce(any_failed, distributed::ReduceOp::kMax, g);
    if (!problem.empty()) out << fmt::format("[FAIL] {} (rank {}): {}\n", name, g.rank(), problem);
    if (any_failed.item<long>() != 0) {
      ++failed;
    } else if (main) {
      out << "[PASS] " << name << "\n";
    }
  }
  if (main) {
    out << fmt::format("difftrain test: {} passed, {} failed on {} rank(s)\n",
                       checks.size() - failed, failed, g.size());
  }
  out << std::flush;
  return failed;
}

}  // namespace difftrain::launch
