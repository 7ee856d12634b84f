// The fused CPU kernels (models/fused_ops.h) against float64 recomputations with LibTorch's own
// ops: attention and GroupNorm(+SiLU) outputs and every gradient, on shapes that are not multiples
// of the vector width, in contiguous and channels-last memory; then whole UNets with the kernels on
// (channels-last activations) against the same UNets with them off.
#include "difftrain/models/kernels/fused_ops.h"

#include "difftrain/models/attention.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/linear.h"
#include "difftrain/models/unets/unet.h"
#include "difftrain/models/unets/unet_config.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <limits>

namespace {

using namespace difftrain;

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// Restores the process-wide switch after a test flips it.
struct FusedSwitch {
  bool before = models::fused_kernels_enabled();
  ~FusedSwitch() { models::set_fused_kernels_enabled(before); }
};

// softmax(scale q k^T) v per head in float64: q [B, N, h*d], k, v [B, S, h*d]
torch::Tensor reference_attention(const torch::Tensor& q, const torch::Tensor& k,
                                  const torch::Tensor& v, int64_t heads) {
  const int64_t B = q.size(0), N = q.size(1), S = k.size(1), d = q.size(2) / heads;
  auto split = [&](const torch::Tensor& t, int64_t len) {
    return t.reshape({B, len, heads, d}).permute({0, 2, 1, 3});
  };
  auto p = torch::softmax(
      torch::matmul(split(q, N), split(k, S).transpose(-1, -2)) / std::sqrt(static_cast<double>(d)),
      -1);
  return torch::matmul(p, split(v, S)).permute({0, 2, 1, 3}).reshape({B, N, heads * d});
}

struct AttentionCase {
  int64_t B, N, S, heads, d;
};

TEST(FusedOps, AttentionAndItsGradientsMatchFloat64) {
  FusedSwitch restore;
  models::set_fused_kernels_enabled(true);
  std::printf("fused kernels: %s\n", models::fused_kernels_isa().c_str());
  // Widths that are and are not multiples of 8 lanes; self- and cross-attention lengths; more
  // queries than one block of the kernels (32 forward, 64 backward), with a partial last block.
  for (const auto& c : {AttentionCase{2, 37, 37, 3, 5}, AttentionCase{1, 16, 77, 2, 8},
                        AttentionCase{2, 64, 64, 2, 32}, AttentionCase{3, 9, 1, 1, 64},
                        AttentionCase{1, 150, 83, 2, 12}}) {
    torch::manual_seed(7);
    const int64_t inner = c.heads * c.d;
    auto q = torch::randn({c.B, c.N, inner}).requires_grad_();
    auto k = torch::randn({c.B, c.S, inner}).requires_grad_();
    auto v = torch::randn({c.B, c.S, inner}).requires_grad_();
    auto out = models::fused_attention(q, k, v, c.heads, 1.0 / std::sqrt(double(c.d)));
    ASSERT_TRUE(out.defined());
    auto grad = torch::randn_like(out);
    auto grads = torch::autograd::grad({out}, {q, k, v}, {grad});

    auto q64 = q.detach().to(torch::kFloat64).requires_grad_();
    auto k64 = k.detach().to(torch::kFloat64).requires_grad_();
    auto v64 = v.detach().to(torch::kFloat64).requires_grad_();
    auto ref = reference_attention(q64, k64, v64, c.heads);
    auto ref_grads = torch::autograd::grad({ref}, {q64, k64, v64}, {grad.to(torch::kFloat64)});
    const double tol = 2e-5;
    const double d_out = max_abs_diff(out, ref), d_q = max_abs_diff(grads[0], ref_grads[0]),
                 d_k = max_abs_diff(grads[1], ref_grads[1]),
                 d_v = max_abs_diff(grads[2], ref_grads[2]);
    std::printf(
        "attention B%lld N%lld S%lld h%lld d%lld: max |diff| out %.2e dq %.2e dk %.2e dv %.2e"
        " (tol %.0e)\n",
        static_cast<long long>(c.B), static_cast<long long>(c.N), static_cast<long long>(c.S),
        static_cast<long long>(c.heads), static_cast<long long>(c.d), d_out, d_q, d_k, d_v, tol);
    EXPECT_LT(d_out, tol);
    EXPECT_LT(d_q, tol);
    EXPECT_LT(d_k, tol);
    EXPECT_LT(d_v, tol);
  }
}

TEST(FusedOps, AttentionDeclinesWhatItDoesNotCover) {
  FusedSwitch restore;
  models::set_fused_kernels_enabled(true);
  auto q = torch::randn({1, 4, 16});
  EXPECT_FALSE(models::fused_attention(q.to(torch::kFloat64), q.to(torch::kFloat64),
                                       q.to(torch::kFloat64), 2, 0.25)
                   .defined());
  EXPECT_FALSE(models::fused_attention(q.to(torch::kBFloat16), q.to(torch::kBFloat16),
                                       q.to(torch::kBFloat16), 2, 0.25)
                   .defined());
  auto wide = torch::randn({1, 4, 128});
  EXPECT_FALSE(models::fused_attention(wide, wide, wide, 1, 0.1).defined());  // d 128 > 64
  models::set_fused_kernels_enabled(false);
  EXPECT_FALSE(models::fused_attention(q, q, q, 2, 0.25).defined());
}

TEST(FusedOps, GroupNormSiluAndItsGradientsMatchFloat64InBothLayouts) {
  FusedSwitch restore;
  models::set_fused_kernels_enabled(true);
  struct Layout {
    const char* name;
    std::function<torch::Tensor(const torch::Tensor&)> make;  // float32 [N, C, *] in that memory
  };
  const std::vector<Layout> layouts = {
      {"contiguous 4-d", [](const torch::Tensor& t) { return t.contiguous(); }},
      {"channels-last 4-d",
       [](const torch::Tensor& t) { return t.contiguous(at::MemoryFormat::ChannelsLast); }},
      {"transposed 3-d", [](const torch::Tensor& t) {
         // [N, C, H*W] as the transpose of a contiguous [N, H*W, C] (Attention's group_norm)
         return t.flatten(2).transpose(1, 2).contiguous().transpose(1, 2);
       }}};
  for (const auto& layout : layouts) {
    for (bool silu : {true, false}) {
      for (bool affine : {true, false}) {
        torch::manual_seed(3);
        const int64_t N = 3, C = 12, G = 4, H = 5, W = 7;
        auto base = torch::randn({N, C, H, W}) * 2 + 0.5;
        auto x = layout.make(base).detach().requires_grad_();
        torch::Tensor w, b;
        if (affine) {
          w = (torch::randn({C}) * 0.5 + 1).requires_grad_();
          b = (torch::randn({C}) * 0.3).requires_grad_();
        }
        auto y = models::group_norm_silu(x, G, w, b, 1e-5, silu);
        if (std::string(layout.name) != "transposed 3-d") {
          EXPECT_EQ(y.strides(), x.strides()) << layout.name << ": the output keeps x's layout";
        }
        auto grad = torch::randn(y.sizes());
        std::vector<torch::Tensor> inputs{x};
        if (affine) inputs.push_back(w), inputs.push_back(b);
        auto grads = torch::autograd::grad({y}, inputs, {grad});

        std::vector<torch::Tensor> inputs64;
        for (const auto& t : inputs) {
          inputs64.push_back(t.detach().to(torch::kFloat64).contiguous().requires_grad_());
        }
        auto ref = torch::group_norm(inputs64[0], G, affine ? inputs64[1] : torch::Tensor(),
                                     affine ? inputs64[2] : torch::Tensor(), 1e-5);
        if (silu) ref = torch::silu(ref);
        auto ref_grads = torch::autograd::grad({ref}, inputs64, {grad.to(torch::kFloat64)});
        const double tol = 2e-5;
        double worst = max_abs_diff(y, ref);
        for (size_t i = 0; i < grads.size(); ++i) {
          worst = std::max(worst, max_abs_diff(grads[i], ref_grads[i]) /
                                      std::max(1.0, ref_grads[i].abs().max().item<double>()));
        }
        std::printf(
            "group_norm %s silu %d affine %d: max |diff| (grads relative to their max) "
            "%.2e (tol %.0e)\n",
            layout.name, silu, affine, worst, tol);
        EXPECT_LT(worst, tol) << layout.name;
      }
    }
  }
}

// The blocked layout of the Winograd convolutions ([N, C / 16, H, W, 16]): several groups per
// 16-channel block, one group per block, and groups spanning blocks, against float64.
TEST(FusedOps, GroupNormSiluInTheBlockedLayoutMatchesFloat64) {
  FusedSwitch restore;
  models::set_fused_kernels_enabled(true);
  auto to_blocked = [](const torch::Tensor& t) {
    return t.reshape({t.size(0), t.size(1) / 16, 16, t.size(2), t.size(3)})
        .permute({0, 1, 3, 4, 2})
        .contiguous();
  };
  struct Case {
    int64_t C, G;
    bool silu, affine;
  };
  for (const auto& c : {Case{32, 8, true, true}, Case{48, 3, true, false}, Case{64, 2, false, true},
                        Case{16, 1, true, true}}) {
    torch::manual_seed(4);
    const int64_t N = 3, H = 9, W = 11;  // 99 positions: past a 64-row block, odd
    auto plain = torch::randn({N, c.C, H, W}) * 2 + 0.5;
    auto x = to_blocked(plain).requires_grad_();
    torch::Tensor w, b;
    if (c.affine) {
      w = (torch::randn({c.C}) * 0.5 + 1).requires_grad_();
      b = (torch::randn({c.C}) * 0.3).requires_grad_();
    }
    auto y = models::group_norm_silu_blocked(x, c.G, w, b, 1e-5, c.silu);
    ASSERT_TRUE(y.defined());
    ASSERT_EQ(y.sizes(), x.sizes());
    auto grad_plain = torch::randn({N, c.C, H, W});
    std::vector<torch::Tensor> inputs{x};
    if (c.affine) inputs.push_back(w), inputs.push_back(b);
    auto grads = torch::autograd::grad({y}, inputs, {to_blocked(grad_plain)});

    auto x64 = plain.to(torch::kFloat64).requires_grad_();
    std::vector<torch::Tensor> inputs64{x64};
    if (c.affine) {
      inputs64.push_back(w.detach().to(torch::kFloat64).requires_grad_());
      inputs64.push_back(b.detach().to(torch::kFloat64).requires_grad_());
    }
    auto ref = torch::group_norm(x64, c.G, c.affine ? inputs64[1] : torch::Tensor(),
                                 c.affine ? inputs64[2] : torch::Tensor(), 1e-5);
    if (c.silu) ref = torch::silu(ref);
    auto ref_grads = torch::autograd::grad({ref}, inputs64, {grad_plain.to(torch::kFloat64)});
    ref_grads[0] = to_blocked(ref_grads[0]);
    double worst = max_abs_diff(y, to_blocked(ref));
    for (size_t i = 0; i < grads.size(); ++i) {
      worst = std::max(worst, max_abs_diff(grads[i], ref_grads[i]) /
                                  std::max(1.0, ref_grads[i].abs().max().item<double>()));
    }
    std::printf("group_norm blocked C %ld G %ld silu %d affine %d: max |diff| %.2e (tol 2e-5)\n",
                c.C, c.G, c.silu, c.affine, worst);
    EXPECT_LT(worst, 2e-5);
  }
  // Not a blocked tensor (16 channels innermost), or the kernels off: declined.
  EXPECT_FALSE(models::group_norm_silu_blocked(torch::randn({2, 2, 3, 3, 8}), 2, {}, {}, 1e-5, true)
                   .defined());
  models::set_fused_kernels_enabled(false);
  EXPECT_FALSE(
      models::group_norm_silu_blocked(torch::randn({2, 2, 3, 3, 16}), 2, {}, {}, 1e-5, true)
          .defined());
}

// The pass-through variant: x' (the second output) feeding x's other consumer gives the same
// bits as using x twice (autograd then adds the two gradients itself), for the output and every
// gradient; and it works when only one of its outputs is used.
TEST(FusedOps, GroupNormPassInputEqualsUsingTheInputTwice) {
  FusedSwitch restore;
  models::set_fused_kernels_enabled(true);
  torch::manual_seed(12);
  const int64_t N = 2, C = 48, H = 7, W = 9;
  const auto x0 = torch::randn({N, C / 16, H, W, 16}) * 1.5 + 0.2;
  const auto w0 = torch::randn({C}) * 0.5 + 1, b0 = torch::randn({C}) * 0.3;
  const auto gy = torch::randn({N, C / 16, H, W, 16});
  const auto gskip = torch::randn({N, C / 16, H, W, 16});
  // loss = <y, gy> + <skip * 0.75, gskip>, skip being x itself or the pass-through
  auto run = [&](int mode) {  // 0: x twice, 1: pass-through, 2: pass-through, y only
    auto x = x0.clone().requires_grad_(), w = w0.clone().requires_grad_(),
         b = b0.clone().requires_grad_();
    torch::Tensor y, skip;
    if (mode == 0) {
      y = models::group_norm_silu_blocked(x, 4, w, b, 1e-5, true), skip = x;
    } else {
      std::tie(y, skip) = models::group_norm_silu_blocked_pass_input(x, 4, w, b, 1e-5, true);
    }
    EXPECT_TRUE(torch::equal(skip, x0));
    auto loss = (y * gy).sum();
    if (mode != 2) loss = loss + (skip * 0.75 * gskip).sum();
    auto grads = torch::autograd::grad({loss}, {x, w, b});
    grads.insert(grads.begin(), y.detach());
    return grads;
  };
  const auto twice = run(0), passed = run(1), y_only = run(2);
  const char* names[] = {"y", "dx", "dweight", "dbias"};
  for (size_t i = 0; i < twice.size(); ++i) {
    EXPECT_TRUE(torch::equal(twice[i], passed[i]))
        << names[i] << " max |diff| " << (twice[i] - passed[i]).abs().max().item<double>();
  }
  // Without the second consumer: dx is GroupNorm's alone.
  EXPECT_LT((y_only[1] - (twice[1] - gskip * 0.75)).abs().max().item<double>(), 1e-5);
  EXPECT_TRUE(torch::equal(y_only[2], twice[2]));
  models::set_fused_kernels_enabled(false);
  EXPECT_FALSE(
      models::group_norm_silu_blocked_pass_input(x0, 4, w0, b0, 1e-5, true).first.defined());
}

// The row-vectorised 3x3 convolution for 1-4 output channels (conv_out) against float64: output
// and every gradient, with and without padding and bias, on widths that are not multiples of the
// vector width; frozen tensors; what it declines; Conv2d taking it only in a training step.
TEST(FusedOps, SmallOutputConvolutionMatchesFloat64) {
  FusedSwitch restore;
  models::set_fused_kernels_enabled(true);
  struct Case {
    int64_t n, c, h, w, o, pad;
    bool bias;
  };
  for (const auto& c : {Case{2, 32, 12, 13, 1, 1, true}, Case{3, 5, 7, 9, 3, 0, false},
                        Case{1, 16, 3, 20, 4, 1, true}, Case{2, 8, 1, 1, 2, 1, true}}) {
    torch::manual_seed(6);
    auto x = torch::randn({c.n, c.c, c.h, c.w}).requires_grad_();
    auto w = (torch::randn({c.o, c.c, 3, 3}) * 0.2).requires_grad_();
    auto b = c.bias ? torch::randn({c.o}).requires_grad_() : torch::Tensor();
    auto y = models::small_out_conv2d(x, w, b, c.pad);
    ASSERT_TRUE(y.defined());
    std::vector<torch::Tensor> inputs{x, w};
    if (c.bias) inputs.push_back(b);
    std::vector<torch::Tensor> inputs64;
    for (const auto& t : inputs) {
      inputs64.push_back(t.detach().to(torch::kFloat64).requires_grad_());
    }
    auto ref =
        torch::conv2d(inputs64[0], inputs64[1], c.bias ? inputs64[2] : torch::Tensor(), 1, c.pad);
    ASSERT_EQ(y.sizes(), ref.sizes());
    auto gy = torch::randn(y.sizes());
    auto grads = torch::autograd::grad({y}, inputs, {gy});
    auto ref_grads = torch::autograd::grad({ref}, inputs64, {gy.to(torch::kFloat64)});
    double worst = max_abs_diff(y, ref) / std::max(1.0, ref.abs().max().item<double>());
    for (size_t i = 0; i < grads.size(); ++i) {
      worst = std::max(worst, max_abs_diff(grads[i], ref_grads[i]) /
                                  std::max(1.0, ref_grads[i].abs().max().item<double>()));
    }
    std::printf("small conv %ldx%ldx%ldx%ld -> %ld pad %ld: relative max diff %.2e (tol 1e-5)\n",
                c.n, c.c, c.h, c.w, c.o, c.pad, worst);
    EXPECT_LT(worst, 1e-5);
  }
  // Frozen weight and bias (LoRA): only the input's gradient, and the input not kept.
  {
    auto x = torch::randn({2, 8, 6, 6}).requires_grad_();
    auto w = torch::randn({1, 8, 3, 3});
    auto y = models::small_out_conv2d(x, w, {}, 1);
    auto gx = torch::autograd::grad({y.sum()}, {x})[0];
    auto x64 = x.detach().to(torch::kFloat64).requires_grad_();
    auto gx64 = torch::autograd::grad({torch::conv2d(x64, w.to(torch::kFloat64), {}, 1, 1).sum()},
                                      {x64})[0];
    EXPECT_LT(max_abs_diff(gx, gx64), 1e-5);
  }
  auto x = torch::randn({2, 8, 6, 6});
  EXPECT_FALSE(models::small_out_conv2d(x, torch::randn({5, 8, 3, 3}), {}, 1).defined());
  EXPECT_FALSE(models::small_out_conv2d(x, torch::randn({1, 8, 1, 1}), {}, 0).defined());
  EXPECT_FALSE(models::small_out_conv2d(x, torch::randn({1, 8, 3, 3}), {}, 2).defined());
  EXPECT_FALSE(models::small_out_conv2d(x, torch::randn({1, 4, 3, 3}), {}, 1).defined());
  EXPECT_FALSE(models::small_out_conv2d(x.to(torch::kFloat64),
                                        torch::randn({1, 8, 3, 3}, torch::kFloat64), {}, 1)
                   .defined());
  // Conv2d: the kernel in a training step; LibTorch's convolution, bit for bit, under no_grad.
  models::Conv2d conv(torch::nn::Conv2dOptions(8, 1, 3).padding(1));
  const auto direct = torch::conv2d(x, conv->weight, conv->bias, 1, 1);
  const auto trained = conv->forward(x);
  EXPECT_TRUE(torch::equal(trained, models::small_out_conv2d(x, conv->weight, conv->bias, 1)));
  EXPECT_LT(max_abs_diff(trained, direct), 1e-5);
  torch::NoGradGuard no_grad;
  EXPECT_TRUE(torch::equal(conv->forward(x), direct));
  models::set_fused_kernels_enabled(false);
  EXPECT_FALSE(models::small_out_conv2d(x, conv->weight, conv->bias, 1).defined());
}

// The kernels' inline exp at the ends of the float range: SiLU of +-200 (exp overflowing and
// underflowing), and a NaN input staying NaN rather than being clamped into a number.
TEST(FusedOps, SiluSurvivesHugeInputsAndKeepsNaN) {
  FusedSwitch restore;
  models::set_fused_kernels_enabled(true);
  auto x = torch::randn({2, 16, 4, 4});
  auto gamma = torch::full({16}, 200.f);
  auto y = models::group_norm_silu(x, 4, gamma, torch::Tensor(), 1e-5, true);
  auto ref = torch::silu(torch::group_norm(x.to(torch::kFloat64), 4, gamma.to(torch::kFloat64),
                                           torch::Tensor(), 1e-5));
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  EXPECT_LT(max_abs_diff(y, ref) / ref.abs().max().item<double>(), 1e-5);
  x[1][3][2][2] = std::numeric_limits<float>::quiet_NaN();
  y = models::group_norm_silu(x, 4, gamma, torch::Tensor(), 1e-5, true);
  EXPECT_TRUE(torch::isnan(y[1][3]).all().item<bool>()) << "NaN must propagate through the group";
  EXPECT_TRUE(torch::isfinite(y[0]).all().item<bool>());
}

TEST(FusedOps, Bf16GeluAndItsGradientMatchFloat64WithinOneRounding) {
  // bf16 values, both forms, lengths with tails and several blocks; through models::gelu and
  // autograd: each output within one bf16 rounding of float64's value of the same maths, plus a
  // float32-sized absolute term (1 + tanh(...) cancels to 0 below x = -6 in float32, as in torch;
  // the derivative crosses zero near x = -0.75).
  FusedSwitch restore;
  models::set_fused_kernels_enabled(true);
  torch::manual_seed(7);
  for (const bool tanh_form : {true, false}) {
    for (const int64_t n : {int64_t{1}, int64_t{17}, int64_t{5000}, int64_t{70001}}) {
      SCOPED_TRACE(std::string(tanh_form ? "tanh " : "erf ") + std::to_string(n));
      auto x = (torch::randn({n}) * 3).to(torch::kBFloat16);
      if (n > 8) {
        x[0] = 30.f, x[1] = -30.f, x[2] = 0.f, x[3] = -0.75f, x[4] = 1e-30f;
      }
      const auto dy = torch::randn({n}).to(torch::kBFloat16);
      ASSERT_TRUE(models::fused_gelu(x, tanh_form).defined());
      const auto xg = x.clone().requires_grad_();
      const auto y = models::gelu(xg, tanh_form);
      const auto dx = torch::autograd::grad({y}, {xg}, {dy})[0];
      EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
      EXPECT_EQ(dx.scalar_type(), torch::kBFloat16);
      const auto x64 = x.to(torch::kFloat64).requires_grad_();
      const auto y64 = torch::gelu(x64, tanh_form ? "tanh" : "none");
      const auto dx64 = torch::autograd::grad({y64}, {x64}, {dy.to(torch::kFloat64)})[0];
      const auto within = [](const torch::Tensor& a, const torch::Tensor& r, double abs) {
        const auto err = (a.to(torch::kFloat64) - r).abs();
        return (err <= r.abs() / 256 + abs).all().item<bool>();
      };
      EXPECT_TRUE(within(y, y64.detach(), 1e-6));
      EXPECT_TRUE(within(dx, dx64, 1e-5));
      // The fused form is what the flag switches: off, torch's own gelu runs.
      models::set_fused_kernels_enabled(false);
      EXPECT_FALSE(models::fused_gelu(x, tanh_form).defined());
      const auto y_torch = models::gelu(x, tanh_form);
      models::set_fused_kernels_enabled(true);
      // The same function as torch's, whose LibTorch 1.13 bf16 form rounds each intermediate to
      // bf16 (1 + tanh(...) loses everything below x = -2 or so there: absolute errors of 0.004).
      EXPECT_LT(max_abs_diff(y_torch, y), 0.02);
    }
  }
  // float32 and other devices' tensors are not its business; NaN stays NaN.
  EXPECT_FALSE(models::fused_gelu(torch::randn({4}), true).defined());
  auto nan = torch::full({3}, std::numeric_limits<float>::quiet_NaN()).to(torch::kBFloat16);
  EXPECT_TRUE(torch::isnan(models::fused_gelu(nan, true)).all().item<bool>());
}

TEST(FusedOps, GroupNormFallsBackOutsideFloat32Cpu) {
  FusedSwitch restore;
  models::set_fused_kernels_enabled(true);
  auto x = torch::randn({2, 8, 3, 3}, torch::kFloat64);
  auto y = models::group_norm_silu(x, 4, torch::Tensor(), torch::Tensor(), 1e-5, true);
  EXPECT_TRUE(torch::allclose(y, torch::silu(torch::group_norm(x, 4))));
  EXPECT_EQ(y.scalar_type(), torch::kFloat64);
}

// A whole UNet with the kernels on (channels-last activations, fused GroupNorm+SiLU, fused
// attention) against the same weights with them off: outputs and every parameter gradient.
void expect_unet_matches_unfused(const nlohmann::json& config, const models::UNetConditioning& cond,
                                 int64_t batch, int64_t channels, int64_t size) {
  FusedSwitch restore;
  torch::manual_seed(11);
  models::UNet unet(models::UNetConfig::from_json(config, "test config"));
  auto x = torch::randn({batch, channels, size, size});
  auto t = torch::randint(1000, {batch}, torch::kLong);
  auto run = [&](bool fused) {
    models::set_fused_kernels_enabled(fused);
    unet->zero_grad();
    auto out = unet->forward(x, t, cond);
    EXPECT_TRUE(out.is_contiguous());
    (out * out).sum().backward();
    std::vector<torch::Tensor> g;
    for (const auto& p : unet->parameters()) g.push_back(p.grad().clone());
    return std::make_pair(out.detach(), g);
  };
  auto [out_fused, grads_fused] = run(true);
  auto [out_plain, grads_plain] = run(false);
  double grad_rel = 0;
  for (size_t i = 0; i < grads_fused.size(); ++i) {
    const double scale = std::max(1e-3, grads_plain[i].abs().max().item<double>());
    grad_rel = std::max(grad_rel, max_abs_diff(grads_fused[i], grads_plain[i]) / scale);
  }
  const double d_out = max_abs_diff(out_fused, out_plain);
  std::printf(
      "UNet fused vs plain: max |out diff| %.2e (tol 1e-4), max grad diff relative to the "
      "tensor's max %.2e (tol 1e-3), %zu parameters\n",
      d_out, grad_rel, grads_fused.size());
  EXPECT_LT(d_out, 1e-4);
  EXPECT_LT(grad_rel, 1e-3);
}

TEST(FusedOps, UNet2DModelWithKernelsMatchesWithout) {
  const nlohmann::json config = {{"_class_name", "UNet2DModel"},
                                 {"sample_size", 16},
                                 {"in_channels", 3},
                                 {"out_channels", 3},
                                 {"layers_per_block", 1},
                                 {"block_out_channels", {16, 32}},
                                 {"down_block_types", {"DownBlock2D", "AttnDownBlock2D"}},
                                 {"up_block_types", {"AttnUpBlock2D", "UpBlock2D"}},
                                 {"norm_num_groups", 8},
                                 {"attention_head_dim", 8},
                                 {"num_class_embeds", 4}};
  models::UNetConditioning cond;
  cond.class_labels = torch::tensor({0, 3}, torch::kLong);
  expect_unet_matches_unfused(config, cond, 2, 3, 16);
}

TEST(FusedOps, UNet2DConditionModelWithKernelsMatchesWithout) {
  const nlohmann::json config = {{"_class_name", "UNet2DConditionModel"},
                                 {"sample_size", 8},
                                 {"in_channels", 4},
                                 {"out_channels", 4},
                                 {"layers_per_block", 1},
                                 {"block_out_channels", {16, 32}},
                                 {"down_block_types", {"CrossAttnDownBlock2D", "DownBlock2D"}},
                                 {"up_block_types", {"UpBlock2D", "CrossAttnUpBlock2D"}},
                                 {"norm_num_groups", 8},
                                 {"cross_attention_dim", 24},
                                 {"attention_head_dim", 4}};
  models::UNetConditioning cond;
  torch::manual_seed(5);
  cond.encoder_hidden_states = torch::randn({2, 7, 24});
  expect_unet_matches_unfused(config, cond, 2, 4, 8);
}

}  // namespace
