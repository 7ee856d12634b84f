// The quality metric of `difftrain eval`: the Fréchet distance against an independent float64
// computation (eigenvalues of the non-symmetric S1 S2), and its known special cases.

#include "difftrain/families/unet/eval.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using difftrain::families::unet::frechet_distance;

double reference_distance(const torch::Tensor& a, const torch::Tensor& b) {
  auto x = a.to(torch::kFloat64), y = b.to(torch::kFloat64);
  auto cov = [](const torch::Tensor& t) {
    auto c = t - t.mean(0, true);
    return c.t().mm(c) / static_cast<double>(t.size(0) - 1);
  };
  auto s1 = cov(x), s2 = cov(y);
  auto mu = x.mean(0) - y.mean(0);
  // tr((S1 S2)^1/2) = sum of the square roots of the eigenvalues of S1 S2 (real, >= 0).
  auto eig = torch::real(at::linalg_eigvals(s1.mm(s2))).clamp_min(0);
  return mu.dot(mu).item<double>() + (s1.trace() + s2.trace()).item<double>() -
         2 * eig.sqrt().sum().item<double>();
}

TEST(FrechetDistance, MatchesAnIndependentComputation) {
  torch::manual_seed(0);
  auto a = torch::randn({400, 6}).mm(torch::randn({6, 6}));
  auto b = torch::randn({300, 6}).mm(torch::randn({6, 6})) + 0.5;
  const double ours = frechet_distance(a, b);
  const double ref = reference_distance(a, b);
  std::printf("frechet distance %.9g vs reference %.9g\n", ours, ref);
  EXPECT_NEAR(ours, ref, 1e-8 * std::max(1.0, std::abs(ref)));
  EXPECT_GT(ours, 1.0);
}

TEST(FrechetDistance, SpecialCases) {
  torch::manual_seed(1);
  auto a = torch::randn({200, 4}, torch::kFloat64);
  EXPECT_NEAR(frechet_distance(a, a), 0.0, 1e-9);
  // A shift changes only the mean term: |shift|^2.
  auto shift = torch::tensor({1.0, -2.0, 0.5, 0.0}, torch::kFloat64);
  EXPECT_NEAR(frechet_distance(a, a + shift), 1 + 4 + 0.25, 1e-9);
}

}  // namespace
