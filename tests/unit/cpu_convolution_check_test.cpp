// LibTorch's CPU convolutions against float64 after difftrain's check (core/cpu_convolution_check).
// On Debian 13's LibTorch 2.6 + libdnnl 3.7.2 the check finds oneDNN wrong and turns it off; these
// tests then fail if any convolution an ordinary UNet, VAE or test model runs is still wrong.

#include "difftrain/core/cpu_convolution_check.h"

#include <ATen/Context.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <cstdio>

namespace difftrain {
namespace {

double rel_error(const torch::Tensor& got, const torch::Tensor& ref) {
  return (got.to(torch::kDouble) - ref).abs().max().item<double>() /
         std::max(1e-12, ref.abs().max().item<double>());
}

TEST(CpuConvolutions, MatchFloat64OnEveryShapeAfterTheCheck) {
  const auto& check = core::ensure_correct_cpu_convolutions();
  std::printf("check: checked %d, oneDNN correct %d, turned off %d, worst %.3g of tolerance (%s)\n",
              check.checked, check.onednn_correct, check.onednn_turned_off, check.worst_error,
              check.worst_case.c_str());
  EXPECT_EQ(check.onednn_turned_off, check.checked && !check.onednn_correct);
  if (check.onednn_turned_off) {
    EXPECT_FALSE(at::globalContext().userEnabledMkldnn());
  }
  // 1x1 and 3x3 layers with 1-32 channels, float32 (tolerance 1e-4) and bf16 (3e-2), output
  // and both gradients, inputs rounded to the dtype so float64 sees the same numbers.
  torch::manual_seed(3);
  double worst[2] = {0, 0};
  int cases = 0;
  for (const auto dtype : {torch::kFloat, torch::kBFloat16}) {
    for (int64_t ci : {1, 3, 8, 24, 32}) {
      for (int64_t co : {1, 4, 16}) {
        for (int64_t k : {1, 3}) {
          for (int64_t hw : {4, 8}) {
            auto round = [&](torch::Tensor t) { return t.to(dtype).to(torch::kDouble); };
            const auto x = round(torch::randn({2, ci, hw, hw}, torch::kDouble));
            const auto w = round(torch::randn({co, ci, k, k}, torch::kDouble));
            const auto g = round(torch::randn({2, co, hw, hw}, torch::kDouble));
            std::vector<torch::Tensor> out[2];
            for (int i = 0; i < 2; ++i) {
              const auto t = i == 0 ? torch::kDouble : dtype;
              auto xx = x.to(t).detach().requires_grad_();
              auto ww = w.to(t).detach().requires_grad_();
              auto y = torch::conv2d(xx, ww, {}, 1, k / 2);
              y.backward(g.to(t));
              out[i] = {y.detach(), xx.grad(), ww.grad()};
            }
            const int d = dtype == torch::kFloat ? 0 : 1;
            for (int j = 0; j < 3; ++j) {
              const double e = rel_error(out[1][j], out[0][j]);
              worst[d] = std::isnan(e) ? INFINITY : std::max(worst[d], e);
            }
            ++cases;
          }
        }
      }
    }
  }
  std::printf(
      "%d convolutions against float64: worst relative error float32 %.3g (tol 1e-4), "
      "bf16 %.3g (tol 3e-2)\n",
      cases, worst[0], worst[1]);
  EXPECT_LT(worst[0], 1e-4);
  EXPECT_LT(worst[1], 3e-2);
}

TEST(CpuConvolutions, TheCheckSeesWhatItTurnedOff) {
  const auto& check = core::ensure_correct_cpu_convolutions();
  std::string now_case;
  const double now = core::cpu_convolution_error(&now_case);
  std::printf("error / tolerance now: %.3g (%s)\n", now, now_case.c_str());
  EXPECT_LT(now, 1.0);
  if (check.onednn_turned_off) {
    // Turned back on, oneDNN is wrong again: the check measured a real defect, not noise.
    at::globalContext().setUserEnabledMkldnn(true);
    std::string again_case;
    const double again = core::cpu_convolution_error(&again_case);
    at::globalContext().setUserEnabledMkldnn(false);
    std::printf("with oneDNN back on: %.3g (%s)\n", again, again_case.c_str());
    EXPECT_GE(again, 1.0);
  }
  EXPECT_NE(core::cpu_convolution_report().find(check.onednn_turned_off ? "are off" : ""),
            std::string::npos);
}

}  // namespace
}  // namespace difftrain
