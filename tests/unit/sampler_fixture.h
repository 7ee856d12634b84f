#pragma once
// Test helpers for the samplers (sampler.h): loading the Diffusers 0.31 sampling-loop fixtures
// (tests/golden/samplers/schedulers2/, a copy of ../shared/fixtures/schedulers2/, README there;
// extra references made by tests/golden/samplers/make_*.py have the same layout), the fixtures'
// TOY model, and the sampling loop run the way the fixture generator ran it.

#include "difftrain/diffusion/sampler.h"
#include "difftrain/io/safetensors.h"
#include "source_dir.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <fstream>
#include <limits>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace difftrain::test {

/// tests/golden/samplers (extra references) and its schedulers2/ subfolder (the shared fixtures).
inline std::string sampler_golden_dir() {
  return std::string(difftrain_test::source_dir()) + "/tests/golden/samplers";
}
inline std::string sampler_fixture_dir() { return sampler_golden_dir() + "/schedulers2"; }

/// One fixture: <dir>/<name>.json + <dir>/<name>.safetensors.
struct SamplerFixture {
  std::string name;
  nlohmann::json meta;              ///< the whole .json
  nlohmann::json scheduler_config;  ///< meta["scheduler_config"]
  int64_t num_inference_steps = 0;
  int64_t seed_x_T = 0;
  std::optional<uint64_t> step_seed;  ///< seed of the step() generator (stochastic samplers)
  double tolerance = 0;               ///< float32_vs_float64_final_maxabs of the fixture
  torch::Tensor timesteps;            ///< [L] int64 or float32
  torch::Tensor sigmas;               ///< [L + 1] float32, undefined when the fixture has none
  double init_noise_sigma = 1;
  torch::Tensor x_T;           ///< [2, 4, 8, 8]
  torch::Tensor model_output;  ///< [L, 2, 4, 8, 8]
  torch::Tensor prev_sample;   ///< [L, 2, 4, 8, 8]
};

/// Loads fixture `name` from `dir` (default: the shared fixtures' copy).
inline SamplerFixture load_sampler_fixture(const std::string& name,
                                           const std::string& dir = sampler_fixture_dir()) {
  SamplerFixture f;
  f.name = name;
  std::ifstream in(dir + "/" + name + ".json");
  if (!in) throw std::runtime_error("no fixture " + dir + "/" + name + ".json");
  f.meta = nlohmann::json::parse(in);
  f.scheduler_config = f.meta.at("scheduler_config");
  f.num_inference_steps = f.meta.at("num_inference_steps").get<int64_t>();
  f.seed_x_T = f.meta.at("seed_x_T").get<int64_t>();
  if (f.meta.contains("seed_step_generator") && !f.meta["seed_step_generator"].is_null()) {
    f.step_seed = f.meta["seed_step_generator"].get<uint64_t>();
  }
  f.tolerance = f.meta.value("float32_vs_float64_final_maxabs", 0.0);
  const io::TensorMap t = io::load_safetensors(dir + "/" + name + ".safetensors").tensors;
  const auto get = [&](const std::string& key) {
    const auto it = t.find(key);
    return it == t.end() ? torch::Tensor() : it->second.clone();
  };
  f.timesteps = get("timesteps");
  f.sigmas = get("sigmas");
  const torch::Tensor ins = get("init_noise_sigma");
  if (ins.defined()) f.init_noise_sigma = ins.to(torch::kFloat64).item<double>();
  f.x_T = get("x_T");
  f.model_output = get("model_output");
  f.prev_sample = get("prev_sample");
  return f;
}

/// The fixtures' TOY model: float32 0.3 * x_in, plus (float)(0.1 * sin(t / 250)) computed in
/// double. x_in: float32 [B, C, H, W].
inline torch::Tensor toy_model(const torch::Tensor& x_in, double t) {
  const torch::Tensor a = x_in * 0.3;  // float32 multiply by 0.3f
  const double c = 0.1 * std::sin(t / 250.0);
  return a + static_cast<double>(static_cast<float>(c));
}

/// What one run of the loop recorded.
struct SamplerRun {
  torch::Tensor x_T;           ///< [B, ...]
  torch::Tensor model_output;  ///< [L, B, ...]
  torch::Tensor prev_sample;   ///< [L, B, ...]
};

