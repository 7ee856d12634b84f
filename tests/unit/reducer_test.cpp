// The DDP reducer with ranks as threads over a real Gloo group: bucket layout, averaged
// gradients against a single-thread recomputation, overlap, no_sync, unused and frozen
// parameters.

#include "difftrain/accel/reducer.h"
#include "difftrain/core/error.h"
#include "thread_ranks.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

#include <atomic>

namespace difftrain::accel {
namespace {

// conv + GroupNorm + linear, seeded identically on every rank.
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    norm = register_module("norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(4, 8)));
    head = register_module("head", torch::nn::Linear(8 * 4 * 4, 5));
    spare = register_module("spare", torch::nn::Linear(5, 5));
  }
  // x: [B, 3, 4, 4] -> [B, 5]; `use_spare` routes through a layer some steps skip.
  torch::Tensor forward(const torch::Tensor& x, bool use_spare = true) {
    auto h = torch::silu(norm->forward(conv->forward(x)));
    auto y = head->forward(h.flatten(1));
    return use_spare ? spare->forward(y) : y;
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::GroupNorm norm{nullptr};
  torch::nn::Linear head{nullptr}, spare{nullptr};
};
TORCH_MODULE(TinyNet);

// Ranks are threads here, so weights and inputs come from private generators (the global one
// would race between ranks).
TinyNet make_net() {
  TinyNet net;
  auto gen = at::detail::createCPUGenerator(7);
  torch::NoGradGuard no_grad;
  for (auto& p : net->parameters()) p.copy_(torch::randn(p.sizes(), gen) * 0.3);
  return net;
}

std::vector<std::pair<std::string, torch::Tensor>> named(TinyNet& net) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& item : net->named_parameters()) out.emplace_back(item.key(), item.value());
  return out;
}

torch::Tensor input_for(int rank) {
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(100 + rank));
  return torch::randn({2, 3, 4, 4}, gen);
}

// Reference: mean over ranks of each rank's local gradient, computed in one thread.
std::vector<torch::Tensor> reference_grads(int world, bool use_spare = true) {
  std::vector<torch::Tensor> sum;
  for (int r = 0; r < world; ++r) {
    auto net = make_net();
    net->forward(input_for(r), use_spare).pow(2).mean().backward();
    auto params = net->parameters();
    for (size_t i = 0; i < params.size(); ++i) {
      auto g = params[i].grad().defined() ? params[i].grad().clone() : torch::zeros_like(params[i]);
      if (sum.size() <= i) {
        sum.push_back(g);
      } else {
        sum[i] += g;
      }
    }
  }
  for (auto& g : sum) g /= world;
  return sum;
}

// Largest difference between the parameters' gradients and `want`.
double max_grad_diff(TinyNet& net, const std::vector<torch::Tensor>& want) {
  auto params = net->parameters();
  double max_diff = 0;
  for (size_t i = 0; i < params.size(); ++i) {
    max_diff = std::max(max_diff, (params[i].grad() - want[i]).abs().max().item<double>());
  }
  return max_diff;
}

TEST(AccelReducer, BucketsFollowReverseRegistrationOrderAndCap) {
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    auto net = make_net();
    ReducerOptions opts;
    opts.bucket_cap_mb = 1e-9;  // one parameter per bucket
    opts.first_bucket_cap_mb = 1e-9;
    Reducer reducer(named(net), g, opts);
    const auto buckets = reducer.bucket_names();
    ASSERT_EQ(buckets.size(), 8u);
    EXPECT_EQ(buckets.front(), std::vector<std::string>{"spare.bias"});
    EXPECT_EQ(buckets.back(), std::vector<std::string>{"conv.weight"});

    Reducer one(named(net), g, ReducerOptions{});  // 25 MiB: everything in one bucket
    EXPECT_EQ(one.num_buckets(), 1u);
  });
}

class AccelReducerWorld : public ::testing::TestWithParam<int> {};

TEST_P(AccelReducerWorld, AveragesGradientsLikeOneProcess) {
  const int world = GetParam();
  const auto want = reference_grads(world);
  for (double cap : {1e-9, 25.0}) {
    std::atomic<int> checked{0};
    distributed::on_ranks(world, [&](distributed::ProcessGroup& g) {
      auto net = make_net();
      ReducerOptions opts;
      opts.bucket_cap_mb = cap;
      opts.first_bucket_cap_mb = cap;
      Reducer reducer(named(net), g, opts);
      auto loss = net->forward(input_for(g.rank())).pow(2).mean();
      reducer.prepare_for_backward(loss);
      loss.backward();
      reducer.finish();
      const double max_diff = max_grad_diff(net, want);
      // fp32 sums of 2-3 terms in another order: a few ulps of gradients of size ~1.
      EXPECT_LT(max_diff, 1e-6) << "cap " << cap << " rank " << g.rank();
      if (g.rank() == 0) std::printf("world %d cap %g: max abs diff %.3g\n", world, cap, max_diff);
      EXPECT_EQ(reducer.stats().allreduces, static_cast<int64_t>(reducer.num_buckets()));
      if (cap < 1) {
        // Buckets other than the last one start from hooks while backward still runs.
        EXPECT_GE(reducer.stats().launched_during_backward,
                  static_cast<int64_t>(reducer.num_buckets()) - 1);
      }
      ++checked;
    });
    EXPECT_EQ(checked.load(), world);
  }
}

