// oneDNN's Winograd convolution (models/winograd_conv.h) against float64 recomputations with
// LibTorch's conv2d: output and every gradient, with and without bias and padding, on
// non-square maps whose sides are not multiples of the 4x4 output tile; the cases where it must
// decline; Conv2d taking it only while autograd records; threads using one shape at once; the
// blocked-layout variants (bit for bit the plain path's numbers) and ResnetBlock2D running between
// its convolutions in that layout.
// On a CPU without a oneDNN Winograd kernel the same tests check that nothing takes the path.
#include "difftrain/models/kernels/winograd_conv.h"

#include "difftrain/models/kernels/fused_ops.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/linear.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cstdio>
#include <thread>
#include <vector>

namespace {

using namespace difftrain;

// Restores the process-wide switch after a test flips it.
struct WinogradSwitch {
  bool before = models::winograd_conv_enabled();
  ~WinogradSwitch() { models::set_winograd_conv_enabled(before); }
};

// max |a - b| / max |b|: Winograd's error grows with the magnitude of the sums, not per element.
double rel_diff(const torch::Tensor& a, const torch::Tensor& b) {
  const auto bd = b.to(torch::kFloat64);
  return (a.to(torch::kFloat64) - bd).abs().max().item<double>() /
         std::max(bd.abs().max().item<double>(), 1e-30);
}

struct ConvCase {
  int64_t n, c, h, w, o, pad;
  bool bias;
};

TEST(WinogradConv, OutputAndGradientsMatchFloat64) {
  WinogradSwitch restore;
  models::set_winograd_conv_enabled(true);
  std::printf("%s\n", models::winograd_conv_status().c_str());
  for (const auto& c : {ConvCase{2, 16, 8, 8, 32, 1, true}, ConvCase{3, 32, 13, 10, 16, 0, false},
                        ConvCase{1, 48, 5, 7, 16, 1, true}, ConvCase{2, 64, 32, 32, 64, 1, true}}) {
    torch::manual_seed(3);
    auto x = torch::randn({c.n, c.c, c.h, c.w}).requires_grad_();
    auto w = (torch::randn({c.o, c.c, 3, 3}) * 0.1).requires_grad_();
    auto b = c.bias ? torch::randn({c.o}).requires_grad_() : torch::Tensor();
    auto y = models::winograd_conv2d(x, w, b, c.pad);
    if (!models::winograd_conv_available()) {
      EXPECT_FALSE(y.defined()) << "no Winograd kernel on this CPU, yet a result came back";
      continue;
    }
    ASSERT_TRUE(y.defined()) << "Winograd declined " << c.c << "->" << c.o;
    auto xd = x.detach().to(torch::kFloat64).requires_grad_();
    auto wd = w.detach().to(torch::kFloat64).requires_grad_();
    auto bd = c.bias ? b.detach().to(torch::kFloat64).requires_grad_() : torch::Tensor();
    auto ref = torch::conv2d(xd, wd, bd, 1, c.pad);
    ASSERT_EQ(y.sizes(), ref.sizes());
    auto gy = torch::randn(y.sizes());
    y.backward(gy);
    ref.backward(gy.to(torch::kFloat64));
    const double dy = rel_diff(y, ref), dx = rel_diff(x.grad(), xd.grad()),
                 dw = rel_diff(w.grad(), wd.grad());
    const double db = c.bias ? rel_diff(b.grad(), bd.grad()) : 0.0;
    std::printf(
        "%ldx%ldx%ldx%ld -> %ld pad %ld: relative max diff y %.2e dx %.2e dw %.2e db %.2e\n", c.n,
        c.c, c.h, c.w, c.o, c.pad, dy, dx, dw, db);
    // float32 direct convolutions land near 1e-7; Winograd F(4x4, 3x3) near 1e-6.
    EXPECT_LT(dy, 2e-5);
    EXPECT_LT(dx, 2e-5);
    EXPECT_LT(dw, 2e-5);
    EXPECT_LT(db, 2e-5);
  }
}

// The forward keeps the input only when a weight or bias gradient is wanted; every mix of frozen
// and trainable tensors, and a second backward over a retained graph, must give LibTorch's
// gradients.
TEST(WinogradConv, FrozenTensorsAndARetainedGraphGiveTheReferenceGradients) {
  WinogradSwitch restore;
  models::set_winograd_conv_enabled(true);
  struct Wants {
    bool x, w, b;
  };
  for (const auto& want :
       {Wants{true, true, true}, Wants{true, false, false}, Wants{false, true, false},
        Wants{true, false, true}, Wants{false, false, true}}) {
    torch::manual_seed(5);
    auto x = torch::randn({2, 32, 12, 9}).requires_grad_(want.x);
    auto w = (torch::randn({16, 32, 3, 3}) * 0.1).requires_grad_(want.w);
    auto b = torch::randn({16}).requires_grad_(want.b);
    auto y = models::winograd_conv2d(x, w, b, 1);
    if (!models::winograd_conv_available()) {  // oneDNN 3.x, or a CPU without AVX-512
      EXPECT_FALSE(y.defined()) << "no Winograd kernel on this CPU, yet a result came back";
      continue;
    }
    ASSERT_TRUE(y.defined());
    auto xd = x.detach().to(torch::kFloat64).requires_grad_(want.x);
    auto wd = w.detach().to(torch::kFloat64).requires_grad_(want.w);
    auto bd = b.detach().to(torch::kFloat64).requires_grad_(want.b);
    auto ref = torch::conv2d(xd, wd, bd, 1, 1);
    const auto gy = torch::randn(y.sizes());
    for (int pass = 1; pass <= 2; ++pass) {  // the second accumulates onto the first
      y.backward(gy, /*retain_graph=*/true);
      ref.backward(gy.to(torch::kFloat64), /*retain_graph=*/true);
      const auto label = "wants x/w/b " + std::to_string(want.x) + std::to_string(want.w) +
                         std::to_string(want.b) + ", backward " + std::to_string(pass);
      EXPECT_EQ(x.grad().defined(), want.x) << label;
      EXPECT_EQ(w.grad().defined(), want.w) << label;
      if (want.x) {
        EXPECT_LT(rel_diff(x.grad(), xd.grad()), 2e-5) << label;
      }
      if (want.w) {
        EXPECT_LT(rel_diff(w.grad(), wd.grad()), 2e-5) << label;
      }
      if (want.b) {
        EXPECT_LT(rel_diff(b.grad(), bd.grad()), 2e-5) << label;
      }
    }
  }
}

TEST(WinogradConv, DeclinesWhatItDoesNotCompute) {
  WinogradSwitch restore;
  models::set_winograd_conv_enabled(true);
  auto x = torch::randn({2, 16, 8, 8});
  auto w = torch::randn({16, 16, 3, 3});
  EXPECT_FALSE(
      models::winograd_conv2d(x.to(torch::kFloat64), w.to(torch::kFloat64), {}, 1).defined());
  EXPECT_FALSE(models::winograd_conv2d(x, torch::randn({16, 16, 1, 1}), {}, 0).defined());
  EXPECT_FALSE(models::winograd_conv2d(x, w, {}, 2).defined());
  EXPECT_FALSE(models::winograd_conv2d(x.slice(1, 0, 8), w, {}, 1).defined());  // channels differ
  EXPECT_FALSE(models::winograd_conv2d(x, w, torch::randn({3}), 1).defined());  // bias size
  // A channel count oneDNN has no Winograd kernel for (the UNet's 1-channel input): declined,
  // not an error.
  EXPECT_FALSE(
      models::winograd_conv2d(torch::randn({2, 1, 8, 8}), torch::randn({16, 1, 3, 3}), {}, 1)
          .defined());
  models::set_winograd_conv_enabled(false);
  EXPECT_FALSE(models::winograd_conv2d(x, w, {}, 1).defined());
}

TEST(WinogradConv, Conv2dTakesItOnlyWhileTraining) {
  WinogradSwitch restore;
  models::set_winograd_conv_enabled(true);
  torch::manual_seed(5);
  models::Conv2d conv(torch::nn::Conv2dOptions(32, 32, 3).padding(1));
  auto x = torch::randn({2, 32, 12, 12});
  const auto direct = torch::conv2d(x, conv->weight, conv->bias, 1, 1);
  {
    torch::NoGradGuard no_grad;  // sampling: LibTorch's direct convolution, bit for bit
    EXPECT_TRUE(torch::equal(conv->forward(x), direct));
  }
  auto y = conv->forward(x);  // grad mode on: a training step
  const double d = rel_diff(y, direct);
  std::printf("Conv2d training forward vs direct: relative max diff %.2e\n", d);
  EXPECT_LT(d, 2e-5);
  if (models::winograd_conv_available()) {
    EXPECT_FALSE(torch::equal(y, direct)) << "the Winograd path was not taken";
  } else {
    EXPECT_TRUE(torch::equal(y, direct));
  }
  // Strided layers (downsamplers) keep the direct convolution.
  models::Conv2d down(torch::nn::Conv2dOptions(32, 32, 3).stride(2).padding(1));
  EXPECT_TRUE(torch::equal(down->forward(x), torch::conv2d(x, down->weight, down->bias, 2, 1)));
}

TEST(WinogradConv, ThreadsShareAShapeAndGetTheSerialResult) {
  WinogradSwitch restore;
  models::set_winograd_conv_enabled(true);
  torch::manual_seed(9);
  auto w = torch::randn({16, 32, 3, 3}).requires_grad_();
  std::vector<torch::Tensor> xs;
  for (int i = 0; i < 3; ++i) xs.push_back(torch::randn({2, 32, 9, 9}));
  auto one = [&](const torch::Tensor& x) {
    auto y = models::winograd_conv2d(x, w, {}, 1);
    if (!y.defined()) y = torch::conv2d(x, w, {}, 1, 1);
    return torch::autograd::grad({y.square().sum()}, {w})[0];
  };
  std::vector<torch::Tensor> serial, threaded(xs.size());
  for (const auto& x : xs) serial.push_back(one(x));
  std::vector<std::thread> threads;
  for (size_t i = 0; i < xs.size(); ++i) {
    threads.emplace_back([&, i] {
      torch::set_num_threads(1);
      threaded[i] = one(xs[i]);
    });
  }
  for (auto& t : threads) t.join();
  for (size_t i = 0; i < xs.size(); ++i) {
    const double d = rel_diff(threaded[i], serial[i]);
    std::printf("thread %zu: relative max diff %.2e\n", i, d);
    EXPECT_LT(d, 1e-6);
  }
}

// [N, C, H, W] <-> oneDNN's nChw16c as a [N, C / 16, H, W, 16] tensor.
torch::Tensor to_blocked(const torch::Tensor& t) {
  return t.reshape({t.size(0), t.size(1) / 16, 16, t.size(2), t.size(3)})
      .permute({0, 1, 3, 4, 2})
      .contiguous();
}
torch::Tensor from_blocked(const torch::Tensor& t) {
  return t.permute({0, 1, 4, 2, 3}).reshape({t.size(0), t.size(1) * 16, t.size(2), t.size(3)});
}

// Either side in the blocked layout: the same numbers as the plain path, bit for bit (a layout
// conversion is exact, and the kernels see the same memory), forward and every gradient.
TEST(WinogradConv, BlockedInputsAndOutputsGiveThePlainPathsNumbers) {
  WinogradSwitch restore;
  models::set_winograd_conv_enabled(true);
  torch::manual_seed(21);
  const auto x = torch::randn({2, 32, 11, 9});
  const auto w = (torch::randn({48, 32, 3, 3}) * 0.1).requires_grad_();
  const auto b = torch::randn({48}).requires_grad_();
  const auto gy = torch::randn({2, 48, 11, 9});
  auto xp = x.clone().requires_grad_();
  const auto plain = models::winograd_conv2d(xp, w, b, 1);
  if (!models::winograd_conv_available()) {
    EXPECT_FALSE(plain.defined());
    EXPECT_FALSE(models::winograd_conv2d(to_blocked(x), w, b, 1, true, true).defined());
    return;
  }
  ASSERT_TRUE(plain.defined());
  const auto plain_grads = torch::autograd::grad({plain}, {xp, w, b}, {gy});
  for (bool x_blocked : {false, true}) {
    for (bool y_blocked : {false, true}) {
      auto xi = (x_blocked ? to_blocked(x) : x.clone()).requires_grad_();
      auto y = models::winograd_conv2d(xi, w, b, 1, x_blocked, y_blocked);
      const auto label =
          "x_blocked " + std::to_string(x_blocked) + ", y_blocked " + std::to_string(y_blocked);
      ASSERT_TRUE(y.defined()) << label;
      ASSERT_EQ(y.dim(), y_blocked ? 5 : 4) << label;
      EXPECT_TRUE(torch::equal(y_blocked ? from_blocked(y) : y, plain)) << label;
      const auto grads = torch::autograd::grad({y}, {xi, w, b}, {y_blocked ? to_blocked(gy) : gy});
      EXPECT_TRUE(torch::equal(x_blocked ? from_blocked(grads[0]) : grads[0], plain_grads[0]))
          << label;
      EXPECT_TRUE(torch::equal(grads[1], plain_grads[1])) << label;
      EXPECT_TRUE(torch::equal(grads[2], plain_grads[2])) << label;
    }
  }
  // A blocked input must really be one: 16 channels innermost.
  EXPECT_FALSE(models::winograd_conv2d(x.unsqueeze(-1), w, b, 1, true, false).defined());
}

// The layout conversions are exact and each one's gradient is the other.
TEST(WinogradConv, ChannelBlocksConvertBothWaysExactly) {
  torch::manual_seed(5);
  const auto x = torch::randn({3, 48, 5, 7});
  auto xi = x.clone().requires_grad_();
  const auto xb = models::to_channel_blocks(xi);
  ASSERT_EQ(xb.sizes(), (std::vector<int64_t>{3, 3, 5, 7, 16}));
  EXPECT_TRUE(torch::equal(xb, to_blocked(x)));
  EXPECT_TRUE(torch::equal(models::from_channel_blocks(xb), x));
  const auto gyb = torch::randn({3, 3, 5, 7, 16});
  const auto gx = torch::autograd::grad({xb}, {xi}, {gyb})[0];
  EXPECT_TRUE(torch::equal(gx, from_blocked(gyb)));
  auto bi = to_blocked(x).requires_grad_();
  const auto y = models::from_channel_blocks(bi);
  const auto gy = torch::randn({3, 48, 5, 7});
  EXPECT_TRUE(torch::equal(torch::autograd::grad({y}, {bi}, {gy})[0], to_blocked(gy)));
  // Not a multiple of 16 channels, not float32: a clear error.
  EXPECT_THROW(models::to_channel_blocks(torch::randn({1, 20, 2, 2})), c10::Error);
  EXPECT_THROW(models::to_channel_blocks(torch::randn({1, 16, 2, 2}, torch::kFloat64)), c10::Error);
}

// Concatenating straight into channel blocks is the plain concatenation converted, bit for bit,
// and each part gets its slice of the gradient.
TEST(WinogradConv, CatIntoChannelBlocksEqualsCatThenConvert) {
  torch::manual_seed(6);
  const auto a = torch::randn({2, 32, 5, 7}), b = torch::randn({2, 16, 5, 7});
  auto ai = a.clone().requires_grad_(), bi = b.clone().requires_grad_();
  const auto y = models::cat_to_channel_blocks(ai, bi);
  ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 3, 5, 7, 16}));
  EXPECT_TRUE(torch::equal(y, to_blocked(torch::cat({a, b}, 1))));
  const auto gy = torch::randn({2, 3, 5, 7, 16});
  const auto grads = torch::autograd::grad({y}, {ai, bi}, {gy});
  const auto plain = from_blocked(gy);
  EXPECT_TRUE(torch::equal(grads[0], plain.narrow(1, 0, 32)));
  EXPECT_TRUE(torch::equal(grads[1], plain.narrow(1, 32, 16)));
  // A channels-last part reads the same; parts off the 16-channel blocks are an error.
  EXPECT_TRUE(torch::equal(
      models::cat_to_channel_blocks(a.contiguous(at::MemoryFormat::ChannelsLast), b), y));
  EXPECT_THROW(models::cat_to_channel_blocks(a, torch::randn({2, 8, 5, 7})), c10::Error);
  EXPECT_THROW(models::cat_to_channel_blocks(a, torch::randn({2, 16, 5, 6})), c10::Error);
}

