// The gpu label for issue 42's two memory tools on a CUDA device: ZeRO-Offload (the optimizer
// side in pinned host memory, stepped on the CPU, copied back) against the same run without
// offload, and 8-bit frozen base weights (int8, and fp8_e4m3 where LibTorch has float8) computing
// and backpropagating as their dequantized weights. Skipped, saying so, only on a machine without
// a CUDA device (cuda_required.h).

#include "../unit/sharding_run.h"
#include "cuda_required.h"

#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/models/linear.h"

#include <torch/torch.h>

#include <gtest/gtest.h>

namespace difftrain {
namespace {

using accel::ShardingStrategy;
using gpu_test::NoTf32;
using models::WeightStorage;
using test::sharding_run::max_diff;
using test::sharding_run::RunSpec;
using test::sharding_run::train;

// The CPU step (fused AdamW on the host) and the CUDA step round differently in the last bit;
// Adam turns that into lr-sized steps on near-zero coordinates, so the measure is the relative
// distance of the whole update (as tests/unit/sharding_test.cpp explains), 5e-3 as there.
constexpr double kOffloadTol = 5e-3;

TEST(GpuOffload, OffloadEqualsNoOffloadOnCuda) {
  REQUIRE_CUDA();
  NoTf32 strict;
  struct Case {
    int world;
    ShardingStrategy strategy;
    bool params;
  };
  for (const Case c : {Case{1, ShardingStrategy::kShardGradOp, false},
                       Case{2, ShardingStrategy::kShardOptimizer, false},
                       Case{2, ShardingStrategy::kFullShard, false},
                       Case{2, ShardingStrategy::kFullShard, true}}) {
    RunSpec base;
    base.world = c.world;  // two ranks share the GPU over Gloo
    base.strategy = c.strategy;
    const auto reference = train(base);
    RunSpec spec = base;
    spec.offload = true;
    spec.offload_params = c.params;
    const auto run = train(spec);
    const double d = max_diff(run, reference);
    std::printf("cuda, %d rank(s), %s%s: offload vs not, relative diff %.3g\n", c.world,
                accel::to_string(c.strategy), c.params ? " + parameter offload" : "", d);
    EXPECT_LT(d, kOffloadTol);
    EXPECT_EQ(run.memory.optimizer_bytes, 0);
    EXPECT_GT(run.memory.host_bytes, 0);
    EXPECT_LT(run.memory.grad_bytes, reference.memory.grad_bytes);
  }
}

TEST(GpuOffload, EightBitBaseComputesAsItsDequantizedWeightOnCuda) {
  REQUIRE_CUDA();
  NoTf32 strict;
  std::vector<WeightStorage> storages = {WeightStorage::kInt8};
  if (models::float8_available()) storages.push_back(WeightStorage::kFloat8E4M3);
  for (const auto storage : storages) {
    torch::manual_seed(3);
    models::Linear layer(torch::nn::LinearOptions(256, 192));
    for (auto& p : layer->parameters()) p.set_requires_grad(false);
    layer->to(torch::kCUDA);
    layer->quantize_weight(storage);
    EXPECT_TRUE(layer->quantized_weight().q.is_cuda());
    const auto w = layer->quantized_weight().dequantize();
    auto x = torch::randn({4, 77, 256}, torch::device(torch::kCUDA).requires_grad(true));
    auto y = layer->forward(x);
    const auto g = torch::randn_like(y);
    y.backward(g);
    auto x2 = x.detach().clone().requires_grad_(true);
    torch::linear(x2, w, layer->bias).backward(g);
    const double fwd = (y - torch::linear(x2.detach(), w, layer->bias)).abs().max().item<double>();
    const double bwd = (x.grad() - x2.grad()).abs().max().item<double>();
    std::printf("cuda %s Linear: forward %.3g, input gradient %.3g from the dequantized weight\n",
                models::to_string(storage).c_str(), fwd, bwd);
    EXPECT_LE(fwd, 1e-5);
    EXPECT_LE(bwd, 1e-5);
  }
}

}  // namespace
}  // namespace difftrain
