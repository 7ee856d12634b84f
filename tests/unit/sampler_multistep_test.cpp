// DPMSolverMultistepScheduler and UniPCMultistepScheduler (src/diffusion/dpm_solver.cpp, unipc.cpp)
// against Diffusers 0.31: the shared sampling-loop fixtures (tests/golden/samplers/schedulers2,
// README there) and the extra configurations of tests/golden/samplers/make_dpm_unipc.py (dpm_*,
// unipc_*: v-prediction, SD-1.5's leading spacing with steps_offset 1, orders 1 and 3, heun, SDE
// with Karras sigmas, DPM-Solver and SDE-DPM-Solver, lambda_min_clipped on the cosine schedule,
// thresholding, Lu lambdas, zero terminal SNR; UniPC bh1, Karras, order 3, epsilon updates with
// disabled correctors). Tables must match to 1e-6 relative, trajectories to max(1e-5, the
// fixture's float32 spread).

#include "sampler_fixture.h"

#include "difftrain/core/error.h"
#include "difftrain/diffusion/sampler.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

namespace difftrain::test {
namespace {

namespace fs = std::filesystem;
using diffusion::make_sampler;
using diffusion::Sampler;

// Diffusers writes lambda_min_clipped = -inf as the bare token -Infinity, which JSON parsers
// refuse; the fixture is read from a copy where it is the string "-Infinity" (read as -inf).
SamplerFixture load_fixture(const std::string& name, const std::string& dir) {
  std::ifstream in(dir + "/" + name + ".json");
  if (!in) throw std::runtime_error("no fixture " + dir + "/" + name + ".json");
  std::stringstream buffer;
  buffer << in.rdbuf();
  std::string text = buffer.str();
  const std::string token = "-Infinity";
  if (text.find(": " + token) == std::string::npos) return load_sampler_fixture(name, dir);
  for (size_t at = text.find(": " + token); at != std::string::npos;
       at = text.find(": " + token, at + 1)) {
    text.replace(at, 2 + token.size(), ": \"" + token + "\"");
  }
  const fs::path tmp = fs::temp_directory_path() /
                       ("difftrain_multistep_" + std::to_string(::getpid()) + "_" + name);
  fs::create_directories(tmp);
  std::ofstream(tmp / (name + ".json")) << text;
  fs::copy_file(dir + "/" + name + ".safetensors", tmp / (name + ".safetensors"),
                fs::copy_options::overwrite_existing);
  SamplerFixture f = load_sampler_fixture(name, tmp.string());
  fs::remove_all(tmp);
  return f;
}

std::unique_ptr<Sampler> make_for(const SamplerFixture& f, const std::string& kind = "") {
  // The golden SD-1.5 case keeps its PNDMScheduler file: name the class it was loaded into.
  const std::string k = kind.empty() ? f.meta.value("class", std::string()) : kind;
  return make_sampler(f.scheduler_config, k, f.name);
}

void check_shared(const std::string& name) {
  const SamplerFixture f = load_fixture(name, sampler_fixture_dir());
  auto sampler = make_for(f);
  check_sampler_against_fixture(*sampler, f);
}

void check_golden(const std::string& name) {
  SCOPED_TRACE(name);
  const SamplerFixture f = load_fixture(name, sampler_golden_dir());
  auto sampler = make_for(f);
  check_sampler_against_fixture(*sampler, f);
}

// ------------------------------------------------------------------ the shared fixtures

TEST(DpmSolverFixture, Dpmpp2m) { check_shared("dpmpp_2m"); }
TEST(DpmSolverFixture, Dpmpp2mKarras) { check_shared("dpmpp_2m_karras"); }
TEST(DpmSolverFixture, Dpmpp2mSde) { check_shared("dpmpp_2m_sde"); }
TEST(UniPcFixture, Unipc) { check_shared("unipc"); }

// The --scheduler names on Stable Diffusion 1.5's scheduler_config.json (a PNDMScheduler file
// with no timestep_spacing, so the multistep classes use their default "linspace"): the same
// samplers as the fixtures.
TEST(DpmSolverFixture, SchedulerNamesOnSd15Config) {
  const nlohmann::json sd15 = {{"_class_name", "PNDMScheduler"},
                               {"_diffusers_version", "0.6.0"},
                               {"beta_end", 0.012},
                               {"beta_schedule", "scaled_linear"},
                               {"beta_start", 0.00085},
                               {"num_train_timesteps", 1000},
                               {"set_alpha_to_one", false},
                               {"skip_prk_steps", true},
                               {"steps_offset", 1},
                               {"trained_betas", nullptr}};
  for (const std::string name : {"dpmpp_2m", "dpmpp_2m_karras", "dpmpp_2m_sde", "unipc"}) {
    SCOPED_TRACE(name);
    const SamplerFixture f = load_fixture(name, sampler_fixture_dir());
    auto sampler = make_sampler(sd15, name, "sd15 scheduler_config.json");
    check_sampler_against_fixture(*sampler, f);
  }
}

// ------------------------------------------------------------------ extra configurations

TEST(DpmSolverGolden, VPredictionTrailing) { check_golden("dpm_vpred_trailing"); }
TEST(DpmSolverGolden, Sd15LeadingStepsOffset25Steps) { check_golden("dpm_sd15_leading"); }
TEST(DpmSolverGolden, SolverOrder3) { check_golden("dpm_order3"); }
TEST(DpmSolverGolden, SolverOrder3HeunSigmaMin) { check_golden("dpm_order3_lof_heun"); }
TEST(DpmSolverGolden, SdeKarras15Steps) { check_golden("dpm_sde_karras"); }
TEST(DpmSolverGolden, SdeHeunEulerAtFinal) { check_golden("dpm_sde_heun"); }
TEST(DpmSolverGolden, CosineLambdaMinClipped) { check_golden("dpm_cosine_clipped"); }
TEST(DpmSolverGolden, DpmSolver) { check_golden("dpm_dpmsolver"); }
TEST(DpmSolverGolden, SdeDpmSolverHeun) { check_golden("dpm_sde_dpmsolver"); }
TEST(DpmSolverGolden, SamplePredictionThresholding) { check_golden("dpm_sample_threshold"); }
TEST(DpmSolverGolden, LuLambdas) { check_golden("dpm_lu"); }
TEST(DpmSolverGolden, ZeroTerminalSnr) { check_golden("dpm_zero_snr"); }
TEST(DpmSolverGolden, Order1Karras) { check_golden("dpm_order1_karras"); }

TEST(UniPcGolden, Bh1) { check_golden("unipc_bh1"); }
TEST(UniPcGolden, Karras15Steps) { check_golden("unipc_karras"); }
TEST(UniPcGolden, KarrasSigmaMinOrder3) { check_golden("unipc_karras_sigma_min"); }
TEST(UniPcGolden, Order3VPredictionLeading) { check_golden("unipc_order3_vpred_leading"); }
TEST(UniPcGolden, EpsilonUpdatesDisabledCorrector) { check_golden("unipc_eps_disable_corrector"); }
TEST(UniPcGolden, SampleThresholdNoLowerOrderFinal) {
  check_golden("unipc_sample_threshold_nolof");
}

// ------------------------------------------------------------------ behaviour

// The config Diffusers' `scheduler.config` shows: file values, class defaults for the rest, and
// Diffusers' renames (deis -> dpmsolver++, bh2 -> midpoint; midpoint -> bh2 for UniPC).
TEST(DpmSolverConfig, DefaultsAndRenames) {
  const nlohmann::json in = {{"_class_name", "DPMSolverMultistepScheduler"},
                             {"algorithm_type", "deis"},
                             {"final_sigmas_type", "sigma_min"},
                             {"solver_type", "bh2"},
                             {"beta_schedule", "scaled_linear"}};
  auto s = make_sampler(in, "", "test");
  const nlohmann::json c = s->config();
  EXPECT_EQ(s->class_name(), "DPMSolverMultistepScheduler");
  EXPECT_EQ(c.at("algorithm_type"), "dpmsolver++");
  EXPECT_EQ(c.at("solver_type"), "midpoint");
  EXPECT_EQ(c.at("solver_order"), 2);
  EXPECT_EQ(c.at("timestep_spacing"), "linspace");
  EXPECT_EQ(c.at("beta_schedule"), "scaled_linear");
  EXPECT_TRUE(c.at("lower_order_final").get<bool>());
  EXPECT_TRUE(std::isinf(c.at("lambda_min_clipped").get<double>()));
  EXPECT_TRUE(c.at("variance_type").is_null());

  auto u = make_sampler({{"_class_name", "UniPCMultistepScheduler"}, {"solver_type", "midpoint"}},
                        "", "test");
  EXPECT_EQ(u->config().at("solver_type"), "bh2");
  EXPECT_EQ(u->config().at("disable_corrector"), nlohmann::json::array());
  EXPECT_TRUE(u->config().at("predict_x0").get<bool>());
}

// Settings Diffusers refuses (or fails on) are one-line errors naming the field.
TEST(DpmSolverConfig, RefusesWhatDiffusersRefuses) {
  const auto refused = [](const nlohmann::json& cfg, const std::string& field) {
    try {
      make_sampler(cfg, "", "cfg.json");
      ADD_FAILURE() << "accepted " << cfg.dump();
    } catch (const Error& e) {
      const std::string what = e.what();
      EXPECT_NE(what.find(field), std::string::npos) << what;
      EXPECT_EQ(what.find('\n'), std::string::npos) << what;
    }
  };
  const std::string dpm = "DPMSolverMultistepScheduler", unipc = "UniPCMultistepScheduler";
  refused({{"_class_name", dpm}, {"solver_order", 4}}, "solver_order");
  refused({{"_class_name", dpm}, {"algorithm_type", "dpmsolver"}}, "final_sigmas_type");
  refused({{"_class_name", dpm}, {"algorithm_type", "ddim"}}, "algorithm_type");
  refused({{"_class_name", dpm}, {"use_exponential_sigmas", true}}, "use_exponential_sigmas");
  refused({{"_class_name", dpm}, {"use_karras_sigmas", true}, {"use_beta_sigmas", true}},
          "use_beta_sigmas");
  refused({{"_class_name", dpm}, {"beta_schedule", "sigmoid"}}, "beta_schedule");
  refused({{"_class_name", dpm}, {"timestep_spacing", "uniform"}}, "timestep_spacing");
  refused({{"_class_name", unipc}, {"solver_type", "bh3"}}, "solver_type");
  refused({{"_class_name", unipc}, {"solver_order", 0}}, "solver_order");
  refused({{"_class_name", unipc}, {"solver_p", {{"_class_name", "DDIMScheduler"}}}}, "solver_p");
  refused({{"_class_name", unipc}, {"use_beta_sigmas", true}}, "use_beta_sigmas");
}

// set_timesteps() resets the history: a second run of the loop gives the same trajectory, and a
// step() past the last timestep or before set_timesteps() is an error.
TEST(DpmSolverSampler, SetTimestepsResetsHistory) {
  for (const std::string name : {"dpmpp_2m", "unipc"}) {
    SCOPED_TRACE(name);
    const SamplerFixture f = load_fixture(name, sampler_fixture_dir());
    auto s = make_for(f);
    EXPECT_THROW(s->step(f.x_T, 999, f.x_T), Error);
    s->set_timesteps(f.num_inference_steps);
    const SamplerRun a = run_sampler_loop(*s, f.x_T.sizes(), f.seed_x_T, std::nullopt);
    EXPECT_THROW(s->step(f.x_T, s->timestep(0), f.x_T), Error);
    s->set_timesteps(f.num_inference_steps);
    const SamplerRun b = run_sampler_loop(*s, f.x_T.sizes(), f.seed_x_T, std::nullopt);
    expect_within(name + " second run vs first", sampler_max_abs(a.prev_sample, b.prev_sample), 0);
  }
}

// The SDE sampler draws one randn of the sample's shape per step from the generator it is given:
// the same seed gives the same trajectory, another seed another one.
TEST(DpmSolverSampler, SdeNoiseComesFromTheGenerator) {
  const SamplerFixture f = load_fixture("dpmpp_2m_sde", sampler_fixture_dir());
  auto s = make_for(f);
  s->set_timesteps(f.num_inference_steps);
  const SamplerRun a = run_sampler_loop(*s, f.x_T.sizes(), f.seed_x_T, 5);
  s->set_timesteps(f.num_inference_steps);
  const SamplerRun b = run_sampler_loop(*s, f.x_T.sizes(), f.seed_x_T, 5);
  s->set_timesteps(f.num_inference_steps);
  const SamplerRun c = run_sampler_loop(*s, f.x_T.sizes(), f.seed_x_T, 6);
  expect_within("sde same seed", sampler_max_abs(a.prev_sample, b.prev_sample), 0);
  EXPECT_GT(sampler_max_abs(a.prev_sample, c.prev_sample), 1e-3);
}

// Diffusers has no third-order SDE update: an SDE run with solver_order 3 works while the orders
// stay at 1-2 (3 steps) and fails, as in Diffusers, at the first step that needs order 3.
TEST(DpmSolverSampler, SdeOrder3FailsOnlyWhereDiffusersFails) {
  const nlohmann::json cfg = {{"_class_name", "DPMSolverMultistepScheduler"},
                              {"algorithm_type", "sde-dpmsolver++"},
                              {"solver_order", 3}};
  auto s = make_sampler(cfg, "", "sde order 3");
  s->set_timesteps(3);
  EXPECT_NO_THROW(run_sampler_loop(*s, {1, 1, 2, 2}, 1, 2));
  s->set_timesteps(20);
  EXPECT_THROW(run_sampler_loop(*s, {1, 1, 2, 2}, 1, 2), Error);
}

// Diffusers 0.31's UniPC bh1 with final_sigmas_type "zero" ends in NaN (B(h) = h is -inf at the
// last step and the first-order predictor multiplies it by 0); difftrain keeps that behaviour
// rather than inventing a different sampler, and sigma_min (unipc_bh1) is finite.
TEST(UniPcSampler, Bh1WithZeroFinalSigmaIsNanLikeDiffusers) {
  const SamplerFixture f = load_fixture("unipc", sampler_fixture_dir());
  nlohmann::json cfg = f.scheduler_config;
  cfg["solver_type"] = "bh1";
  auto s = make_sampler(cfg, "", "bh1 zero");
  s->set_timesteps(5);
  const SamplerRun run = run_sampler_loop(*s, f.x_T.sizes(), f.seed_x_T, std::nullopt);
  const int64_t last = run.prev_sample.size(0) - 1;
  EXPECT_TRUE(torch::isfinite(run.prev_sample[last - 1]).all().item<bool>());
  EXPECT_TRUE(torch::isnan(run.prev_sample[last]).all().item<bool>());
}

}  // namespace
}  // namespace difftrain::test