// A ResnetBlock2D's 1x1 conv_shortcut in the blocked layout: output and all three gradients
// against a float64 recomputation; declines what it does not compute.
TEST(WinogradConv, PointwiseBlockedConvolutionMatchesFloat64) {
  WinogradSwitch restore;
  models::set_winograd_conv_enabled(true);
  torch::manual_seed(9);
  const auto x = torch::randn({2, 48, 6, 5});
  const auto w = (torch::randn({32, 48, 1, 1}) * 0.2).requires_grad_();
  const auto b = torch::randn({32}).requires_grad_();
  if (!models::winograd_conv_available()) {
    EXPECT_FALSE(models::pointwise_conv2d_blocked(to_blocked(x), w, b).defined());
    return;
  }
  for (bool with_bias : {true, false}) {
    const auto bias = with_bias ? b : torch::Tensor();
    auto xi = to_blocked(x).requires_grad_();
    const auto y = models::pointwise_conv2d_blocked(xi, w, bias);
    ASSERT_TRUE(y.defined());
    ASSERT_EQ(y.sizes(), (std::vector<int64_t>{2, 2, 6, 5, 16}));
    const auto gy = torch::randn({2, 32, 6, 5});
    std::vector<torch::Tensor> inputs{xi, w};
    if (with_bias) inputs.push_back(b);
    const auto grads = torch::autograd::grad({y}, inputs, {to_blocked(gy)});
    // float64 reference
    auto x64 = x.to(torch::kFloat64).requires_grad_();
    auto w64 = w.detach().to(torch::kFloat64).requires_grad_();
    auto b64 = b.detach().to(torch::kFloat64).requires_grad_();
    const auto y64 = torch::conv2d(x64, w64, with_bias ? b64 : torch::Tensor());
    std::vector<torch::Tensor> inputs64{x64, w64};
    if (with_bias) inputs64.push_back(b64);
    const auto ref = torch::autograd::grad({y64}, inputs64, {gy.to(torch::kFloat64)});
    double worst = rel_diff(from_blocked(y), y64);
    worst = std::max(worst, rel_diff(from_blocked(grads[0]), ref[0]));
    for (size_t i = 1; i < ref.size(); ++i) worst = std::max(worst, rel_diff(grads[i], ref[i]));
    std::printf("pointwise blocked conv (bias %d) vs float64: relative max diff %.2e\n",
                with_bias ? 1 : 0, worst);
    EXPECT_LT(worst, 1e-5);
  }
  // Channel counts off the 16-float vectors, a 3x3 weight, a plain input, or the switch off.
  EXPECT_FALSE(
      models::pointwise_conv2d_blocked(to_blocked(x), torch::randn({24, 48, 1, 1}), b).defined());
  EXPECT_FALSE(
      models::pointwise_conv2d_blocked(to_blocked(x), torch::randn({32, 48, 3, 3}), b).defined());
  EXPECT_FALSE(models::pointwise_conv2d_blocked(x, w, b).defined());
  models::set_winograd_conv_enabled(false);
  EXPECT_FALSE(models::pointwise_conv2d_blocked(to_blocked(x), w, b).defined());
}

