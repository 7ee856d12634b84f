#pragma once
// Tolerances for a float32 sampling chain compared with a float32 reference made elsewhere
// (Diffusers' images in the fixtures), derived from what the chain's float32 rounding does on
// the CPU the test runs on, never fixed constants.
//
// A chain (DDIM with clip_sample from t = 900, DDPM with its variance noise) amplifies the
// rounding of every UNet call up to ~100x, and that rounding is decided by the CPU's kernels
// (oneDNN and OpenBLAS take other paths on AVX2 than on AVX-512, and other summation orders with
// other thread counts). So a fixed bound either fails on one kind of VM or is too loose to mean
// anything. Instead each test runs the same chain a second time in float64 (the UNet cast to
// float64, the same generator draws): ours64 is the exact result up to ~1e-12, so
//   spread = |ours - ours64|   is our float32 rounding on this CPU, measured, and
//   ref    = |ours64 - ref|    is the reference's own float32 rounding: it does not depend on
//                              this CPU at all.
// A float32 run of the same chain on any CPU has rounding of the size of our spread (same
// operations, same amplification; seen here: the reference's is 0.9x..2x ours), so
//   bound = kFloat32Factor * spread + floor
// bounds any float32 realisation. The checks, for the max and the mean over pixels:
//   ref  <= bound       the semantic check: the reference is the exact chain up to float32
//                       rounding. A real semantic error (a missing clip, a timestep off by one,
//                       the wrong final alpha) moves ours64 away from the reference by much
//                       more (Pipeline.ChainToleranceRejectsSemanticErrors shows it).
//   diff = |ours - ref| <= 2 * bound   both float32 runs within the bound of the exact chain.
// `floor` is the fixture's float32 floor of one UNet call (~2e-6, README), with margin.

#include <gtest/gtest.h>
#include <torch/types.h>

#include <algorithm>
#include <cstdio>
#include <string>

namespace difftrain::test {

/// How much larger another CPU's float32 rounding of the same chain may be than ours.
inline constexpr double kFloat32Factor = 4.0;

/// The measured differences of one chain comparison and the bounds derived from them.
struct ChainCheck {
  double diff_max = 0, diff_mean = 0;      ///< |ours - ref|
  double spread_max = 0, spread_mean = 0;  ///< |ours - ours64|: our float32 rounding, this CPU
  double ref_max = 0, ref_mean = 0;        ///< |ours64 - ref|: the reference's float32 rounding
  double bound_max = 0, bound_mean = 0;    ///< kFloat32Factor * spread + floor
};

/// Measures `ours` (float32 chain), `ours64` (the same chain in float64) and `ref` (the
/// reference's float32 chain), all of one shape, and derives the bounds.
inline ChainCheck chain_check(const torch::Tensor& ours, const torch::Tensor& ours64,
                              const torch::Tensor& ref, double floor_max = 1e-5,
                              double floor_mean = 1e-6) {
  auto a = ours.to(torch::kFloat64), e = ours64.to(torch::kFloat64), r = ref.to(torch::kFloat64);
  ChainCheck c;
  auto d = (a - r).abs(), s = (a - e).abs(), f = (e - r).abs();
  c.diff_max = d.max().item<double>();
  c.diff_mean = d.mean().item<double>();
  c.spread_max = s.max().item<double>();
  c.spread_mean = s.mean().item<double>();
  c.ref_max = f.max().item<double>();
  c.ref_mean = f.mean().item<double>();
  c.bound_max = kFloat32Factor * c.spread_max + floor_max;
  c.bound_mean = kFloat32Factor * c.spread_mean + floor_mean;
  return c;
}

/// True when the reference is the exact chain up to float32 rounding and ours is within
/// float32 rounding of both (the checks of the header).
inline bool chain_agrees(const ChainCheck& c) {
  return c.ref_max <= c.bound_max && c.ref_mean <= c.bound_mean && c.diff_max <= 2 * c.bound_max &&
         c.diff_mean <= 2 * c.bound_mean;
}

/// Prints every measured figure and bound, then expects chain_agrees().
inline void expect_chain_agrees(const std::string& what, const ChainCheck& c) {
  std::printf(
      "%s: max|ours - ref| %.3g (tol %.3g), mean %.3g (tol %.3g); reference's own float32 "
      "rounding max|ours64 - ref| %.3g (tol %.3g), mean %.3g (tol %.3g); tolerances = %.0f x "
      "this CPU's float32 spread max|ours - ours64| %.3g, mean %.3g, + floor\n",
      what.c_str(), c.diff_max, 2 * c.bound_max, c.diff_mean, 2 * c.bound_mean, c.ref_max,
      c.bound_max, c.ref_mean, c.bound_mean, kFloat32Factor, c.spread_max, c.spread_mean);
  EXPECT_LE(c.ref_max, c.bound_max) << what << ": the reference is not our float64 chain";
  EXPECT_LE(c.ref_mean, c.bound_mean) << what << ": the reference is not our float64 chain";
  EXPECT_LE(c.diff_max, 2 * c.bound_max) << what;
  EXPECT_LE(c.diff_mean, 2 * c.bound_mean) << what;
}

}  // namespace difftrain::test
