// Samplers (sampler.h), part A: PNDM, Euler, Euler ancestral and flow-matching Euler against the
// Diffusers 0.31 sampling-loop fixtures (tests/golden/samplers/schedulers2, README there) and
// against extra references for other configurations (tests/golden/samplers/make_samplers.py);
// the factory (names, classes, from_config semantics, errors) and the DDPM/DDIM adapters.

#include "difftrain/diffusion/sampler.h"
#include "difftrain/core/error.h"
#include "difftrain/diffusion/noise_scheduler.h"
#include "sampler_fixture.h"
#include "source_dir.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

namespace difftrain::diffusion {
namespace {

using nlohmann::json;
using test::load_sampler_fixture;
using test::SamplerFixture;

// Tolerances. Tables (timesteps, sigmas, init_noise_sigma) repeat Diffusers' float32/float64
// operations, so 1e-6 relative only leaves room for a libm ulp. The trajectory: the fixture's
// float32-vs-float64 spread (its README) or 1e-5, whichever is larger; a formula slip is 1e-3+.
constexpr double kTableRelTol = 1e-6;

std::unique_ptr<Sampler> from_fixture(const SamplerFixture& f, const std::string& kind = "") {
  return make_sampler(f.scheduler_config, kind, f.name + ".json");
}

// ------------------------------------------------------------------ the shared fixtures

TEST(PndmSampler, MatchesDiffusersFixture) {
  const SamplerFixture f = load_sampler_fixture("pndm");
  auto s = from_fixture(f);
  EXPECT_EQ(s->class_name(), "PNDMScheduler");
  test::check_sampler_against_fixture(*s, f, kTableRelTol);
}

TEST(EulerSampler, MatchesDiffusersFixture) {
  const SamplerFixture f = load_sampler_fixture("euler");
  auto s = from_fixture(f);
  EXPECT_EQ(s->class_name(), "EulerDiscreteScheduler");
  test::check_sampler_against_fixture(*s, f, kTableRelTol);
}

TEST(EulerAncestralSampler, MatchesDiffusersFixture) {
  const SamplerFixture f = load_sampler_fixture("euler_ancestral");
  ASSERT_TRUE(f.step_seed.has_value());
  auto s = from_fixture(f);
  EXPECT_EQ(s->class_name(), "EulerAncestralDiscreteScheduler");
  test::check_sampler_against_fixture(*s, f, kTableRelTol);
}

TEST(FlowMatchSampler, MatchesDiffusersFixture) {
  const SamplerFixture f = load_sampler_fixture("flow_match_euler");
  auto s = from_fixture(f);
  EXPECT_EQ(s->class_name(), "FlowMatchEulerDiscreteScheduler");
  test::check_sampler_against_fixture(*s, f, kTableRelTol);
}

// A second loop after set_timesteps() again gives the same numbers (the step index resets).
TEST(EulerSampler, SetTimestepsRestartsTheLoop) {
  const SamplerFixture f = load_sampler_fixture("euler");
  auto s = from_fixture(f);
  test::check_sampler_against_fixture(*s, f, kTableRelTol);
  test::check_sampler_against_fixture(*s, f, kTableRelTol);
}

TEST(PndmSampler, SetTimestepsRestartsTheLoop) {
  const SamplerFixture f = load_sampler_fixture("pndm");
  auto s = from_fixture(f);
  test::check_sampler_against_fixture(*s, f, kTableRelTol);
  test::check_sampler_against_fixture(*s, f, kTableRelTol);
}

// ------------------------------------------------------------- extra configurations

// References made by tests/golden/samplers/make_samplers.py: the loop of the shared fixtures for
// other fields, spacings, step counts and prediction types; config() must also equal Diffusers'
// resolved `scheduler.config` (the from_config defaults).
void check_extra(const std::string& name, const std::string& kind = "") {
  SCOPED_TRACE(name);
  const SamplerFixture f = load_sampler_fixture(name, test::sampler_golden_dir());
  const std::string k = kind.empty() ? f.meta.at("kind").get<std::string>() : kind;
  auto s = make_sampler(f.scheduler_config, k, name + ".json");
  EXPECT_EQ(s->class_name(), f.meta.at("class").get<std::string>());
  test::check_sampler_against_fixture(*s, f, kTableRelTol);
  json expected = f.meta.at("resolved_config");
  expected.erase("_diffusers_version");
  EXPECT_EQ(s->config(), expected)
      << "ours: " << s->config().dump() << "\\nDiffusers: " << expected.dump();
}

TEST(EulerSampler, TrailingSpacing) { check_extra("euler_trailing"); }
TEST(EulerSampler, LinspaceSpacingVPrediction) { check_extra("euler_linspace_vpred"); }
TEST(EulerSampler, KarrasSigmasLeading) { check_extra("euler_karras"); }
TEST(EulerSampler, KarrasSigmaMinMaxAndFinalSigmaMin) { check_extra("euler_karras_sigma_min"); }
TEST(EulerSampler, ExponentialSigmasTrailing) { check_extra("euler_exponential"); }
TEST(EulerSampler, ExponentialSigmasSigmaMin) { check_extra("euler_exponential_sigma_min"); }
TEST(EulerSampler, LogLinearInterpolation) { check_extra("euler_log_linear"); }
TEST(EulerSampler, ZeroTerminalSnr) { check_extra("euler_zero_snr"); }
TEST(EulerSampler, SamplePredictionCosineBetas) { check_extra("euler_sample_cosine"); }
TEST(EulerSampler, ContinuousTimestepsVPrediction) { check_extra("euler_continuous_v"); }
TEST(EulerSampler, FromStableDiffusion15Config) {
  check_extra("euler_from_sd15");
  check_extra("euler_from_sd15", "euler");
}
TEST(PndmSampler, LinearBetasStepsOffset0TwentySteps) { check_extra("pndm_linear_offset0"); }
TEST(PndmSampler, RungeKuttaWarmUp) { check_extra("pndm_prk"); }
TEST(PndmSampler, VPredictionLinspaceAlphaToOne) { check_extra("pndm_vpred_linspace"); }
TEST(PndmSampler, TrailingOneStep) { check_extra("pndm_trailing_one_step"); }
TEST(EulerAncestralSampler, LeadingVPrediction) { check_extra("euler_ancestral_leading_vpred"); }
TEST(EulerAncestralSampler, TrailingZeroTerminalSnr) {
  check_extra("euler_ancestral_trailing_zero_snr");
}
TEST(FlowMatchSampler, Shift1) { check_extra("flow_match_shift1"); }
TEST(FlowMatchSampler, Shift3With500TrainingSteps) { check_extra("flow_match_shift3_t500"); }

// ------------------------------------------------------------------------------ factory

// Stable Diffusion 1.5's scheduler_config.json.
json sd15_config() {
  return json::parse(R"({"_class_name": "PNDMScheduler", "_diffusers_version": "0.6.0",
    "beta_end": 0.012, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
    "num_train_timesteps": 1000, "set_alpha_to_one": false, "skip_prk_steps": true,
    "steps_offset": 1, "trained_betas": null, "clip_sample": false})");
}

TEST(SamplerFactory, Names) {
  const std::vector<std::string> expected = {"ddpm",         "ddim",
                                             "pndm",         "euler",
                                             "euler_karras", "euler_ancestral",
                                             "dpmpp_2m",     "dpmpp_2m_karras",
                                             "dpmpp_2m_sde", "dpmpp_2m_sde_karras",
                                             "unipc",        "flow_match_euler"};
  EXPECT_EQ(sampler_names(), expected);
}

TEST(SamplerFactory, ClassOfTheFileByDefault) {
  auto s = make_sampler(sd15_config(), "", "sd15.json");
  EXPECT_EQ(s->class_name(), "PNDMScheduler");
  EXPECT_EQ(s->config().at("skip_prk_steps"), true);
  EXPECT_EQ(s->config().at("steps_offset"), 1);
  const json names = {{"pndm", "PNDMScheduler"},
                      {"euler", "EulerDiscreteScheduler"},
                      {"euler_karras", "EulerDiscreteScheduler"},
                      {"euler_ancestral", "EulerAncestralDiscreteScheduler"},
                      {"flow_match_euler", "FlowMatchEulerDiscreteScheduler"},
                      {"ddpm", "DDPMScheduler"},
                      {"ddim", "DDIMScheduler"},
                      {"EulerDiscreteScheduler", "EulerDiscreteScheduler"}};
  for (const auto& [kind, cls] : names.items()) {
    EXPECT_EQ(make_sampler(sd15_config(), kind, "sd15.json")->class_name(), cls) << kind;
  }
}

// Each name's class and settings (the DPM-Solver and UniPC classes are part B's).
TEST(SamplerFactory, NamesSetTheirFields) {
  const json expected = {
      {"euler_karras", {{"_class_name", "EulerDiscreteScheduler"}, {"use_karras_sigmas", true}}},
      {"dpmpp_2m",
       {{"_class_name", "DPMSolverMultistepScheduler"},
        {"algorithm_type", "dpmsolver++"},
        {"solver_order", 2},
        {"use_karras_sigmas", false}}},
      {"dpmpp_2m_karras",
       {{"_class_name", "DPMSolverMultistepScheduler"},
        {"algorithm_type", "dpmsolver++"},
        {"solver_order", 2},
        {"use_karras_sigmas", true}}},
      {"dpmpp_2m_sde",
       {{"_class_name", "DPMSolverMultistepScheduler"},
        {"algorithm_type", "sde-dpmsolver++"},
        {"solver_order", 2},
        {"use_karras_sigmas", false}}},
      {"dpmpp_2m_sde_karras",
       {{"_class_name", "DPMSolverMultistepScheduler"},
        {"algorithm_type", "sde-dpmsolver++"},
        {"solver_order", 2},
        {"use_karras_sigmas", true}}},
      {"unipc", {{"_class_name", "UniPCMultistepScheduler"}}},
      {"flow_match_euler", {{"_class_name", "FlowMatchEulerDiscreteScheduler"}}},
  };
  for (const auto& [kind, fields] : expected.items()) {
    const json c = make_sampler(sd15_config(), kind, "sd15.json")->config();
    for (const auto& [key, value] : fields.items()) {
      EXPECT_EQ(c.at(key), value) << kind << " " << key;
    }
    if (c.contains("beta_start")) {
      EXPECT_EQ(c.at("beta_start"), 0.00085) << kind;
    }
  }
  // A file's own solver_order 3 gives way to the name's 2.
  json d = sd15_config();
  d["solver_order"] = 3;
  EXPECT_EQ(make_sampler(d, "dpmpp_2m", "d.json")->config().at("solver_order"), 2);
  EXPECT_EQ(make_sampler(d, "DPMSolverMultistepScheduler", "d.json")->config().at("solver_order"),
            3);
}

TEST(SamplerFactory, UnknownKindListsTheNames) {
  const std::string msg =
      test::error_of([] { make_sampler(sd15_config(), "heun", "model/scheduler_config.json"); });
  std::printf("%s\n", msg.c_str());
  EXPECT_NE(msg.find("'heun'"), std::string::npos);
  EXPECT_NE(msg.find("model/scheduler_config.json"), std::string::npos);
  for (const auto& name : sampler_names()) EXPECT_NE(msg.find(name), std::string::npos) << name;
  EXPECT_NE(msg.find("EulerDiscreteScheduler"), std::string::npos);
  EXPECT_EQ(msg.find('\n'), std::string::npos);
}

TEST(SamplerFactory, UnsupportedClassOfTheFile) {
  json c = sd15_config();
  c["_class_name"] = "LMSDiscreteScheduler";
  const std::string msg = test::error_of([&] { make_sampler(c, "", "lms.json"); });
  std::printf("%s\n", msg.c_str());
  EXPECT_NE(msg.find("LMSDiscreteScheduler"), std::string::npos);
  EXPECT_NE(msg.find("--scheduler"), std::string::npos);
  EXPECT_NE(msg.find("euler_ancestral"), std::string::npos);
  c.erase("_class_name");
  EXPECT_NE(test::error_of([&] { make_sampler(c, "", "x.json"); }).find("_class_name"),
            std::string::npos);
  // An explicit kind takes any file, as Diffusers' Class.from_config does.
  EXPECT_EQ(make_sampler(c, "euler", "x.json")->class_name(), "EulerDiscreteScheduler");
}

// from_config: the betas come from the file, every other Euler field takes Euler's default (the
// file has no timestep_spacing, so "linspace", not PNDM's "leading"); PNDM-only keys are gone.
TEST(SamplerFactory, FromConfigKeepsBetasTakesClassDefaults) {
  auto s = make_sampler(sd15_config(), "euler", "sd15.json");
  const json c = s->config();
  EXPECT_EQ(c.at("_class_name"), "EulerDiscreteScheduler");
  EXPECT_EQ(c.at("beta_start"), 0.00085);
  EXPECT_EQ(c.at("beta_end"), 0.012);
  EXPECT_EQ(c.at("beta_schedule"), "scaled_linear");
  EXPECT_EQ(c.at("steps_offset"), 1);
  EXPECT_EQ(c.at("timestep_spacing"), "linspace");
  EXPECT_EQ(c.at("interpolation_type"), "linear");
  EXPECT_EQ(c.at("use_karras_sigmas"), false);
  EXPECT_EQ(c.at("final_sigmas_type"), "zero");
  EXPECT_EQ(c.at("prediction_type"), "epsilon");
  EXPECT_TRUE(c.at("sigma_min").is_null());
  // Keys Euler does not take stay in its config, as in Diffusers (its "hidden" config).
  EXPECT_EQ(c.at("skip_prk_steps"), true);
  EXPECT_EQ(c.at("clip_sample"), false);
  EXPECT_FALSE(c.contains("_diffusers_version"));
  // The name's settings on top.
  EXPECT_EQ(
      make_sampler(sd15_config(), "euler_karras", "sd15.json")->config().at("use_karras_sigmas"),
      true);
  // Keys the saving class filled with its own defaults (_use_default_values) are dropped.
  json d = sd15_config();
  d["timestep_spacing"] = "leading";
  d["_use_default_values"] = {"timestep_spacing"};
  EXPECT_EQ(make_sampler(d, "euler", "d.json")->config().at("timestep_spacing"), "linspace");
  d.erase("_use_default_values");
  EXPECT_EQ(make_sampler(d, "euler", "d.json")->config().at("timestep_spacing"), "leading");
}

TEST(SamplerFactory, BadFieldValuesNameTheField) {
  json c = sd15_config();
  c["timestep_spacing"] = "middle";
  std::string msg = test::error_of([&] { make_sampler(c, "euler", "c.json"); });
  std::printf("%s\n", msg.c_str());
  EXPECT_NE(msg.find("timestep_spacing"), std::string::npos);
  EXPECT_NE(msg.find("middle"), std::string::npos);
  EXPECT_NE(msg.find("trailing"), std::string::npos);
  c = sd15_config();
  c["steps_offset"] = "one";
  msg = test::error_of([&] { make_sampler(c, "pndm", "c.json"); });
  EXPECT_NE(msg.find("steps_offset"), std::string::npos);
  c = sd15_config();
  c["beta_schedule"] = "sigmoid";
  msg = test::error_of([&] { make_sampler(c, "euler", "c.json"); });
  std::printf("%s\n", msg.c_str());
  EXPECT_NE(msg.find("sigmoid"), std::string::npos);
  c = sd15_config();
  c["prediction_type"] = "sample";
  msg = test::error_of([&] { make_sampler(c, "euler_ancestral", "c.json"); });
  EXPECT_NE(msg.find("prediction_type"), std::string::npos);
  c = sd15_config();
  c["use_beta_sigmas"] = true;
  msg = test::error_of([&] { make_sampler(c, "euler", "c.json"); });
  EXPECT_NE(msg.find("use_beta_sigmas"), std::string::npos);
  // euler_karras switches the other sigma schedules off rather than failing.
  EXPECT_EQ(make_sampler(c, "euler_karras", "c.json")->config().at("use_beta_sigmas"), false);
  // Dynamic shifting needs mu at set_timesteps (FluxPipeline passes it); without it, one line.
  json flow = {{"_class_name", "FlowMatchEulerDiscreteScheduler"}, {"use_dynamic_shifting", true}};
  auto dynamic = make_sampler(flow, "", "flux.json");
  msg = test::error_of([&] { dynamic->set_timesteps(4); });
  std::printf("%s\n", msg.c_str());
  EXPECT_NE(msg.find("needs mu"), std::string::npos);
  diffusion::TimestepOptions bad;
  bad.sigmas = {0.5, 1.5};
  bad.mu = 0.5;
  msg = test::error_of([&] { dynamic->set_timesteps_with(2, bad); });
  EXPECT_NE(msg.find("(0, 1]"), std::string::npos) << msg;
  // Custom sigmas and mu belong to flow matching only.
  auto ddim = make_sampler(sd15_config(), "ddim", "d.json");
  diffusion::TimestepOptions mu_only;
  mu_only.mu = 0.5;
  msg = test::error_of([&] { ddim->set_timesteps_with(4, mu_only); });
  EXPECT_NE(msg.find("flow-matching"), std::string::npos) << msg;
  auto prk = make_sampler(json{{"_class_name", "PNDMScheduler"}}, "", "p.json");
  msg = test::error_of([&] { prk->set_timesteps(3); });
  EXPECT_NE(msg.find("skip_prk_steps"), std::string::npos);
  auto euler = make_sampler(sd15_config(), "euler", "e.json");
  euler->set_timesteps(4);
  EXPECT_NE(test::error_of([&] { euler->timestep(4); }).find("index 4"), std::string::npos);
  const torch::Tensor x = torch::zeros({1, 1, 2, 2});
  EXPECT_NE(test::error_of([&] { euler->step(x, 123.5, x); }).find("123.5"), std::string::npos);
}

TEST(SamplerFactory, LoadSamplerReadsTheFile) {
  const std::string dir = test::temp_dir("sampler_load");
  test::write_text(dir + "/scheduler_config.json", sd15_config().dump(2));
  EXPECT_EQ(load_sampler(dir + "/scheduler_config.json", "")->class_name(), "PNDMScheduler");
  const std::string msg = test::error_of([&] { load_sampler(dir + "/missing.json", "euler"); });
  EXPECT_NE(msg.find("missing.json"), std::string::npos);
  test::write_text(dir + "/bad.json", "{not json");
  EXPECT_NE(test::error_of([&] { load_sampler(dir + "/bad.json", ""); }).find("bad.json"),
            std::string::npos);
}

// ---------------------------------------------------------------------- DDPM / DDIM adapters

// The adapters run the existing schedulers: the same loop through Sampler and through
// DDIMScheduler / DDPMScheduler directly gives identical numbers (tolerance 0).
void expect_same_as_noise_scheduler(const std::string& kind, double eta) {
  const json cfg = test::read_json(std::string(difftrain_test::source_dir()) +
                                   "/tests/golden/sd/tiny_sd/scheduler/scheduler_config.json");
  SamplerOptions options;
  options.eta = eta;
  auto sampler = make_sampler(cfg, kind, "tiny_sd", options);
  auto direct = make_scheduler(SchedulerConfig::from_json(cfg, "tiny_sd"), kind);
  sampler->set_timesteps(10);
  direct->set_timesteps(10);
  ASSERT_TRUE(torch::equal(sampler->timesteps(), direct->timesteps()));
  EXPECT_EQ(sampler->init_noise_sigma(), 1.0);
  at::Generator g1 = at::make_generator<at::CPUGeneratorImpl>(5);
  at::Generator g2 = at::make_generator<at::CPUGeneratorImpl>(5);
  torch::Tensor a = at::randn({1, 4, 4, 4}, g1), b = at::randn({1, 4, 4, 4}, g2);
  for (int64_t i = 0; i < sampler->timesteps().size(0); ++i) {
    const double t = sampler->timestep(i);
    a = sampler->step(test::toy_model(sampler->scale_model_input(a, t), t), t, a, g1);
    const torch::Tensor m = test::toy_model(b, t);
    const auto ti = static_cast<int64_t>(t);
    if (auto* ddim = dynamic_cast<DDIMScheduler*>(direct.get())) {
      b = ddim->step(m, ti, b, eta, false, g2).prev_sample;
    } else {
      b = direct->step(m, ti, b, g2).prev_sample;
    }
  }
  test::expect_within(kind + " adapter vs scheduler, eta " + std::to_string(eta),
                      test::sampler_max_abs(a, b), 0.0);
}

TEST(SamplerFactory, DdimAdapterEqualsDdimScheduler) {
  expect_same_as_noise_scheduler("ddim", 0.0);
  expect_same_as_noise_scheduler("ddim", 0.7);
  auto s = make_sampler(sd15_config(), "ddim", "sd15.json");
  EXPECT_EQ(s->config().at("_class_name"), "DDIMScheduler");
  EXPECT_EQ(s->config().at("set_alpha_to_one"), false);
  EXPECT_EQ(s->config().at("skip_prk_steps"), true);  // kept from the file, as in Diffusers
  EXPECT_FALSE(s->config().contains("variance_type"));
  SamplerOptions bad;
  bad.eta = -1;
  EXPECT_NE(test::error_of([&] { make_sampler(sd15_config(), "ddim", "x", bad); }).find("eta"),
            std::string::npos);
}

TEST(SamplerFactory, DdpmAdapterEqualsDdpmScheduler) {
  expect_same_as_noise_scheduler("ddpm", 0.0);
  // Another class's null fields (DPM-Solver writes variance_type: null) do not trip DDPM.
  json c = sd15_config();
  c["variance_type"] = nullptr;
  c["algorithm_type"] = "dpmsolver++";
  EXPECT_EQ(make_sampler(c, "ddpm", "dpm.json")->class_name(), "DDPMScheduler");
}

}  // namespace
}  // namespace difftrain::diffusion