// Restores the blocked-layout switch.
struct BlockedSwitch {
  bool before = models::winograd_blocked_layout_enabled();
  ~BlockedSwitch() { models::set_winograd_blocked_layout_enabled(before); }
};

// ResnetBlock2D in a training step runs between its convolutions in the blocked layout; its
// output and every gradient agree with the plain path to float rounding (GroupNorm sums in another
// order), with and without a channel change, a time embedding, and a channels-last input (an
// attention block's output).
TEST(WinogradConv, ResnetBlockInTheBlockedLayoutMatchesThePlainOne) {
  WinogradSwitch restore_winograd;
  BlockedSwitch restore_blocked;
  models::set_winograd_conv_enabled(true);
  const bool fused_before = models::fused_kernels_enabled();
  models::set_fused_kernels_enabled(true);
  struct Case {
    int64_t in, out, temb, groups;
    bool channels_last;
  };
  for (const auto& c :
       {Case{32, 32, 24, 8, false}, Case{48, 32, 0, 16, false}, Case{32, 64, 24, 2, true}}) {
    torch::manual_seed(7);
    models::ResnetBlock2D block(models::ResnetBlock2DOptions(c.in, c.out)
                                    .temb_channels(c.temb)
                                    .groups(c.groups)
                                    .output_scale_factor(c.channels_last ? 2.0 : 1.0));
    for (auto& p : block->parameters()) {  // non-trivial norms and biases
      torch::NoGradGuard no_grad;
      p.add_(torch::randn(p.sizes()) * 0.1);
    }
    auto x = torch::randn({2, c.in, 10, 7});
    if (c.channels_last) x = x.contiguous(at::MemoryFormat::ChannelsLast);
    const auto temb = c.temb > 0 ? torch::randn({2, c.temb}) : torch::Tensor();
    const auto gy = torch::randn({2, c.out, 10, 7});
    auto run = [&](bool blocked) {
      models::set_winograd_blocked_layout_enabled(blocked);
      auto xi = x.clone().requires_grad_();
      auto y = block->forward(xi, temb);
      std::vector<torch::Tensor> inputs{xi};
      for (const auto& p : block->parameters()) inputs.push_back(p);
      auto grads = torch::autograd::grad({y}, inputs, {gy});
      grads.insert(grads.begin(), y.detach());
      return grads;
    };
    const auto plain = run(false);
    EXPECT_FALSE(block->last_forward_blocked());
    const auto blocked = run(true);
    const auto label = std::to_string(c.in) + "->" + std::to_string(c.out) + " groups " +
                       std::to_string(c.groups) + (c.channels_last ? " channels-last" : "");
    EXPECT_EQ(block->last_forward_blocked(), models::winograd_conv_available()) << label;
    double worst = 0;
    for (size_t i = 0; i < plain.size(); ++i)
      worst = std::max(worst, rel_diff(blocked[i], plain[i]));
    std::printf(
        "ResnetBlock2D %s blocked vs plain: relative max diff %.2e (output and %zu grads)\n",
        label.c_str(), worst, plain.size() - 1);
    EXPECT_LT(worst, 1e-5) << label;
    {
      torch::NoGradGuard no_grad;  // sampling keeps the plain path
      block->forward(x, temb);
      EXPECT_FALSE(block->last_forward_blocked()) << label;
    }
  }
  models::set_fused_kernels_enabled(fused_before);
}

