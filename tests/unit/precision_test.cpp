// Mixed precision: bf16 CPU autocast of GroupNorm / LayerNorm models (the LibTorch 1.13 gap that
// install_autocast_fixes closes), autocast scopes, and the fp16 loss scaler against float64 maths.

#include "difftrain/accel/precision.h"
#include "difftrain/core/error.h"
#include "difftrain/core/torch_compat.h"
#include "thread_ranks.h"

#include <ATen/autocast_mode.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

namespace difftrain::accel {
namespace {

namespace F = torch::nn::functional;

// Tolerances for bf16 against fp32. bf16 keeps 8 significant bits (unit roundoff 2^-9 ~ 2e-3);
// our models round inputs, weights and outputs of 2-4 layers with fan-in <= 72, where rounding
// errors add up like a random walk to ~1e-2 of the values' scale. 2e-2 relative on the loss and
// 5e-2 of the largest gradient entry of each parameter leave a margin of ~2-5x over what we see,
// while a layer computed in the wrong dtype or a missing cast (errors of order 1) would fail.
constexpr double kLossRelTol = 2e-2;
constexpr double kGradRelTol = 5e-2;

// conv -> GroupNorm -> SiLU -> pool -> linear: the smallest diffusion-UNet-like stack.
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

// A diffusion transformer block in miniature: conv, GroupNorm, LayerNorm, softmax attention
// (matmul), tanh GELU, a residual, nearest upsampling and a skip concatenated in another dtype.
struct AttnNetImpl : torch::nn::Module {
  AttnNetImpl() {
    conv_in =
        register_module("conv_in", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 8, 3).padding(1)));
    norm = register_module("norm", torch::nn::GroupNorm(torch::nn::GroupNormOptions(2, 8)));
    ln = register_module("ln", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
    to_q = register_module("to_q", torch::nn::Linear(8, 8));
    to_k = register_module("to_k", torch::nn::Linear(8, 8));
    to_v = register_module("to_v", torch::nn::Linear(8, 8));
    to_out = register_module("to_out", torch::nn::Linear(8, 8));
    conv_out = register_module("conv_out", torch::nn::Conv2d(torch::nn::Conv2dOptions(11, 2, 1)));
  }
  // x: [B, 3, 4, 4] -> [B, 2, 8, 8]
  torch::Tensor forward(const torch::Tensor& x) {
    const auto b = x.size(0);
    auto h = torch::silu(norm->forward(conv_in->forward(x)));  // [B, 8, 4, 4]
    auto tokens = h.flatten(2).transpose(1, 2);                // [B, 16, 8]
    auto t = ln->forward(tokens);
    auto scores =
        torch::matmul(to_q->forward(t), to_k->forward(t).transpose(1, 2)) / std::sqrt(8.0);
    auto attn = torch::matmul(torch::softmax(scores, -1), to_v->forward(t));  // [B, 16, 8]
    // tanh GELU: LibTorch 1.13's CPU gelu_backward for the exact (erf) GELU returns garbage when
    // its incoming gradient is non-contiguous, as it is here after the transpose below; that bug
    // is independent of precision (fp32 too) and not what this test is about.
    tokens = tokens + torch::gelu(to_out->forward(attn), "tanh");
    h = tokens.transpose(1, 2).reshape({b, 8, 4, 4});
    auto up = [](const torch::Tensor& v) {
      return F::interpolate(v, F::InterpolateFuncOptions()
                                   .scale_factor(std::vector<double>{2, 2})
                                   .mode(torch::kNearest));
    };
    return conv_out->forward(torch::cat({up(h), up(x)}, 1));  // [B, 11, 8, 8] -> [B, 2, 8, 8]
  }
  torch::nn::Conv2d conv_in{nullptr}, conv_out{nullptr};
  torch::nn::GroupNorm norm{nullptr};
  torch::nn::LayerNorm ln{nullptr};
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr}, to_out{nullptr};
};
TORCH_MODULE(AttnNet);

void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  const auto src = from.parameters();
  const auto dst = to.parameters();
  for (size_t i = 0; i < src.size(); ++i) dst[i].copy_(src[i]);
}