namespace difftrain::diffusion {
namespace {

// Diffusers writes DPMSolverMultistepScheduler's lambda_min_clipped = -inf as the bare token
// -Infinity (Python's json), which is not JSON: every DPM-Solver scheduler_config.json it saves
// has it. Such a file loads as a sampler and as the training scheduler's config (before: "not
// valid JSON"), and is written back with the bare token.
TEST(SamplerFactory, PythonJsonInfinityTokensLoadAndRoundTrip) {
  const std::string dir = test::temp_dir("sampler_python_json");
  const std::string text =
      R"({"_class_name": "DPMSolverMultistepScheduler", "lambda_min_clipped": -Infinity,
    "note": "Infinity and NaN inside a string stay", "beta_schedule": "scaled_linear",
    "beta_start": 0.00085, "beta_end": 0.012, "steps_offset": 0, "sample_max_value": NaN,
    "timestep_spacing": "linspace"})";
  const std::string path = dir + "/scheduler_config.json";
  std::ofstream(path) << text;
  auto sampler = load_sampler(path, "");
  EXPECT_EQ(sampler->class_name(), "DPMSolverMultistepScheduler");
  sampler->set_timesteps(5);
  EXPECT_EQ(sampler->timesteps().size(0), 5);
  EXPECT_EQ(load_sampler(path, "euler")->class_name(), "EulerDiscreteScheduler");

