// Mixed precision: bf16 CPU autocast of a GroupNorm model (the LibTorch 1.13 failure fixed by
// install_autocast_fixes), autocast guards, and the fp16 loss scaler against float64 maths.

#include "difftrain/accel/precision.h"
#include "difftrain/core/error.h"
#include "thread_ranks.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

namespace difftrain::accel {
namespace {

struct NormNetImpl : torch::nn::Module {
  NormNetImpl() {
    conv = register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    norm = register_module("norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(4, 8)));
    head = register_module("head", torch::nn::Linear(8, 2));
  }
  // x: [B, 3, 8, 8] -> [B, 2]
  torch::Tensor forward(const torch::Tensor& x) {
    return head->forward(torch::silu(norm->forward(conv->forward(x))).mean({2, 3}));
  }
  torch::nn::Conv2d conv{nullptr};
  torch::nn::GroupNorm norm{nullptr};
  torch::nn::Linear head{nullptr};
};
TORCH_MODULE(NormNet);

TEST(PrecisionParse, AcceptsTheThreeModesAndNamesTheValidOnes) {
  EXPECT_EQ(parse_mixed_precision("no"), MixedPrecision::kNo);
  EXPECT_EQ(parse_mixed_precision("BF16"), MixedPrecision::kBf16);
  EXPECT_EQ(parse_mixed_precision("fp16"), MixedPrecision::kFp16);
  try {
    parse_mixed_precision("fp8");
    ADD_FAILURE() << "fp8 accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'fp8' is not one of no, bf16, fp16"), std::string::npos)
        << e.what();
  }
}

TEST(PrecisionAutocast, Bf16GroupNormModelTrainsWithFp32MasterWeights) {
  install_autocast_fixes();
  torch::manual_seed(0);
  NormNet net;
  NormNet reference;
  const auto params = net->parameters();
  const auto ref_params = reference->parameters();
  {
    torch::NoGradGuard copy_guard;
    for (size_t i = 0; i < params.size(); ++i) ref_params[i].copy_(params[i]);
  }
  auto x = torch::randn({4, 3, 8, 8});
  auto y = torch::randn({4, 2});
  {
    torch::Tensor loss;
    {
      AutocastGuard autocast(MixedPrecision::kBf16, torch::kCPU);
      auto h = net->conv->forward(x);
      EXPECT_EQ(h.scalar_type(), torch::kBFloat16);  // conv runs in bf16 ...
      auto g = net->norm->forward(h);                // ... and GroupNorm no longer fails
      EXPECT_EQ(g.scalar_type(), torch::kFloat);
      loss = torch::mse_loss(net->forward(x).to(torch::kFloat), y);
    }
    {
      AutocastDisabledGuard off;
      loss.backward();
    }
    const auto ref_loss = torch::mse_loss(reference->forward(x), y);
    ref_loss.backward();
    // bf16 keeps 8 mantissa bits: ~0.4% relative error per rounding, a few roundings deep.
    const double rel =
        std::abs(loss.item<double>() - ref_loss.item<double>()) / std::abs(ref_loss.item<double>());
    std::printf("bf16 vs fp32 loss: relative diff %.3g (tolerance 2e-2)\n", rel);
    EXPECT_LT(rel, 2e-2);
    for (size_t i = 0; i < params.size(); ++i) {
      const auto& p = params[i];
      EXPECT_EQ(p.scalar_type(), torch::kFloat);         // master weights stay fp32
      EXPECT_EQ(p.grad().scalar_type(), torch::kFloat);  // and so do their gradients
      const double gdiff = (p.grad() - ref_params[i].grad()).abs().max().item<double>();
      const double gscale = ref_params[i].grad().abs().max().item<double>() + 1e-6;
      EXPECT_LT(gdiff / gscale, 5e-2) << "parameter " << i;
    }
  }
  // A few SGD steps under bf16 reduce the loss.
  torch::optim::SGD sgd(net->parameters(), 0.2);
  auto loss_at = [&]() {
    AutocastGuard autocast(MixedPrecision::kBf16, torch::kCPU);
    return torch::mse_loss(net->forward(x).to(torch::kFloat), y);
  };
  const double before = loss_at().item<double>();
  for (int i = 0; i < 20; ++i) {
    sgd.zero_grad();
    auto loss = loss_at();
    loss.backward();
    sgd.step();
  }
  const double after = loss_at().item<double>();
  std::printf("bf16 SGD: loss %.4f -> %.4f\n", before, after);
  EXPECT_LT(after, 0.9 * before);
}

TEST(PrecisionAutocast, GuardsNestAndRestore) {
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  {
    AutocastGuard outer(MixedPrecision::kBf16, torch::kCPU);
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    {
      AutocastDisabledGuard off;
      EXPECT_FALSE(at::autocast::is_cpu_enabled());
      AutocastGuard inner(MixedPrecision::kBf16, torch::kCPU);
      EXPECT_TRUE(at::autocast::is_cpu_enabled());
    }
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
    AutocastGuard none(MixedPrecision::kNo, torch::kCPU);
    EXPECT_TRUE(at::autocast::is_cpu_enabled());
  }
  EXPECT_FALSE(at::autocast::is_cpu_enabled());
  {
    // fp16 has no CPU autocast in LibTorch 1.13: the guard leaves fp32 compute.
    AutocastGuard fp16(MixedPrecision::kFp16, torch::kCPU);
    EXPECT_FALSE(at::autocast::is_cpu_enabled());
  }
}

std::vector<torch::Tensor> params_with_grads(const std::vector<double>& grads) {
  std::vector<torch::Tensor> params;
  for (double g : grads) {
    auto p = torch::zeros({3}, torch::requires_grad());
    p.mutable_grad() = torch::full({3}, g);
    params.push_back(p);
  }
  return params;
}

TEST(PrecisionScaler, UnscalesExactlyOnceAndGrowsAfterTheInterval) {
  GradScalerOptions options;
  options.growth_interval = 3;
  GradScaler scaler(options);
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.scale(torch::tensor({2.0})).item<double>(), 131072.0);
  auto params = params_with_grads({65536.0 * 0.3, -65536.0 * 1.7});
  scaler.unscale_(params);
  scaler.unscale_(params);  // a second call before update() does nothing
  // float64 reference of g / scale, compared at float32 precision.
  const double d0 = std::abs(params[0].grad()[0].item<double>() - 0.3);
  const double d1 = std::abs(params[1].grad()[0].item<double>() + 1.7);
  std::printf("unscale: max abs diff %.3g (tolerance 1e-6)\n", std::max(d0, d1));
  EXPECT_LT(std::max(d0, d1), 1e-6);
  int stepped = 0;
  EXPECT_TRUE(scaler.step(params, [&]() { ++stepped; }));
  EXPECT_EQ(stepped, 1);
  scaler.update();
  for (int i = 0; i < 2; ++i) {
    auto p = params_with_grads({1.0});
    EXPECT_TRUE(scaler.step(p, [&]() { ++stepped; }));
    scaler.update();
  }
  EXPECT_EQ(scaler.get_scale(), 131072.0);  // x2 after 3 good steps
  EXPECT_EQ(scaler.state().growth_tracker, 0);
}