INSTANTIATE_TEST_SUITE_P(Worlds, AccelReducerWorld, ::testing::Values(2, 3));

TEST(AccelReducer, NoSyncKeepsGradientsLocalAndSendsNothing) {
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    auto net = make_net();
    Reducer reducer(named(net), g);
    reducer.set_sync(false);
    auto loss = net->forward(input_for(g.rank())).pow(2).mean();
    reducer.prepare_for_backward(loss);
    loss.backward();
    reducer.finish();
    EXPECT_EQ(reducer.stats().allreduces, 0);
    // Local gradient = this rank's own.
    auto solo = make_net();
    solo->forward(input_for(g.rank())).pow(2).mean().backward();
    const double diff =
        (net->conv->weight.grad() - solo->conv->weight.grad()).abs().max().item<double>();
    EXPECT_EQ(diff, 0.0);
    // Accumulating a second micro-step with sync on reduces the sum of both.
    reducer.set_sync(true);
    auto loss2 = net->forward(input_for(g.rank())).pow(2).mean();
    reducer.prepare_for_backward(loss2);
    loss2.backward();
    reducer.finish();
    const auto want = reference_grads(2);
    const double diff2 = (net->conv->weight.grad() - 2 * want[0]).abs().max().item<double>();
    EXPECT_LT(diff2, 1e-6);
  });
}

TEST(AccelReducer, UnusedParameterErrorNamesItWithoutFindUnused) {
  std::vector<std::string> messages(2);
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    auto net = make_net();
    Reducer reducer(named(net), g);
    auto loss = net->forward(input_for(g.rank()), /*use_spare=*/false).pow(2).mean();
    reducer.prepare_for_backward(loss);
    try {
      loss.backward();
      reducer.finish();
    } catch (const std::exception& e) {
      messages[static_cast<size_t>(g.rank())] = e.what();
    }
  });
  for (const auto& m : messages) {
    EXPECT_NE(m.find("spare.weight"), std::string::npos) << m;
    EXPECT_NE(m.find("find_unused_parameters"), std::string::npos) << m;
  }
}

TEST(AccelReducer, FindUnusedParametersReducesTheRest) {
  const auto want = reference_grads(2, /*use_spare=*/false);
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    auto net = make_net();
    ReducerOptions opts;
    opts.find_unused_parameters = true;
    opts.bucket_cap_mb = 1e-9;
    opts.first_bucket_cap_mb = 1e-9;
    Reducer reducer(named(net), g, opts);
    auto loss = net->forward(input_for(g.rank()), false).pow(2).mean();
    reducer.prepare_for_backward(loss);
    loss.backward();
    reducer.finish();
    const double max_diff = max_grad_diff(net, want);
    EXPECT_LT(max_diff, 1e-6);
    EXPECT_EQ(net->spare->weight.grad().abs().sum().item<double>(), 0.0);
    // The unused parameters' buckets (first in order) started before backward even ran.
    EXPECT_EQ(reducer.stats().allreduces, static_cast<int64_t>(reducer.num_buckets()));
  });
}

TEST(AccelReducer, FrozenParametersAreNeverBucketed) {
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    auto net = make_net();
    net->conv->weight.requires_grad_(false);
    net->conv->bias.requires_grad_(false);
    Reducer reducer(named(net), g);
    for (const auto& bucket : reducer.bucket_names()) {
      for (const auto& name : bucket) EXPECT_EQ(name.rfind("conv.", 0), std::string::npos);
    }
    auto loss = net->forward(input_for(g.rank())).pow(2).mean();
    reducer.prepare_for_backward(loss);
    loss.backward();
    reducer.finish();
    EXPECT_FALSE(net->conv->weight.grad().defined());
  });
}

TEST(AccelReducer, GradientsSetToNoneAreRebound) {
  const auto want = reference_grads(2);
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    auto net = make_net();
    Reducer reducer(named(net), g);
    for (auto& p : net->parameters()) p.mutable_grad() = torch::Tensor();  // zero_grad(None)
    auto loss = net->forward(input_for(g.rank())).pow(2).mean();
    reducer.prepare_for_backward(loss);
    loss.backward();
    reducer.finish();
    const double diff = (net->head->weight.grad() - want[4]).abs().max().item<double>();
    EXPECT_LT(diff, 1e-6);
  });
}

}  // namespace
}  // namespace difftrain::accel
