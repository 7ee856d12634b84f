// A frozen linear layer's input gradient through oneDNN with the weight packed for the call
// (models/kernels/packed_matmul.h): the product against float64, odd sizes, a non-contiguous
// gradient, where the path must decline (few rows, float32, a weight that trains, grad mode for a
// second-order backward), Linear (plain, under bf16 autocast, with a LoRA adapter, with a bias)
// and the int8 Linear taking it in a training step with the gradients of the plain path, and
// threads sharing one shape. On a CPU without oneDNN's blocked bf16 kernel the same tests check
// that nothing takes the path and the numbers are LibTorch's.
#include "difftrain/models/kernels/packed_matmul.h"

#include "difftrain/core/torch_compat.h"
#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/models/linear.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <thread>
#include <vector>

namespace {

using namespace difftrain;

struct PackedSwitch {
  bool before = models::packed_linear_grad_enabled();
  ~PackedSwitch() { models::set_packed_linear_grad_enabled(before); }
};

// max |a - b| / max |b|
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const auto bd = b.to(torch::kFloat64);
  return (a.to(torch::kFloat64) - bd).abs().max().item<double>() /
         std::max(bd.abs().max().item<double>(), 1e-30);
}

// Whether `f` ran the packed path (the process-wide counter moved).
template <class F>
bool took_packed_path(F&& f) {
  const int64_t before = models::packed_linear_grad_calls();
  f();
  return models::packed_linear_grad_calls() > before;
}

TEST(PackedMatmul, TheProductMatchesFloat64) {
  PackedSwitch restore;
  models::set_packed_linear_grad_enabled(true);
  std::printf("%s\n", models::packed_linear_grad_status().c_str());
  torch::manual_seed(1);
  struct Case {
    std::vector<int64_t> g_sizes;
    int64_t in;
  };
  for (const auto& c : {Case{{600, 96}, 80}, Case{{2, 300, 130}, 70}, Case{{1, 1024, 64}, 192},
                        Case{{3, 171, 48}, 33}}) {
    const int64_t out = c.g_sizes.back();
    const auto g = torch::randn(c.g_sizes).to(torch::kBFloat16);
    const auto w = (torch::randn({out, c.in}) * 0.1).to(torch::kBFloat16);
    torch::Tensor y;
    const bool packed = took_packed_path([&] { y = models::linear_input_grad(g, w); });
    EXPECT_EQ(packed, models::packed_linear_grad_available());
    auto want_sizes = c.g_sizes;
    want_sizes.back() = c.in;
    ASSERT_EQ(y.sizes().vec(), want_sizes);
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    const auto ref = g.to(torch::kFloat64).matmul(w.to(torch::kFloat64));
    // bf16 output: one rounding of a float32 sum (2^-8 relative), plus the sums' own error.
    EXPECT_LT(rel_diff(y, ref), 8e-3) << c.g_sizes << " x [" << out << ", " << c.in << "]";
    // LibTorch's product of the same operands differs from it by bf16 rounding only.
    EXPECT_LT(rel_diff(y, g.matmul(w)), 8e-3);
  }
  // A transposed (non-contiguous) gradient.
  const auto gt = torch::randn({96, 700}).to(torch::kBFloat16).t();
  const auto w = (torch::randn({96, 40}) * 0.1).to(torch::kBFloat16);
  const auto y = models::linear_input_grad(gt, w);
  EXPECT_LT(rel_diff(y, gt.to(torch::kFloat64).matmul(w.to(torch::kFloat64))), 8e-3);
}