TEST(PrecisionScaler, InfOrNanSkipsTheStepAndBacksOff) {
  for (double bad : {std::numeric_limits<double>::infinity(), std::nan("")}) {
    GradScaler scaler;
    auto params = params_with_grads({1.0, bad});
    int stepped = 0;
    EXPECT_FALSE(scaler.step(params, [&]() { ++stepped; }));
    EXPECT_EQ(stepped, 0);
    EXPECT_TRUE(scaler.found_inf());
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 32768.0);
    EXPECT_FALSE(scaler.found_inf());
  }
}

TEST(PrecisionScaler, StateRoundTripsAndRejectsNonsense) {
  GradScaler a;
  auto params = params_with_grads({1.0});
  a.step(params, []() {});
  a.update();
  GradScaler b;
  b.load_state(a.state());
  EXPECT_EQ(b.state().scale, a.state().scale);
  EXPECT_EQ(b.state().growth_tracker, 1);
  EXPECT_THROW(b.load_state(GradScalerState{-1.0, 0}), Error);
  GradScalerOptions bad;
  bad.backoff_factor = 2.0;
  EXPECT_THROW(GradScaler{bad}, Error);
}

TEST(PrecisionScaler, InfOnOneRankMakesEveryRankSkip) {
  std::vector<int> stepped(2, -1);
  std::vector<double> scales(2, 0);
  dist::on_ranks(2, [&](dist::ProcessGroup& g) {
    GradScaler scaler(GradScalerOptions{}, &g);
    auto params =
        params_with_grads({1.0, g.rank() == 1 ? std::numeric_limits<double>::infinity() : 2.0});
    int count = 0;
    scaler.step(params, [&]() { ++count; });
    scaler.update();
    stepped[static_cast<size_t>(g.rank())] = count;
    scales[static_cast<size_t>(g.rank())] = scaler.get_scale();
  });
  EXPECT_EQ(stepped, (std::vector<int>{0, 0}));
  EXPECT_EQ(scales, (std::vector<double>{32768.0, 32768.0}));
}

}  // namespace
}  // namespace difftrain::accel