/// The fixtures' loop: x_T = randn(shape, seed_x_T) * init_noise_sigma, then for each timestep
/// x = step(TOY(scale_model_input(x, t), t), t, x, step generator). The step generator (created
/// once from `step_seed`) is passed only when a seed is given. set_timesteps() is the caller's.
inline SamplerRun run_sampler_loop(diffusion::Sampler& sampler, at::IntArrayRef shape,
                                   int64_t seed_x_T, std::optional<uint64_t> step_seed) {
  SamplerRun run;
  at::Generator g = at::make_generator<at::CPUGeneratorImpl>(static_cast<uint64_t>(seed_x_T));
  const torch::Tensor ins = torch::tensor(static_cast<float>(sampler.init_noise_sigma()));
  run.x_T = at::randn(shape, g, torch::kFloat32) * ins;
  std::optional<at::Generator> step_gen;
  if (step_seed) step_gen = at::make_generator<at::CPUGeneratorImpl>(*step_seed);
  torch::Tensor x = run.x_T;
  std::vector<torch::Tensor> outs, xs;
  for (int64_t i = 0; i < sampler.timesteps().size(0); ++i) {
    const double t = sampler.timestep(i);
    const torch::Tensor m = toy_model(sampler.scale_model_input(x, t), t);
    x = sampler.step(m, t, x, step_gen);
    outs.push_back(m);
    xs.push_back(x);
  }
  run.model_output = torch::stack(outs);
  run.prev_sample = torch::stack(xs);
  return run;
}

/// max |a - b| in float64 (shapes must match).
inline double sampler_max_abs(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.sizes() != b.sizes()) return INFINITY;
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

/// max |a - b| / max(|b|, tiny) in float64: for tables (timesteps, sigmas).
inline double sampler_max_rel(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  if (a.sizes() != b.sizes()) return INFINITY;
  const torch::Tensor bd = b.to(torch::kFloat64);
  return ((a.to(torch::kFloat64) - bd).abs() / bd.abs().clamp_min(1e-30)).max().item<double>();
}

/// Prints "<what>: max <kind> diff D (tolerance T)" and expects D <= T.
inline void expect_within(const std::string& what, double diff, double tol,
                          const char* kind = "abs") {
  std::printf("%s: max %s diff %.3g (tolerance %.1e)\n", what.c_str(), kind, diff, tol);
  EXPECT_LE(diff, tol) << what;
}

/// Checks `sampler` (already made from fixture.scheduler_config) against `fixture`: the tables
/// after set_timesteps(N), init_noise_sigma, then the whole loop (x_T, every model output and
/// every prev_sample) within `traj_tol`, by default the fixture's float32 spread and at least 1e-5.
inline void check_sampler_against_fixture(diffusion::Sampler& sampler,
                                          const SamplerFixture& fixture,
                                          double table_rel_tol = 1e-6,
                                          std::optional<double> traj_tol = std::nullopt) {
  const std::string n = fixture.name;
  sampler.set_timesteps(fixture.num_inference_steps);
  EXPECT_EQ(sampler.timesteps().scalar_type(), fixture.timesteps.scalar_type()) << n;
  expect_within(n + " timesteps", sampler_max_rel(sampler.timesteps(), fixture.timesteps),
                table_rel_tol, "rel");
  if (fixture.sigmas.defined()) {
    ASSERT_TRUE(sampler.sigmas().defined()) << n;
    expect_within(n + " sigmas", sampler_max_rel(sampler.sigmas(), fixture.sigmas), table_rel_tol,
                  "rel");
  }
  expect_within(n + " init_noise_sigma",
                std::abs(sampler.init_noise_sigma() - fixture.init_noise_sigma) /
                    std::abs(fixture.init_noise_sigma),
                table_rel_tol, "rel");
  // The shared fixtures state their float32 spread (the bound is it, at least 1e-5). The extra
  // references made here state none, and LibTorch 2.x's vectorised CPU kernels (exp, log, pow)
  // round some values differently from 1.13's, which made them; over 20-25 steps that grows to
  // about 8 float32 ulps of the trajectory's largest values (measured on 2.6: 1.5e-5 at |x| ~ 20,
  // 3.1e-5 at |x| ~ 60). For those the bound is 16 ulps of the largest value, at least 1e-5; a
  // formula slip is 1e-3 relative or more.
  double tol = std::max(1e-5, fixture.tolerance);
  if (fixture.tolerance == 0) {
    const double magnitude = std::max(fixture.prev_sample.abs().max().item<double>(),
                                      fixture.model_output.abs().max().item<double>());
    tol =
        std::max(tol, 16 * static_cast<double>(std::numeric_limits<float>::epsilon()) * magnitude);
  }
  if (traj_tol) tol = *traj_tol;
  const SamplerRun run =
      run_sampler_loop(sampler, fixture.x_T.sizes(), fixture.seed_x_T, fixture.step_seed);
  expect_within(n + " x_T", sampler_max_abs(run.x_T, fixture.x_T), tol);
  expect_within(n + " model_output (all steps)",
                sampler_max_abs(run.model_output, fixture.model_output), tol);
  expect_within(n + " prev_sample (all steps)",
                sampler_max_abs(run.prev_sample, fixture.prev_sample), tol);
  const int64_t last = fixture.prev_sample.size(0) - 1;
  expect_within(n + " final sample",
                sampler_max_abs(run.prev_sample[last], fixture.prev_sample[last]), tol);
}

}  // namespace difftrain::test