TEST(PackedMatmul, DeclinesWhereItDoesNotApply) {
  PackedSwitch restore;
  models::set_packed_linear_grad_enabled(true);
  const auto w = torch::randn({64, 48}).to(torch::kBFloat16);
  const auto few = torch::randn({models::kPackedGradMinRows - 1, 64}).to(torch::kBFloat16);
  const auto many = torch::randn({models::kPackedGradMinRows, 64}).to(torch::kBFloat16);
  // Below the row threshold, float32, or a non-contiguous weight: LibTorch's product, bit for bit.
  for (const auto& operands : std::vector<std::pair<torch::Tensor, torch::Tensor>>{
           {few, w},
           {many.to(torch::kFloat32), w.to(torch::kFloat32)},
           {many, w.t().contiguous().t()}}) {
    // Named copies: a lambda may not capture a structured binding in C++17 (clang refuses).
    const torch::Tensor g = operands.first, wt = operands.second;
    torch::Tensor y;
    EXPECT_FALSE(took_packed_path([&] { y = models::linear_input_grad(g, wt); }));
    EXPECT_TRUE(torch::equal(y, g.matmul(wt)));
  }
  // In grad mode (create_graph) the product stays differentiable.
  auto gg = many.clone().requires_grad_();
  torch::Tensor y;
  EXPECT_FALSE(took_packed_path([&] { y = models::linear_input_grad(gg, w); }));
  EXPECT_TRUE(y.requires_grad());
  // Turned off.
  models::set_packed_linear_grad_enabled(false);
  {
    torch::NoGradGuard no_grad;
    EXPECT_FALSE(took_packed_path([&] { y = models::linear_input_grad(many, w); }));
  }
  EXPECT_TRUE(torch::equal(y, many.matmul(w)));
}

// A two-layer chain's gradients (input, LoRA, the trained second layer) with the packed path on
// and off: under bf16 autocast with a float32 input and a LoRA adapter on the frozen layer, and in
// plain bf16 (input, both layers) without one.
TEST(PackedMatmul, LinearTakesItForFrozenWeightsWithTheSameGradients) {
  PackedSwitch restore;
  torch::manual_seed(4);
  const auto make_frozen = [](bool lora) {
    models::Linear l(torch::nn::LinearOptions(96, 160));
    l->to(torch::kBFloat16);
    for (auto& p : l->parameters()) p.set_requires_grad(false);
    if (lora) {
      l->set_lora(models::LoraAdapter(torch::nn::LinearOptions(96, 160),
                                      models::LoraAdapterOptions().rank(4).alpha(4)));
      torch::NoGradGuard no_grad;
      l->lora()->up_weight().normal_(0, 0.1);
    }
    return l;
  };
  const auto x = torch::randn({2, 300, 96});
  const auto g = torch::randn({2, 300, 24});
  for (const bool autocast : {true, false}) {
    SCOPED_TRACE(autocast ? "bf16 autocast, float32 input, LoRA" : "bf16 throughout");
    auto frozen = make_frozen(autocast);
    models::Linear trained(torch::nn::LinearOptions(160, 24).bias(false));
    if (!autocast) trained->to(torch::kBFloat16);
    struct Grads {
      torch::Tensor x, lora_a, lora_b, w2;
      bool packed = false;
    };
    const auto step = [&](bool packed_on) {
      models::set_packed_linear_grad_enabled(packed_on);
      for (auto& p : frozen->parameters()) p.mutable_grad() = torch::Tensor();
      for (auto& p : trained->parameters()) p.mutable_grad() = torch::Tensor();
      auto xi = (autocast ? x : x.to(torch::kBFloat16)).clone().requires_grad_();
      Grads out;
      out.packed = took_packed_path([&] {
        const compat::AutocastRestore guard(c10::DeviceType::CPU, {autocast, torch::kBFloat16});
        auto y = trained->forward(torch::tanh(frozen->forward(xi)));
        y.to(torch::kFloat32).backward(g);
      });
      out.x = xi.grad();
      if (autocast) {
        out.lora_a = frozen->lora()->down_weight().grad();
        out.lora_b = frozen->lora()->up_weight().grad();
      }
      out.w2 = trained->weight.grad();
      return out;
    };
    const auto on = step(true), off = step(false);
    EXPECT_EQ(on.packed, models::packed_linear_grad_available());
    EXPECT_FALSE(off.packed);
    ASSERT_TRUE(on.x.defined() && on.w2.defined());
    EXPECT_EQ(on.x.scalar_type(), off.x.scalar_type());
    EXPECT_LT(rel_diff(on.x, off.x), 1e-2);
    // The adapter's and the trained layer's gradients do not go through the packed product.
    if (autocast) {
      ASSERT_TRUE(on.lora_a.defined() && on.lora_b.defined());
      EXPECT_TRUE(torch::equal(on.lora_a, off.lora_a));
      EXPECT_TRUE(torch::equal(on.lora_b, off.lora_b));
    }
    EXPECT_TRUE(torch::equal(on.w2, off.w2)) << rel_diff(on.w2, off.w2);
    EXPECT_FALSE(frozen->weight.grad().defined());
    EXPECT_FALSE(frozen->bias.grad().defined());
  }
  // A weight that trains, or no input gradient wanted: LibTorch's linear, nothing packed.
  models::set_packed_linear_grad_enabled(true);
  models::Linear plain(torch::nn::LinearOptions(96, 160));
  plain->to(torch::kBFloat16);
  const auto xb = x.to(torch::kBFloat16);
  EXPECT_FALSE(took_packed_path(
      [&] { plain->forward(xb.clone().requires_grad_()).to(torch::kFloat32).sum().backward(); }));
  ASSERT_TRUE(plain->weight.grad().defined());
  for (auto& p : plain->parameters()) p.set_requires_grad(false);
  EXPECT_FALSE(plain->forward(xb).requires_grad());
}