// An up block's call: forward_cat(x, skip) is forward(cat(x, skip)), output and every gradient
// bit for bit, blocked or not.
TEST(WinogradConv, ResnetBlockForwardCatEqualsForwardOfTheConcatenation) {
  WinogradSwitch restore_winograd;
  models::set_winograd_conv_enabled(true);
  torch::manual_seed(8);
  models::ResnetBlock2D block(models::ResnetBlock2DOptions(48, 32).temb_channels(24).groups(8));
  const auto x = torch::randn({2, 32, 6, 5}), skip = torch::randn({2, 16, 6, 5});
  const auto temb = torch::randn({2, 24});
  const auto gy = torch::randn({2, 32, 6, 5});
  auto run = [&](bool cat_call) {
    auto xi = x.clone().requires_grad_(), si = skip.clone().requires_grad_();
    auto y =
        cat_call ? block->forward_cat(xi, si, temb) : block->forward(torch::cat({xi, si}, 1), temb);
    std::vector<torch::Tensor> inputs{xi, si};
    for (const auto& p : block->parameters()) inputs.push_back(p);
    auto grads = torch::autograd::grad({y}, inputs, {gy});
    grads.insert(grads.begin(), y.detach());
    return grads;
  };
  const auto plain = run(false);
  const bool blocked = block->last_forward_blocked();
  EXPECT_EQ(blocked, models::winograd_conv_available());
  const auto fused = run(true);
  EXPECT_EQ(block->last_forward_blocked(), blocked);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(fused[i], plain[i])) << i;
  // Parts off the 16-channel blocks take the plain concatenation.
  models::ResnetBlock2D odd(models::ResnetBlock2DOptions(40, 32).temb_channels(24).groups(8));
  const auto x8 = torch::randn({2, 8, 6, 5}), s32 = torch::randn({2, 32, 6, 5});
  EXPECT_TRUE(torch::allclose(odd->forward_cat(x8, s32, temb),
                              odd->forward(torch::cat({x8, s32}, 1), temb)));
  EXPECT_FALSE(odd->last_forward_blocked());
}

}  // namespace