// Largest |a - b| over every parameter's gradient, relative to that parameter's largest |b|, with
// that scale floored at 1% of the model's largest |b|: some gradients are ~0 by symmetry (the key
// bias of softmax attention cancels in the softmax), and relative to ~0 any rounding is "large".
double worst_grad_rel_diff(torch::nn::Module& a, torch::nn::Module& b) {
  const auto pa = a.parameters();
  const auto pb = b.parameters();
  double model_max = 0;
  for (const auto& p : pb) model_max = std::max(model_max, p.grad().abs().max().item<double>());
  double worst = 0;
  for (size_t i = 0; i < pa.size(); ++i) {
    EXPECT_EQ(pa[i].scalar_type(), torch::kFloat) << "parameter " << i;  // fp32 master weights
    EXPECT_EQ(pa[i].grad().scalar_type(), torch::kFloat) << "parameter " << i;
    const double diff = (pa[i].grad() - pb[i].grad()).abs().max().item<double>();
    const double scale = std::max(pb[i].grad().abs().max().item<double>(), 1e-2 * model_max);
    worst = std::max(worst, diff / scale);
  }
  return worst;
}

double rel_diff(double a, double b) { return std::abs(a - b) / std::abs(b); }

TEST(PrecisionParse, AcceptsTheThreeModesAndNamesTheValidOnes) {
  EXPECT_EQ(parse_mixed_precision("no"), MixedPrecision::kNo);
  EXPECT_EQ(parse_mixed_precision("BF16"), MixedPrecision::kBf16);
  EXPECT_EQ(parse_mixed_precision("Fp16"), MixedPrecision::kFp16);
  for (auto mp : {MixedPrecision::kNo, MixedPrecision::kBf16, MixedPrecision::kFp16}) {
    EXPECT_EQ(parse_mixed_precision(to_string(mp)), mp);
  }
  for (const char* bad : {"fp8", "none", "", "bf16 "}) {
    try {
      parse_mixed_precision(bad);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (const Error& e) {
      const std::string expected =
          std::string("mixed_precision '") + bad + "' is not one of no, bf16, fp16";
      EXPECT_EQ(std::string(e.what()), expected);
    }
  }
}

// The LibTorch 1.13 gap the fix exists for: its CPU norm kernels reject a bf16 input with fp32
// affine parameters, which is what CPU autocast hands them after a bf16 conv or linear. LibTorch
// 2.x accepts the mix (and its CPU autocast already runs the norms in fp32, so
// install_autocast_fixes() registers nothing there); there the result must equal the fp32 norm
// of the bf16 input.
TEST(PrecisionAutocast, LibTorchNormsRejectBf16InputWithFp32WeightsOnlyIn1x) {
  const auto x = torch::randn({2, 8, 4, 4}).to(torch::kBFloat16);
  const auto w = torch::ones({8});
  const auto b = torch::zeros({8});
  const auto lw = torch::ones({4});
  const auto lb = torch::zeros({4});
  for (int op = 0; op < 2; ++op) {
    const char* name = op == 0 ? "group_norm" : "layer_norm";
    auto run = [&](const torch::Tensor& in) {
      return op == 0 ? torch::group_norm(in, 4, w, b) : torch::layer_norm(in, {4}, lw, lb);
    };
    try {
      const auto mixed = run(x);
      EXPECT_GE(compat::kTorchVersion, 200) << name << " accepted mixed dtypes on LibTorch 1.x";
      const double diff =
          (mixed.to(torch::kFloat) - run(x.to(torch::kFloat))).abs().max().item<double>();
      std::printf("%s, bf16 input with fp32 weights: max |out - fp32 norm| = %.3g (tol 2e-2)\n",
                  name, diff);
      EXPECT_LT(diff, 2e-2) << name;
    } catch (const c10::Error& e) {
      EXPECT_LT(compat::kTorchVersion, 200) << name << " rejected mixed dtypes: " << e.what();
      EXPECT_NE(std::string(e.what()).find("expected scalar type BFloat16 but found Float"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(PrecisionAutocast, Bf16GroupNormModelTrainsWithFp32MasterWeights) {
  install_autocast_fixes();
  install_autocast_fixes();  // idempotent
  torch::manual_seed(0);
  NormNet net;
  NormNet reference;
  copy_parameters(*net, *reference);
  const auto x = torch::randn({4, 3, 8, 8});
  const auto y = torch::randn({4, 2});
  torch::Tensor loss;
  {
    AutocastGuard autocast(MixedPrecision::kBf16, torch::kCPU);
    const auto h = net->conv->forward(x);
    EXPECT_EQ(h.scalar_type(), torch::kBFloat16);  // the conv runs in bf16 ...
    const auto g = net->norm->forward(h);          // ... GroupNorm no longer fails, runs in fp32
    EXPECT_EQ(g.scalar_type(), torch::kFloat);
    EXPECT_EQ(torch::group_norm(h, 4).scalar_type(), torch::kFloat);  // the functional form too
    const auto out = net->forward(x);
    EXPECT_EQ(out.scalar_type(), torch::kBFloat16);  // the linear head runs in bf16
    loss = torch::mse_loss(out, y);                  // bf16 output vs fp32 target
    EXPECT_EQ(loss.scalar_type(), torch::kFloat);    // mse_loss is on autocast's fp32 list
  }
  {
    AutocastDisabledGuard off;
    loss.backward();
  }
  const auto ref_loss = torch::mse_loss(reference->forward(x), y);
  ref_loss.backward();
  const double loss_diff = rel_diff(loss.item<double>(), ref_loss.item<double>());
  const double grad_diff = worst_grad_rel_diff(*net, *reference);
  std::printf("bf16 vs fp32: loss rel diff %.3g (tolerance %.0e), grad rel diff %.3g (%.0e)\n",
              loss_diff, kLossRelTol, grad_diff, kGradRelTol);
  EXPECT_LT(loss_diff, kLossRelTol);
  EXPECT_LT(grad_diff, kGradRelTol);

  // SGD on the fp32 master weights with bf16 forward passes reduces the loss.
  torch::optim::SGD sgd(net->parameters(), 0.2);
  auto loss_at = [&]() {
    AutocastGuard autocast(MixedPrecision::kBf16, torch::kCPU);
    return torch::mse_loss(net->forward(x), y);
  };
  const double before = loss_at().item<double>();
  for (int i = 0; i < 20; ++i) {
    sgd.zero_grad();
    auto l = loss_at();
    l.backward();
    sgd.step();
  }
  const double after = loss_at().item<double>();
  std::printf("bf16 SGD, 20 steps: loss %.4f -> %.4f (expected < 0.9x)\n", before, after);
  EXPECT_LT(after, 0.9 * before);
}

TEST(PrecisionAutocast, Bf16AttentionBlockMatchesFp32) {
  torch::manual_seed(1);
  AttnNet net;
  AttnNet reference;
  copy_parameters(*net, *reference);
  const auto x = torch::randn({2, 3, 4, 4});
  const auto y = torch::randn({2, 2, 8, 8});
  torch::Tensor out;
  torch::Tensor loss;
  {
    // No explicit install: a bf16 CPU guard installs the fixes itself.
    AutocastGuard autocast(MixedPrecision::kBf16, torch::kCPU);
    EXPECT_EQ(net->ln->forward(net->to_q->forward(torch::randn({2, 8}))).scalar_type(),
              torch::kFloat);  // a bf16 linear output into LayerNorm: fp32, no error
    out = net->forward(x);
    loss = torch::mse_loss(out, y);
  }
  {
    AutocastDisabledGuard off;
    loss.backward();
  }
  EXPECT_EQ(out.scalar_type(), torch::kBFloat16);
  const auto ref_out = reference->forward(x);
  const auto ref_loss = torch::mse_loss(ref_out, y);
  ref_loss.backward();
  const double out_diff = (out.to(torch::kFloat) - ref_out).abs().max().item<double>() /
                          ref_out.abs().max().item<double>();
  const double loss_diff = rel_diff(loss.item<double>(), ref_loss.item<double>());
  const double grad_diff = worst_grad_rel_diff(*net, *reference);
  std::printf(
      "attention block bf16 vs fp32: output rel diff %.3g, loss rel diff %.3g (tolerance "
      "%.0e), grad rel diff %.3g (%.0e)\n",
      out_diff, loss_diff, kLossRelTol, grad_diff, kGradRelTol);
  EXPECT_LT(out_diff, kLossRelTol);
  EXPECT_LT(loss_diff, kLossRelTol);
  EXPECT_LT(grad_diff, kGradRelTol);
}

TEST(PrecisionAutocast, GuardsNestAndRestore) {
  ASSERT_FALSE(compat::autocast_enabled(c10::DeviceType::CPU));
  {
    AutocastGuard outer(MixedPrecision::kBf16, torch::kCPU);
    EXPECT_TRUE(compat::autocast_enabled(c10::DeviceType::CPU));
    EXPECT_EQ(compat::autocast_dtype(c10::DeviceType::CPU), at::kBFloat16);
    {
      AutocastDisabledGuard off;
      EXPECT_FALSE(compat::autocast_enabled(c10::DeviceType::CPU));
      {
        AutocastGuard inner(MixedPrecision::kBf16, torch::kCPU);
        EXPECT_TRUE(compat::autocast_enabled(c10::DeviceType::CPU));
      }
      EXPECT_FALSE(
          compat::autocast_enabled(c10::DeviceType::CPU));  // the inner guard restored "off"
    }
    EXPECT_TRUE(compat::autocast_enabled(c10::DeviceType::CPU));
    {
      AutocastGuard none(MixedPrecision::kNo, torch::kCPU);  // kNo leaves the state alone
      EXPECT_TRUE(compat::autocast_enabled(c10::DeviceType::CPU));
    }
    AutocastGuard moved(std::move(outer));  // moving hands the scope over, no double restore
    EXPECT_TRUE(compat::autocast_enabled(c10::DeviceType::CPU));
  }
  EXPECT_FALSE(compat::autocast_enabled(c10::DeviceType::CPU));
  {
    // fp16 has no CPU autocast in LibTorch 1.13: the guard leaves fp32 compute.
    AutocastGuard fp16(MixedPrecision::kFp16, torch::kCPU);
    EXPECT_FALSE(compat::autocast_enabled(c10::DeviceType::CPU));
    torch::nn::Linear lin(4, 4);
    EXPECT_EQ(lin->forward(torch::randn({1, 4})).scalar_type(), torch::kFloat);
  }
}

TEST(PrecisionAutocast, DisabledGuardComputesInFp32) {
  torch::nn::Conv2d conv(torch::nn::Conv2dOptions(3, 4, 3));
  const auto x = torch::randn({1, 3, 5, 5});
  AutocastGuard autocast(MixedPrecision::kBf16, torch::kCPU);
  EXPECT_EQ(conv->forward(x).scalar_type(), torch::kBFloat16);
  {
    AutocastDisabledGuard off;
    EXPECT_EQ(conv->forward(x).scalar_type(), torch::kFloat);
  }
  EXPECT_EQ(conv->forward(x).scalar_type(), torch::kBFloat16);
}

// Autocast caches the bf16 copy of an fp32 leaf weight (here through mm; LibTorch 1.13's CPU
// linear does not use the cache) until the outermost scope exits. An inner scope must not clear it
// early, and leaving the outermost must, or the forward after an optimizer step would still see
// the old weights.
TEST(PrecisionAutocast, OutermostScopeClearsTheCastCache) {
  const auto w = torch::randn({4, 4}).set_requires_grad(true);
  const auto x = torch::randn({2, 4});
  torch::Tensor first;
  torch::Tensor stale;
  {
    AutocastGuard outer(MixedPrecision::kBf16, torch::kCPU);
    {
      AutocastGuard inner(MixedPrecision::kBf16, torch::kCPU);
      first = torch::mm(x, w);
    }
    {
      torch::NoGradGuard no_grad;
      w.mul_(2);
    }
    stale = torch::mm(x, w);  // the cached bf16 weight survived the inner scope
  }
  AutocastGuard next(MixedPrecision::kBf16, torch::kCPU);
  const auto fresh = torch::mm(x, w);
  // Doubling is exact in bf16, so both comparisons are exact.
  const double stale_diff = (stale - first).abs().max().item<double>();
  const double fresh_diff = (fresh - 2 * first).abs().max().item<double>();
  std::printf("cast cache: stale diff %g, fresh diff %g (tolerance 0)\n", stale_diff, fresh_diff);
  EXPECT_EQ(stale_diff, 0.0);
  EXPECT_EQ(fresh_diff, 0.0);
}

// Parameters (zeros) whose gradients are copies of `grads`.
std::vector<torch::Tensor> params_with_grads(const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> params;
  for (const auto& g : grads) {
    auto p = torch::zeros_like(g).set_requires_grad(true);
    p.mutable_grad() = g.clone();
    params.push_back(p);
  }
  return params;
}

std::vector<torch::Tensor> params_with_values(const std::vector<double>& values) {
  std::vector<torch::Tensor> grads;
  for (double v : values) grads.push_back(torch::full({3}, v));
  return params_with_grads(grads);
}

TEST(PrecisionScaler, ScaleMultipliesTheLossInFp32) {
  GradScaler scaler;
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.scale(torch::tensor(2.0)).item<double>(), 131072.0);
  // 2 * 65536 overflows fp16: a reduced-precision loss is scaled in fp32.
  const auto half = scaler.scale(torch::tensor(2.0).to(torch::kHalf));
  EXPECT_EQ(half.scalar_type(), torch::kFloat);
  EXPECT_EQ(half.item<double>(), 131072.0);
}

TEST(PrecisionScaler, UnscaleMatchesFloat64DivisionOnce) {
  // 1000 is not a power of two, so 1/scale is inexact: the quotient must still be exact.
  for (double scale : {65536.0, 1000.0}) {
    for (auto dtype : {torch::kFloat, torch::kHalf, torch::kBFloat16}) {
      GradScalerOptions options;
      options.init_scale = scale;
      GradScaler scaler(options);
      torch::manual_seed(2);
      // Scaled gradients as a backward pass would leave them, representable in `dtype`.
      const auto scaled = (torch::randn({1000}) * 30).to(dtype);
      auto params = params_with_grads({scaled});
      scaler.unscale_(params);
      scaler.unscale_(params);  // a second call before update() does nothing
      // Reference: float64 quotient, rounded once to the gradient's dtype.
      const auto expected = (scaled.to(torch::kDouble) / scale).to(dtype);
      const double diff = (params[0].grad().to(torch::kDouble) - expected.to(torch::kDouble))
                              .abs()
                              .max()
                              .item<double>();
      std::printf("unscale by %g in %s: max abs diff %g (tolerance 0)\n", scale,
                  c10::toString(dtype), diff);
      EXPECT_EQ(params[0].grad().scalar_type(), dtype);
      EXPECT_EQ(diff, 0.0);
      EXPECT_FALSE(scaler.found_inf());
    }
  }
}

TEST(PrecisionScaler, InfOrNanSkipsTheStepAndBacksOff) {
  const double inf = std::numeric_limits<double>::infinity();
  for (double bad : {inf, -inf, std::nan("")}) {
    GradScaler scaler;
    auto params = params_with_values({1.0, bad});
    int stepped = 0;
    EXPECT_FALSE(scaler.step(params, [&]() { ++stepped; }));
    EXPECT_EQ(stepped, 0);
    EXPECT_TRUE(scaler.found_inf());
    scaler.update();
    EXPECT_EQ(scaler.get_scale(), 32768.0);  // x0.5
    EXPECT_EQ(scaler.state().growth_tracker, 0);
    EXPECT_FALSE(scaler.found_inf());
  }
  // A finite fp16 gradient that unscaling pushes past 65504 (scale < 1) is an inf too.
  GradScalerOptions small;
  small.init_scale = 0.5;
  GradScaler scaler(small);
  auto params = params_with_grads({torch::full({2}, 60000.0).to(torch::kHalf)});
  EXPECT_FALSE(scaler.step(params, []() {}));
  EXPECT_TRUE(scaler.found_inf());
}

TEST(PrecisionScaler, GrowsAfterGrowthIntervalGoodSteps) {
  GradScalerOptions options;
  options.growth_interval = 3;
  GradScaler scaler(options);
  int stepped = 0;
  auto good_step = [&]() {
    auto p = params_with_values({0.5});
    EXPECT_TRUE(scaler.step(p, [&]() { ++stepped; }));
    scaler.update();
  };
  good_step();
  good_step();
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  EXPECT_EQ(scaler.state().growth_tracker, 2);
  good_step();
  EXPECT_EQ(scaler.get_scale(), 131072.0);  // x2 after 3 good steps
  EXPECT_EQ(scaler.state().growth_tracker, 0);
  // A bad step resets the count: two good steps after it do not grow.
  auto bad = params_with_values({std::nan("")});
  scaler.step(bad, [&]() { ++stepped; });
  scaler.update();
  good_step();
  good_step();
  EXPECT_EQ(scaler.get_scale(), 65536.0);
  good_step();
  EXPECT_EQ(scaler.get_scale(), 131072.0);
  EXPECT_EQ(stepped, 6);
  // Never to a scale an fp32 loss cannot hold.
  GradScalerOptions huge;
  huge.init_scale = 3e38;
  huge.growth_interval = 1;
  GradScaler capped(huge);
  auto p = params_with_values({0.0});
  capped.step(p, []() {});
  capped.update();
  EXPECT_EQ(capped.get_scale(), 3e38);
}

TEST(PrecisionScaler, StateRoundTripsThroughJson) {
  GradScaler a;
  auto params = params_with_values({1.0});
  a.step(params, []() {});
  a.update();
  const nlohmann::json saved = a.state();
  EXPECT_EQ(saved.dump(), R"({"growth_tracker":1,"scale":65536.0})");
  GradScaler b;
  b.load_state(nlohmann::json::parse(saved.dump()).get<GradScalerState>());
  EXPECT_EQ(b.state().scale, a.state().scale);
  EXPECT_EQ(b.state().growth_tracker, 1);

  EXPECT_THROW(b.load_state(GradScalerState{-1.0, 0}), Error);
  EXPECT_THROW(b.load_state(GradScalerState{65536.0, -1}), Error);
  for (const char* bad : {R"({"scale": 2.0})", R"({"scale": "2", "growth_tracker": 0})",
                          R"({"scale": 0.0, "growth_tracker": 0})", "[1, 2]"}) {
    EXPECT_THROW(nlohmann::json::parse(bad).get<GradScalerState>(), Error) << bad;
  }
  try {
    nlohmann::json::parse(R"({"scale": 2.0})").get<GradScalerState>();
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no numeric 'growth_tracker'"), std::string::npos)
        << e.what();
  }
  GradScalerOptions options;
  options.backoff_factor = 2.0;
  EXPECT_THROW(GradScaler{options}, Error);
}

TEST(PrecisionScaler, InfOnOneRankMakesEveryRankSkip) {
  std::vector<std::vector<int>> stepped(2);
  std::vector<std::vector<double>> scales(2);
  std::vector<double> unscaled(2, 0);
  distributed::on_ranks(2, [&](distributed::ProcessGroup& g) {
    const auto r = static_cast<size_t>(g.rank());
    GradScaler scaler(GradScalerOptions{}, &g);
    // Step 1: inf only on rank 1. Step 2: finite everywhere.
    for (int s = 0; s < 2; ++s) {
      const bool inject = s == 0 && g.rank() == 1;
      auto params =
          params_with_values({65536.0, inject ? std::numeric_limits<double>::infinity() : 2.0});
      int count = 0;
      scaler.step(params, [&]() { ++count; });
      if (s == 0) unscaled[r] = params[0].grad()[0].item<double>();
      scaler.update();
      stepped[r].push_back(count);
      scales[r].push_back(scaler.get_scale());
    }
  });
  for (size_t r = 0; r < 2; ++r) {
    EXPECT_EQ(stepped[r], (std::vector<int>{0, 1})) << "rank " << r;
    EXPECT_EQ(scales[r], (std::vector<double>{32768.0, 32768.0})) << "rank " << r;
    EXPECT_EQ(unscaled[r], 1.0) << "rank " << r;  // the gradients were unscaled all the same
  }
}

}  // namespace
}  // namespace difftrain::accel