  const nlohmann::json j = parse_python_json(text);
  EXPECT_EQ(j.at("lambda_min_clipped"), "-Infinity");
  EXPECT_EQ(j.at("note"), "Infinity and NaN inside a string stay");
  const std::string back = dump_python_json(j);
  EXPECT_NE(back.find("\"lambda_min_clipped\": -Infinity"), std::string::npos) << back;
  EXPECT_NE(back.find("\"sample_max_value\": NaN"), std::string::npos) << back;
  EXPECT_NE(back.find("\"Infinity and NaN inside a string stay\""), std::string::npos) << back;
  EXPECT_EQ(parse_python_json(back), j);

  // The training side reads the same file (its betas; DPM's own keys go to `extra`) and saves it
  // with the bare token again. NaN in a field it validates is refused by name.
  std::ofstream(path) << R"({"_class_name": "DPMSolverMultistepScheduler",
    "lambda_min_clipped": -Infinity, "beta_schedule": "scaled_linear"})";
  const auto config = SchedulerConfig::load(path);
  EXPECT_EQ(config.extra.at("lambda_min_clipped"), "-Infinity");
  config.save(dir + "/saved.json");
  std::ifstream saved(dir + "/saved.json");
  const std::string saved_text((std::istreambuf_iterator<char>(saved)),
                               std::istreambuf_iterator<char>());
  EXPECT_NE(saved_text.find("\"lambda_min_clipped\": -Infinity"), std::string::npos) << saved_text;
  std::ofstream(path) << R"({"beta_start": NaN})";
  EXPECT_NE(test::error_of([&] { SchedulerConfig::load(path); }).find("beta_start is NaN"),
            std::string::npos);
}

}  // namespace
}  // namespace difftrain::diffusion