TEST(PackedMatmul, TheInt8LinearTakesItWithTheSameGradient) {
  PackedSwitch restore;
  torch::manual_seed(6);
  models::Linear layer(torch::nn::LinearOptions(64, 128));
  for (auto& p : layer->parameters()) p.set_requires_grad(false);
  layer->quantize_weight(models::WeightStorage::kInt8);
  const auto x = torch::randn({1, 700, 64});
  const auto g = torch::randn({1, 700, 128});
  std::vector<torch::Tensor> grads;
  std::vector<bool> packed;
  for (const bool on : {true, false}) {
    models::set_packed_linear_grad_enabled(on);
    auto xi = x.clone().requires_grad_();
    packed.push_back(took_packed_path([&] {
      const compat::AutocastRestore guard(c10::DeviceType::CPU, {true, torch::kBFloat16});
      layer->forward(xi).to(torch::kFloat32).backward(g);
    }));
    grads.push_back(xi.grad());
  }
  EXPECT_EQ(packed[0], models::packed_linear_grad_available());
  EXPECT_FALSE(packed[1]);
  EXPECT_LT(rel_diff(grads[0], grads[1]), 1e-2);
}

TEST(PackedMatmul, ThreadsShareOneShape) {
  PackedSwitch restore;
  models::set_packed_linear_grad_enabled(true);
  torch::manual_seed(8);
  const auto w = (torch::randn({128, 96}) * 0.1).to(torch::kBFloat16);
  std::vector<torch::Tensor> gs, outs(4);
  for (int i = 0; i < 4; ++i) gs.push_back(torch::randn({640, 128}).to(torch::kBFloat16));
  std::vector<std::thread> threads;
  for (int i = 0; i < 4; ++i) {
    threads.emplace_back([&, i] {
      torch::NoGradGuard no_grad;
      for (int r = 0; r < 3; ++r) outs[i] = models::linear_input_grad(gs[i], w);
    });
  }
  for (auto& t : threads) t.join();
  for (int i = 0; i < 4; ++i) {
    torch::NoGradGuard no_grad;
    EXPECT_TRUE(torch::equal(outs[i], models::linear_input_grad(gs[i], w))) << i;
  }
}

}  // namespace
