// 8-bit AdamW: the dynamic code maps, block-wise quantisation error bounds, state size,
// agreement with fp32 AdamW, training parity on a small diffusion objective, exact resume.

#include "difftrain/optim/adamw8bit.h"
#include "difftrain/core/error.h"
#include "difftrain/optim/adamw.h"
#include "difftrain/optim/quantize.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>

namespace {

namespace fs = std::filesystem;
using difftrain::optim::AdamW;
using difftrain::optim::AdamW8bit;
using difftrain::optim::kQuantBlockSize;
using torch::optim::AdamWOptions;

TEST(Quantize, DynamicCodeMapsHaveBitsandbytesShape) {
  const auto& s = difftrain::optim::dynamic_code_map(true);
  const auto& u = difftrain::optim::dynamic_code_map(false);
  EXPECT_TRUE(std::is_sorted(s.begin(), s.end()));
  EXPECT_TRUE(std::is_sorted(u.begin(), u.end()));
  EXPECT_EQ(std::count_if(s.begin(), s.end(), [](float v) { return v < 0; }), 127);
  EXPECT_EQ(std::count_if(u.begin(), u.end(), [](float v) { return v < 0; }), 0);
  EXPECT_EQ(s.back(), 1.0f);
  EXPECT_EQ(u.back(), 1.0f);
  EXPECT_EQ(std::count(s.begin(), s.end(), 0.0f), 1);
  // Smallest magnitudes: 10^-6 × the midpoints of linspace(0.1, 1, 2) (signed) or of
  // linspace(0.1, 1, 3) (unsigned); the most negative signed code is −10^0 × the last midpoint
  // of linspace(0.1, 1, 65) = −0.99296875, as bitsandbytes'.
  EXPECT_FLOAT_EQ(s.front(), -0.99296875f);
  EXPECT_FLOAT_EQ(s[128], 0.55e-6f);
  EXPECT_FLOAT_EQ(u[1], 0.325e-6f);
  EXPECT_EQ(std::adjacent_find(s.begin(), s.end()), s.end());  // no duplicate codes
  EXPECT_EQ(std::adjacent_find(u.begin(), u.end()), u.end());
}

TEST(Quantize, PicksTheNearestCode) {
  for (bool is_signed : {true, false}) {
    const auto& map = difftrain::optim::dynamic_code_map(is_signed);
    auto gen = at::detail::createCPUGenerator(7);
    auto xs = at::rand({20000}, gen) * (is_signed ? 2.0 : 1.0) - (is_signed ? 1.0 : 0.0);
    for (int64_t i = 0; i < xs.numel(); ++i) {
      const float x = xs[i].item<float>();
      const int q = difftrain::optim::quantize_nearest(x, is_signed);
      for (int k = 0; k < 256; ++k) {
        ASSERT_LE(std::fabs(x - map[q]), std::fabs(x - map[k]) + 1e-7f)
            << "x " << x << " code " << q << " vs " << k;
      }
    }
  }
}

TEST(Quantize, BlockwiseRoundTripErrorIsBounded) {
  auto gen = at::detail::createCPUGenerator(11);
  // Gradient-like values with a few outliers, in several blocks plus a partial one.
  auto x = at::randn({3 * kQuantBlockSize + 123}, gen) * 1e-3;
  x[5] = 0.05;
  for (bool is_signed : {true, false}) {
    auto v = is_signed ? x : x * x;
    auto q = difftrain::optim::quantize_blockwise(v, is_signed);
    ASSERT_EQ(q.absmax.numel(), 4);
    auto back = difftrain::optim::dequantize_blockwise(q, is_signed);
    // Per element: the error is at most half the gap between the two codes around x/absmax.
    const auto& map = difftrain::optim::dynamic_code_map(is_signed);
    double worst_ratio = 0;
    for (int64_t i = 0; i < v.numel(); ++i) {
      const int64_t b = i / kQuantBlockSize;
      const float amax = q.absmax[b].item<float>();
      const float y = v[i].item<float>() / amax;
      auto hi = std::lower_bound(map.begin(), map.end(), y);
      // Outside the map (the signed map stops at −0.99297) the nearest code is its end.
      float bound = hi == map.begin() ? map.front() - y
                    : hi == map.end() ? y - map.back()
                                      : (*hi - *(hi - 1)) / 2;
      bound = bound * amax + 1e-6f * amax;  // plus float rounding of code × absmax
      const double err = std::fabs(back[i].item<float>() - v[i].item<float>());
      worst_ratio = std::max(worst_ratio, err / bound);
    }
    const double rel = ((back - v).abs().sum() / v.abs().sum()).item<double>();
    std::printf("%s: worst error / half code gap %.4f, mean relative error %.4f\n",
                is_signed ? "signed" : "unsigned", worst_ratio, rel);
    EXPECT_LE(worst_ratio, 1.0 + 1e-4);
    EXPECT_LT(rel, is_signed ? 0.03 : 0.05);
    // The block holding the outlier has its own scale; others keep theirs.
    EXPECT_NEAR(q.absmax[0].item<float>(),
                v.abs().narrow(0, 0, kQuantBlockSize).max().item<float>(), 0);
  }
  auto zeros = difftrain::optim::quantize_blockwise(torch::zeros({10}), true);
  EXPECT_TRUE(
      torch::equal(difftrain::optim::dequantize_blockwise(zeros, true), torch::zeros({10})));
}

TEST(AdamW8bit, StateIsAQuarterOfFp32AndSmallTensorsStay32Bit) {
  std::vector<torch::Tensor> params;
  int64_t numel = 0;
  // UNet-like: large conv weights plus norms and biases.
  for (int64_t n : {128 * 128 * 9, 256 * 128 * 9, 256 * 256 * 9, 256, 256, 128, 512 * 256}) {
    params.push_back(torch::randn({n}, torch::requires_grad()));
    numel += n;
  }
  AdamW8bit opt(params);
  for (auto& p : params) p.mutable_grad().normal_();
  opt.step();
  EXPECT_TRUE(opt.is_8bit(0, 0));
  EXPECT_FALSE(opt.is_8bit(0, 3));
  const int64_t fp32_bytes = numel * 8;
  const int64_t small = 256 + 256 + 128;
  const int64_t large = numel - small;
  int64_t blocks = 0;
  for (size_t i : {0, 1, 2, 6})
    blocks += (params[i].numel() + kQuantBlockSize - 1) / kQuantBlockSize;
  EXPECT_EQ(opt.state_bytes(), large * 2 + blocks * 8 + small * 8);
  const double ratio = static_cast<double>(opt.state_bytes()) / fp32_bytes;
  std::printf("8-bit state %lld bytes vs fp32 %lld bytes: %.2f%%\n",
              static_cast<long long>(opt.state_bytes()), static_cast<long long>(fp32_bytes),
              100 * ratio);
  EXPECT_LE(ratio, 0.27);
}

TEST(AdamW8bit, TracksFp32AdamWClosely) {
  auto gen = at::detail::createCPUGenerator(5);
  auto init = at::randn({20000}, gen);
  auto p8 = init.clone().requires_grad_(true), p32 = init.clone().requires_grad_(true);
  AdamW8bit q({p8}, AdamWOptions(1e-2));
  AdamW f({p32}, AdamWOptions(1e-2));
  for (int s = 0; s < 50; ++s) {
    auto g = at::randn({20000}, gen) * 0.1 + 0.05 * init;
    p8.mutable_grad().copy_(g);
    p32.mutable_grad().copy_(g);
    q.step();
    f.step();
  }
  const double moved = (p32 - init).abs().mean().item<double>();
  const double diff = (p8 - p32).abs().mean().item<double>();
  const double m_rel =
      ((q.exp_avg(0, 0) - f.exp_avg(0, 0)).abs().sum() / f.exp_avg(0, 0).abs().sum())
          .item<double>();
  std::printf("after 50 steps: mean |p8 - p32| %.3g vs mean movement %.3g; exp_avg rel err %.4f\n",
              diff, moved, m_rel);
  EXPECT_LT(diff, 0.05 * moved);
  EXPECT_LT(m_rel, 0.05);
}

// A small diffusion objective: a conv denoiser learns to predict the noise added to smooth
// synthetic images at random DDPM timesteps. Returns the mean loss of the last 40 steps.
double train_denoiser(bool eight_bit) {
  torch::manual_seed(0);
  constexpr int64_t kC = 32, kS = 12, kSteps = 240, kBatch = 16;
  torch::nn::Sequential net(
      torch::nn::Conv2d(torch::nn::Conv2dOptions(2, kC, 3).padding(1)), torch::nn::SiLU(),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(kC, kC, 3).padding(1)), torch::nn::SiLU(),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(kC, kC, 3).padding(1)), torch::nn::SiLU(),
      torch::nn::Conv2d(torch::nn::Conv2dOptions(kC, 1, 3).padding(1)));
  auto gen = at::detail::createCPUGenerator(1);
  auto yy = torch::linspace(-1, 1, kS).view({1, 1, kS, 1});
  auto xx = torch::linspace(-1, 1, kS).view({1, 1, 1, kS});
  auto cx = at::rand({256, 1, 1, 1}, gen) - 0.5, cy = at::rand({256, 1, 1, 1}, gen) - 0.5;
  auto images = torch::exp(-((xx - cx).pow(2) + (yy - cy).pow(2)) * 6) * 2 - 1;  // [256,1,S,S]
  auto betas = torch::linspace(1e-4, 0.02, 1000, torch::kFloat64);
  auto alphas_cumprod = torch::cumprod(1 - betas, 0).to(torch::kFloat32);
  std::unique_ptr<torch::optim::Optimizer> opt;
  AdamWOptions options(2e-3);
  if (eight_bit) {
    opt = std::make_unique<AdamW8bit>(net->parameters(), options);
  } else {
    opt = std::make_unique<AdamW>(net->parameters(), options);
  }
  double tail = 0;
  for (int64_t step = 0; step < kSteps; ++step) {
    auto idx = at::randint(0, 256, {kBatch}, gen);
    auto x0 = images.index_select(0, idx);
    auto noise = at::randn(x0.sizes(), gen);
    auto t = at::randint(0, 1000, {kBatch}, gen);
    auto a = alphas_cumprod.index_select(0, t).view({kBatch, 1, 1, 1});
    auto xt = a.sqrt() * x0 + (1 - a).sqrt() * noise;
    auto tmap = (t.to(torch::kFloat32) / 1000).view({kBatch, 1, 1, 1}).expand({kBatch, 1, kS, kS});
    auto loss = torch::mse_loss(net->forward(torch::cat({xt, tmap}, 1)), noise);
    opt->zero_grad();
    loss.backward();
    opt->step();
    if (step >= kSteps - 40) tail += loss.item<double>() / 40;
  }
  return tail;
}

TEST(AdamW8bit, SmallDiffusionTrainingLossWithinTwoPercentOfFp32) {
  const double fp32 = train_denoiser(false);
  const double q8 = train_denoiser(true);
  std::printf("denoiser final loss: fp32 AdamW %.5f, 8-bit AdamW %.5f (%.2f%% apart, limit 2%%)\n",
              fp32, q8, 100 * std::fabs(q8 - fp32) / fp32);
  EXPECT_LT(fp32, 0.8);  // it learned something (unit-variance noise starts near 1)
  EXPECT_LT(std::fabs(q8 - fp32) / fp32, 0.02);
}

TEST(AdamW8bit, SaveLoadContinueEqualsUninterrupted) {
  auto dir = fs::temp_directory_path() / ("difftrain_adam8_" + std::to_string(::getpid()));
  auto make = [] {
    auto gen = at::detail::createCPUGenerator(2);
    return std::vector<torch::Tensor>{at::randn({5000}, gen).requires_grad_(true),
                                      at::randn({100}, gen).requires_grad_(true)};
  };
  auto grads = [](std::vector<torch::Tensor>& ps, int s) {
    auto gen = at::detail::createCPUGenerator(40 + s);
    for (auto& p : ps) p.mutable_grad().copy_(at::randn(p.sizes(), gen));
  };
  auto full = make(), part = make();
  AdamW8bit a(full), b(part);
  for (int s = 0; s < 8; ++s) {
    grads(full, s);
    a.step();
    if (s < 3) {
      grads(part, s);
      b.step();
    }
  }
  difftrain::optim::save_optimizer_state(b.state_dict(), (dir / "opt").string());
  auto resumed = make();
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < resumed.size(); ++i) resumed[i].copy_(part[i]);
  }
  AdamW8bit c(resumed);
  c.load_state_dict(difftrain::optim::load_optimizer_state((dir / "opt").string()));
  for (int s = 3; s < 8; ++s) {
    grads(resumed, s);
    c.step();
  }
  for (size_t i = 0; i < full.size(); ++i) EXPECT_TRUE(torch::equal(full[i], resumed[i])) << i;
  // The fp32 optimizer's state is refused, naming the type.
  AdamW fp32(make());
  try {
    fp32.load_state_dict(b.state_dict());
    FAIL() << "AdamW accepted AdamW8bit state";
  } catch (const difftrain::Error& e) {
    EXPECT_NE(std::string(e.what()).find("AdamW8bit"), std::string::npos) << e.what();
  }
  fs::remove_all(dir);
}

TEST(AdamW8bit, RejectsAmsgrad) {
  EXPECT_THROW(AdamW8bit({torch::zeros({3}, torch::requires_grad())}, AdamWOptions().amsgrad(true)),
               difftrain::Error);
}

}  // namespace
