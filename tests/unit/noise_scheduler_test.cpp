// Noise schedulers: the tables, the forward process, SNR weights and DDPM's step against a dump of
// Diffusers 0.31 (tests/golden/diffusers/schedulers.safetensors); set_timesteps against values
// worked out by hand from Diffusers' formulas; DDIM's step, DDPM's variance types and dynamic
// thresholding against float64 recomputations (scheduler_config.json:
// noise_scheduler_config_test.cpp).

#include "difftrain/diffusion/noise_scheduler.h"
#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"
#include "source_dir.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

namespace difftrain::diffusion {
namespace {

using nlohmann::json;

// Tolerances. The schedulers repeat Diffusers' float32 operations in the same order with the same
// LibTorch build, so the expected difference against the dump is 0; 1e-6 (the README's bound for
// schedule tables) leaves room for a libm whose pow/cos differ in the last ulp, while a formula
// slip (an off-by-one timestep, a missing square root, a wrong coefficient) is 1e-4 or more.
constexpr double kGoldenAbsTol = 1e-6;
// SNR spans 1e-5 .. 1e4, so it is compared relatively.
constexpr double kSnrRelTol = 1e-5;
// float32 results against float64 recomputations: relative to the value's size, since the
// epsilon x_0 divides by sqrt(alpha-bar) (~1/150 at t = 999).
constexpr double kFloat64RelTol = 2e-5;

std::string golden_dir() {
  return std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers";
}

const io::TensorMap& golden() {
  static const io::TensorMap tensors =
      io::load_safetensors(golden_dir() + "/schedulers.safetensors").tensors;
  return tensors;
}

torch::Tensor g(const std::string& key) {
  const auto it = golden().find(key);
  if (it == golden().end()) throw std::runtime_error("golden file has no tensor " + key);
  return it->second;
}

double max_abs_diff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  return (a.to(torch::kFloat64) - b.to(torch::kFloat64)).abs().max().item<double>();
}

// max |a - b| / (1 + |b|): an absolute error for values up to 1, relative beyond.
double max_scaled_diff(const torch::Tensor& a, const torch::Tensor& b) {
  EXPECT_EQ(a.sizes(), b.sizes());
  const torch::Tensor bd = b.to(torch::kFloat64);
  return ((a.to(torch::kFloat64) - bd).abs() / (1 + bd.abs())).max().item<double>();
}

void report(const std::string& what, double diff, double tol, const char* kind = "max abs diff") {
  std::printf("%s: %s %.3g (tolerance %.0e)\n", what.c_str(), kind, diff, tol);
}

at::Generator seeded(uint64_t seed) { return at::make_generator<at::CPUGeneratorImpl>(seed); }

std::vector<int64_t> to_vector(const torch::Tensor& t) {
  const torch::Tensor c = t.to(torch::kLong).contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_EQ(message.find('\n'), std::string::npos) << "not one line: " << message;
    return message;
  }
  ADD_FAILURE() << "expected a difftrain::Error";
  return "";
}

bool contains(const std::string& text, const std::string& part) {
  return text.find(part) != std::string::npos;
}

SchedulerConfig with_schedule(BetaSchedule schedule) {
  SchedulerConfig c;
  c.beta_schedule = schedule;
  return c;
}

// ------------------------------------------------------------------ against Diffusers

TEST(NoiseScheduler, AlphasCumprodMatchDiffusersForEveryBetaSchedule) {
  for (const BetaSchedule s :
       {BetaSchedule::kLinear, BetaSchedule::kScaledLinear, BetaSchedule::kSquaredcosCapV2}) {
    const DDPMScheduler scheduler(with_schedule(s));
    const torch::Tensor ours = scheduler.alphas_cumprod();
    ASSERT_EQ(ours.scalar_type(), torch::kFloat32);
    const double diff = max_abs_diff(ours, g("alphas_cumprod." + to_string(s)));
    report("alphas_cumprod." + to_string(s), diff, kGoldenAbsTol);
    EXPECT_LE(diff, kGoldenAbsTol) << to_string(s);
  }
}

TEST(NoiseScheduler, AddNoiseVelocityAndTargetsMatchDiffusers) {
  const DDPMScheduler scheduler;
  const torch::Tensor x0 = g("x0"), noise = g("noise"), ts = g("ts");

  const torch::Tensor noisy = scheduler.add_noise(x0, noise, ts);
  EXPECT_EQ(noisy.scalar_type(), torch::kFloat32);
  double diff = max_abs_diff(noisy, g("noisy"));
  report("add_noise", diff, kGoldenAbsTol);
  EXPECT_LE(diff, kGoldenAbsTol);

  const torch::Tensor velocity = scheduler.get_velocity(x0, noise, ts);
  diff = max_abs_diff(velocity, g("velocity"));
  report("get_velocity", diff, kGoldenAbsTol);
  EXPECT_LE(diff, kGoldenAbsTol);

  // The training target per prediction type.
  SchedulerConfig c;
  c.prediction_type = PredictionType::kVPrediction;
  EXPECT_LE(max_abs_diff(DDPMScheduler(c).training_target(x0, noise, ts), g("velocity")),
            kGoldenAbsTol);
  c.prediction_type = PredictionType::kEpsilon;
  EXPECT_TRUE(DDPMScheduler(c).training_target(x0, noise, ts).equal(noise));
  c.prediction_type = PredictionType::kSample;
  EXPECT_TRUE(DDPMScheduler(c).training_target(x0, noise, ts).equal(x0));

  // Results keep x0's dtype (the table is cast first, as Diffusers does); one timestep for the
  // whole batch broadcasts like a batch of equal ones; int32 timesteps work like int64.
  const torch::Tensor noisy64 =
      scheduler.add_noise(x0.to(torch::kFloat64), noise.to(torch::kFloat64), ts);
  EXPECT_EQ(noisy64.scalar_type(), torch::kFloat64);
  EXPECT_LE(max_abs_diff(noisy64, g("noisy")), 1e-6);
  const torch::Tensor one_t = torch::full({1}, 731, torch::kLong);
  EXPECT_TRUE(scheduler.add_noise(x0, noise, one_t)
                  .equal(scheduler.add_noise(x0, noise, torch::full({4}, 731, torch::kLong))));
  EXPECT_TRUE(scheduler.add_noise(x0, noise, ts.to(torch::kInt32)).equal(noisy));
}

TEST(NoiseScheduler, SnrAndMinSnrWeightsMatchDiffusers) {
  const DDPMScheduler scheduler;
  const torch::Tensor ts = g("ts");
  const torch::Tensor snr = scheduler.snr(ts);
  EXPECT_EQ(snr.scalar_type(), torch::kFloat32);
  const double snr_rel = ((snr.to(torch::kFloat64) - g("snr").to(torch::kFloat64)).abs() /
                          g("snr").to(torch::kFloat64))
                             .max()
                             .item<double>();
  report("snr", snr_rel, kSnrRelTol, "max rel diff");
  EXPECT_LE(snr_rel, kSnrRelTol);

  // The weights are at most 1 (epsilon, v) and compared absolutely, with the golden tolerance.
  const torch::Tensor eps = min_snr_weights(snr, 5.0, PredictionType::kEpsilon);
  double diff = max_abs_diff(eps, g("minsnr5_weight_eps"));
  report("min-SNR weight (epsilon, gamma 5)", diff, kGoldenAbsTol);
  EXPECT_LE(diff, kGoldenAbsTol);
  const torch::Tensor v = min_snr_weights(snr, 5.0, PredictionType::kVPrediction);
  diff = max_abs_diff(v, g("minsnr5_weight_v"));
  report("min-SNR weight (v_prediction, gamma 5)", diff, kGoldenAbsTol);
  EXPECT_LE(diff, kGoldenAbsTol);
  // sample: min(snr, gamma), by hand.
  const torch::Tensor s =
      min_snr_weights(torch::tensor({0.5f, 5.0f, 80.0f}), 5.0, PredictionType::kSample);
  EXPECT_TRUE(s.equal(torch::tensor({0.5f, 5.0f, 5.0f})));

  // The same SNR by the definition a / (1 - a), in double.
  const torch::Tensor a = scheduler.alphas_cumprod().to(torch::kFloat64).index({ts});
  EXPECT_LE(((snr.to(torch::kFloat64) - a / (1 - a)).abs() / (a / (1 - a))).max().item<double>(),
            kSnrRelTol);

  EXPECT_TRUE(
      contains(error_of([&] { min_snr_weights(snr, 0, PredictionType::kEpsilon); }), "snr_gamma"));
  EXPECT_TRUE(contains(error_of([&] { scheduler.snr(torch::tensor({1000})); }), "1000"));
}

// DDPMScheduler(linear, clip_sample=False).set_timesteps(50), one step at timesteps[7] with a CPU
// generator seeded 7, for each prediction type.
TEST(NoiseScheduler, DdpmStepMatchesDiffusersForEveryPredictionType) {
  const torch::Tensor model_output = g("ddpm_step.model_output");
  const torch::Tensor sample = g("ddpm_step.sample");
  for (const PredictionType p :
       {PredictionType::kEpsilon, PredictionType::kVPrediction, PredictionType::kSample}) {
    const std::string name = to_string(p);
    SchedulerConfig c;
    c.clip_sample = false;
    c.prediction_type = p;
    DDPMScheduler scheduler(c);
    scheduler.set_timesteps(50);
    ASSERT_EQ(to_vector(scheduler.timesteps()), to_vector(g("ddpm_step." + name + ".timesteps")))
        << name;
    const int64_t t = scheduler.timesteps()[7].item<int64_t>();
    ASSERT_EQ(scheduler.previous_timestep(t), t - 20);

    const SchedulerOutput out = scheduler.step(model_output, t, sample, seeded(7));
    const double prev_diff = max_abs_diff(out.prev_sample, g("ddpm_step." + name + ".prev"));
    const torch::Tensor x0_want = g("ddpm_step." + name + ".x0");
    const double x0_diff = max_abs_diff(out.pred_original_sample, x0_want);
    // x0 = (x_t - sqrt(1 - a) eps) / sqrt(a) is large at t 840: float32 holds it to ~1e-7 of
    // its size and LibTorch 2.x rounds differently from 1.13, so the tolerance scales with |x0|.
    const double x0_tol = kGoldenAbsTol * std::max(1.0, x0_want.abs().max().item<double>());
    report("DDPM step " + name + " (t " + std::to_string(t) + ") prev_sample", prev_diff,
           kGoldenAbsTol);
    report("DDPM step " + name + " pred_original_sample", x0_diff, x0_tol);
    EXPECT_LE(prev_diff, kGoldenAbsTol) << name;
    EXPECT_LE(x0_diff, x0_tol) << name;

    // The noise Diffusers drew, recovered from its result with a float64 posterior mean and
    // standard deviation, is what LibTorch's generator seeded 7 draws.
    const torch::Tensor ac = scheduler.alphas_cumprod().to(torch::kFloat64);
    const double a_t = ac[t].item<double>(), a_prev = ac[t - 20].item<double>();
    const double beta = 1 - a_t / a_prev;
    const torch::Tensor x0 = g("ddpm_step." + name + ".x0").to(torch::kFloat64);
    const torch::Tensor mean =
        std::sqrt(a_prev) * beta / (1 - a_t) * x0 +
        std::sqrt(a_t / a_prev) * (1 - a_prev) / (1 - a_t) * sample.to(torch::kFloat64);
    const double sigma = std::sqrt((1 - a_prev) / (1 - a_t) * beta);
    const torch::Tensor implied =
        (g("ddpm_step." + name + ".prev").to(torch::kFloat64) - mean) / sigma;
    const torch::Tensor drawn = at::randn({1, 3, 8, 8}, seeded(7));
    const double noise_diff = max_abs_diff(implied, drawn);
    report("DDPM step " + name + " noise implied by Diffusers vs at::randn(seed 7)", noise_diff,
           1e-4);
    EXPECT_LE(noise_diff, 1e-4) << name;
  }
}

// ------------------------------------------------------------------ set_timesteps

struct SpacingCase {
  TimestepSpacing spacing;
  int64_t T, n, offset;
  std::vector<int64_t> expected;
};

// Worked out by hand from Diffusers' formulas (numpy rounds half to even):
//   leading  T // n * [n-1, ..., 0] + steps_offset
//   trailing round(T - i * T / n) - 1, i = 0 .. n-1
//   linspace round(i * (T - 1) / (n - 1)), descending
TEST(NoiseScheduler, SetTimestepsFollowsDiffusersSpacings) {
  std::vector<int64_t> sd50;  // Stable Diffusion: leading, steps_offset 1, 50 steps
  for (int64_t i = 49; i >= 0; --i) sd50.push_back(i * 20 + 1);
  const std::vector<SpacingCase> cases = {
      {TimestepSpacing::kLeading, 1000, 50, 1, sd50},
      {TimestepSpacing::kLeading, 1000, 3, 1, {667, 334, 1}},
      {TimestepSpacing::kLeading, 1000, 7, 0, {852, 710, 568, 426, 284, 142, 0}},
      {TimestepSpacing::kLeading, 1000, 1, 0, {0}},
      {TimestepSpacing::kTrailing, 1000, 10, 0, {999, 899, 799, 699, 599, 499, 399, 299, 199, 99}},
      {TimestepSpacing::kTrailing, 1000, 3, 0, {999, 666, 332}},
      // 1000 - i * 142.857...: 857.14, 714.29, 571.43, 428.57, 285.71, 142.86
      {TimestepSpacing::kTrailing, 1000, 7, 0, {999, 856, 713, 570, 428, 285, 142}},
      {TimestepSpacing::kTrailing, 1000, 1, 5, {999}},  // steps_offset is for leading only
      {TimestepSpacing::kLinspace, 1000, 4, 0, {999, 666, 333, 0}},
      // i * 166.5: 166.5 -> 166, 499.5 -> 500, 832.5 -> 832 (half to even)
      {TimestepSpacing::kLinspace, 1000, 7, 0, {999, 832, 666, 500, 333, 166, 0}},
      {TimestepSpacing::kLinspace, 1000, 1, 0, {0}},
      {TimestepSpacing::kLinspace, 10, 10, 3, {9, 8, 7, 6, 5, 4, 3, 2, 1, 0}},
  };
  for (const SpacingCase& k : cases) {
    SchedulerConfig c;
    c.num_train_timesteps = k.T;
    c.timestep_spacing = k.spacing;
    c.steps_offset = k.offset;
    DDPMScheduler ddpm(c);
    DDIMScheduler ddim(c);
    ddpm.set_timesteps(k.n);
    ddim.set_timesteps(k.n);
    const std::string what = to_string(k.spacing) + " T " + std::to_string(k.T) + " n " +
                             std::to_string(k.n) + " offset " + std::to_string(k.offset);
    EXPECT_EQ(to_vector(ddpm.timesteps()), k.expected) << what;
    EXPECT_EQ(to_vector(ddim.timesteps()), k.expected) << what;
    EXPECT_EQ(ddpm.timesteps().scalar_type(), torch::kLong);
    EXPECT_EQ(ddpm.num_inference_steps().value_or(-1), k.n);
  }

  // Before set_timesteps: T - 1 .. 0, and DDPM steps by one.
  DDPMScheduler fresh;
  EXPECT_EQ(fresh.timesteps().size(0), 1000);
  EXPECT_EQ(fresh.timesteps()[0].item<int64_t>(), 999);
  EXPECT_EQ(fresh.timesteps()[999].item<int64_t>(), 0);
  EXPECT_FALSE(fresh.num_inference_steps().has_value());
  EXPECT_EQ(fresh.previous_timestep(500), 499);

  // Out of range: too many steps, none, and a steps_offset that passes T - 1.
  SchedulerConfig sd;
  sd.steps_offset = 1;
  DDPMScheduler s(sd);
  EXPECT_TRUE(contains(error_of([&] { s.set_timesteps(1001); }), "1001"));
  EXPECT_TRUE(contains(error_of([&] { s.set_timesteps(0); }), "num_inference_steps is 0"));
  const std::string past = error_of([&] { s.set_timesteps(1000); });
  EXPECT_TRUE(contains(past, "timestep 1000") && contains(past, "steps_offset 1")) << past;
  EXPECT_EQ(s.timesteps().size(0), 1000);  // a refused call changes nothing
  EXPECT_FALSE(s.num_inference_steps().has_value());
}

// ------------------------------------------------------------------ float64 references

struct Reference {
  torch::Tensor prev, x0;
};

torch::Tensor clip_reference(const torch::Tensor& x0, const SchedulerConfig& c) {
  return c.clip_sample ? x0.clamp(-c.clip_sample_range, c.clip_sample_range) : x0;
}

// Formula 12 of the DDIM paper in float64, written from the paper rather than from Diffusers'
// operation order.
Reference ddim_reference(const DDIMScheduler& s, int64_t t, const torch::Tensor& model_output,
                         const torch::Tensor& sample, double eta, bool use_clipped,
                         const torch::Tensor& noise) {
  const SchedulerConfig& c = s.config();
  const torch::Tensor ac = s.alphas_cumprod().to(torch::kFloat64);
  const int64_t prev_t = t - c.num_train_timesteps / *s.num_inference_steps();
  const double a_t = ac[t].item<double>();
  const double a_prev =
      prev_t >= 0 ? ac[prev_t].item<double>() : (c.set_alpha_to_one ? 1.0 : ac[0].item<double>());
  const torch::Tensor x = sample.to(torch::kFloat64), m = model_output.to(torch::kFloat64);
  torch::Tensor x0, eps;
  switch (c.prediction_type) {
    case PredictionType::kEpsilon:
      eps = m;
      x0 = (x - std::sqrt(1 - a_t) * eps) / std::sqrt(a_t);
      break;
    case PredictionType::kSample:
      x0 = m;
      eps = (x - std::sqrt(a_t) * x0) / std::sqrt(1 - a_t);
      break;
    case PredictionType::kVPrediction:
      x0 = std::sqrt(a_t) * x - std::sqrt(1 - a_t) * m;
      eps = std::sqrt(a_t) * m + std::sqrt(1 - a_t) * x;
      break;
  }
  x0 = clip_reference(x0, c);
  if (use_clipped) eps = (x - std::sqrt(a_t) * x0) / std::sqrt(1 - a_t);
  const double sigma = eta * std::sqrt((1 - a_prev) / (1 - a_t) * (1 - a_t / a_prev));
  torch::Tensor prev = std::sqrt(a_prev) * x0 + std::sqrt(1 - a_prev - sigma * sigma) * eps;
  if (eta > 0) prev = prev + sigma * noise.to(torch::kFloat64);
  return {prev, x0};
}

TEST(NoiseScheduler, DdimStepEtaZeroMatchesFloat64Formula) {
  torch::manual_seed(0);
  const torch::Tensor model_output = torch::randn({2, 3, 4, 4});
  const torch::Tensor sample = torch::randn({2, 3, 4, 4}) * 1.5;
  double worst = 0;
  int checked = 0;
  for (const PredictionType p :
       {PredictionType::kEpsilon, PredictionType::kVPrediction, PredictionType::kSample}) {
    for (const bool set_alpha_to_one : {true, false}) {
      for (const bool clip : {false, true}) {
        for (const bool use_clipped : {false, true}) {
          SchedulerConfig c;
          c.class_name = "DDIMScheduler";
          c.prediction_type = p;
          c.set_alpha_to_one = set_alpha_to_one;
          c.clip_sample = clip;
          c.steps_offset = 1;
          DDIMScheduler s(c);
          s.set_timesteps(10);
          // Every timestep of the chain, the last one reaching "before 0" (final_alpha_cumprod).
          for (const int64_t t : to_vector(s.timesteps())) {
            const SchedulerOutput out = s.step(model_output, t, sample, 0.0, use_clipped);
            const Reference ref =
                ddim_reference(s, t, model_output, sample, 0.0, use_clipped, torch::Tensor());
            const double d = std::max(max_scaled_diff(out.prev_sample, ref.prev),
                                      max_scaled_diff(out.pred_original_sample, ref.x0));
            EXPECT_LE(d, kFloat64RelTol)
                << to_string(p) << " set_alpha_to_one " << set_alpha_to_one << " clip " << clip
                << " use_clipped " << use_clipped << " t " << t;
            EXPECT_EQ(out.prev_sample.scalar_type(), torch::kFloat32);
            worst = std::max(worst, d);
            ++checked;
          }
          // The default step() is eta 0.
          EXPECT_TRUE(s.step(model_output, 501, sample)
                          .prev_sample.equal(s.step(model_output, 501, sample, 0.0).prev_sample));
        }
      }
    }
  }
  report("DDIM eta 0 vs float64 (" + std::to_string(checked) + " steps)", worst, kFloat64RelTol,
         "max |diff| / (1 + |ref|)");
}

TEST(NoiseScheduler, DdimStepWithEtaAddsTheGeneratorsNoise) {
  torch::manual_seed(1);
  const torch::Tensor model_output = torch::randn({2, 3, 4, 4});
  const torch::Tensor sample = torch::randn({2, 3, 4, 4});
  SchedulerConfig c;
  c.prediction_type = PredictionType::kVPrediction;
  c.timestep_spacing = TimestepSpacing::kTrailing;
  DDIMScheduler s(c);
  s.set_timesteps(20);
  double worst = 0;
  for (const int64_t t : to_vector(s.timesteps())) {
    const SchedulerOutput out = s.step(model_output, t, sample, 0.7, false, seeded(11));
    const torch::Tensor noise = at::randn({2, 3, 4, 4}, seeded(11));
    const Reference ref = ddim_reference(s, t, model_output, sample, 0.7, false, noise);
    const double d = max_scaled_diff(out.prev_sample, ref.prev);
    EXPECT_LE(d, kFloat64RelTol) << "t " << t;
    worst = std::max(worst, d);
  }
  report("DDIM eta 0.7 vs float64", worst, kFloat64RelTol, "max |diff| / (1 + |ref|)");

  // eta 0 draws nothing: the generator is where it started.
  at::Generator gen = seeded(3);
  s.step(model_output, 999, sample, 0.0, false, gen);
  EXPECT_TRUE(at::randn({4}, gen).equal(at::randn({4}, seeded(3))));

  EXPECT_TRUE(contains(error_of([&] { s.step(model_output, 999, sample, -0.5); }), "eta is -0.5"));
  DDIMScheduler unset(c);
  EXPECT_TRUE(contains(error_of([&] { unset.step(model_output, 999, sample); }), "set_timesteps"));
  EXPECT_TRUE(contains(error_of([&] { s.step(model_output, 1000, sample); }), "1000"));
  EXPECT_TRUE(contains(error_of([&] { s.step(model_output.slice(1, 0, 2), 999, sample); }),
                       "[2, 2, 4, 4]"));
}

// DDPM's step for each variance type against the posterior of the DDPM paper in float64, with the
// noise drawn from a generator of the same seed.
TEST(NoiseScheduler, DdpmVarianceTypesMatchFloat64Posterior) {
  torch::manual_seed(2);
  const torch::Tensor eps = torch::randn({2, 3, 4, 4});
  const torch::Tensor sample = torch::randn({2, 3, 4, 4});
  const torch::Tensor learned_var = torch::rand({2, 3, 4, 4}) * 0.1 + 0.01;  // a variance
  const torch::Tensor learned_frac = torch::rand({2, 3, 4, 4}) * 2 - 1;      // in [-1, 1]
  double worst = 0;
  for (const VarianceType vt :
       {VarianceType::kFixedSmall, VarianceType::kFixedSmallLog, VarianceType::kFixedLarge,
        VarianceType::kLearned, VarianceType::kLearnedRange}) {
    SchedulerConfig c;
    c.variance_type = vt;
    c.clip_sample = false;
    c.beta_schedule = BetaSchedule::kScaledLinear;
    DDPMScheduler s(c);
    s.set_timesteps(25);
    const torch::Tensor ac = s.alphas_cumprod().to(torch::kFloat64);
    for (const int64_t t : {960, 400, 40, 0}) {
      torch::Tensor model_output = eps;
      if (vt == VarianceType::kLearned) model_output = torch::cat({eps, learned_var}, 1);
      if (vt == VarianceType::kLearnedRange) model_output = torch::cat({eps, learned_frac}, 1);
      const SchedulerOutput out = s.step(model_output, t, sample, seeded(5));

      const int64_t prev_t = t - 40;
      const double a_t = ac[t].item<double>();
      const double a_prev = prev_t >= 0 ? ac[prev_t].item<double>() : 1.0;
      const double beta = 1 - a_t / a_prev;
      const double small = std::max((1 - a_prev) / (1 - a_t) * beta, 1e-20);
      const torch::Tensor x = sample.to(torch::kFloat64);
      const torch::Tensor x0 = (x - std::sqrt(1 - a_t) * eps.to(torch::kFloat64)) / std::sqrt(a_t);
      torch::Tensor expected = std::sqrt(a_prev) * beta / (1 - a_t) * x0 +
                               std::sqrt(1 - beta) * (1 - a_prev) / (1 - a_t) * x;
      if (t > 0) {
        torch::Tensor stddev;
        switch (vt) {
          case VarianceType::kFixedSmall:
          case VarianceType::kFixedSmallLog:
            stddev = torch::full({1}, std::sqrt(small), torch::kFloat64);
            break;
          case VarianceType::kFixedLarge:
            stddev = torch::full({1}, std::sqrt(beta), torch::kFloat64);
            break;
          case VarianceType::kLearned: stddev = learned_var.to(torch::kFloat64).sqrt(); break;
          case VarianceType::kLearnedRange: {
            const torch::Tensor frac = (learned_frac.to(torch::kFloat64) + 1) / 2;
            stddev = (0.5 * (frac * std::log(beta) + (1 - frac) * std::log(small))).exp();
            break;
          }
          case VarianceType::kFixedLargeLog: break;
        }
        expected = expected + stddev * at::randn({2, 3, 4, 4}, seeded(5)).to(torch::kFloat64);
      }
      const double d = std::max(max_scaled_diff(out.prev_sample, expected),
                                max_scaled_diff(out.pred_original_sample, x0));
      EXPECT_LE(d, kFloat64RelTol) << to_string(vt) << " t " << t;
      worst = std::max(worst, d);
    }
  }
  report("DDPM variance types vs float64", worst, kFloat64RelTol, "max |diff| / (1 + |ref|)");

  // t = 0 draws no noise: the generator is where it started.
  DDPMScheduler s;
  at::Generator gen = seeded(9);
  s.step(eps, 0, sample, gen);
  EXPECT_TRUE(at::randn({4}, gen).equal(at::randn({4}, seeded(9))));

  // fixed_large_log is refused; learned types need 2C channels.
  SchedulerConfig c;
  c.variance_type = VarianceType::kFixedLargeLog;
  EXPECT_TRUE(contains(error_of([&] { DDPMScheduler{c}; }), "fixed_large_log"));
  c.variance_type = VarianceType::kLearnedRange;
  DDPMScheduler learned(c);
  EXPECT_TRUE(contains(error_of([&] { learned.step(eps, 10, sample); }), "learned_range"));
}

// Imagen's dynamic thresholding: the per-example quantile of |x0| (linear interpolation, computed
// here by sorting in float64), clamped to [1, sample_max_value]; x0 clamped to [-s, s] / s.
TEST(NoiseScheduler, DynamicThresholdingMatchesFloat64Quantiles) {
  torch::manual_seed(3);
  // Three examples: one well inside [-1, 1] (s clamps to 1: plain clipping), one whose quantile
  // lies between 1 and sample_max_value, one beyond sample_max_value.
  const torch::Tensor x0 =
      torch::randn({3, 2, 5, 5}) * torch::tensor({0.2f, 1.2f, 6.0f}).view({3, 1, 1, 1});
  SchedulerConfig c;
  c.prediction_type = PredictionType::kSample;  // so model_output is x0
  c.thresholding = true;
  c.dynamic_thresholding_ratio = 0.9;
  c.sample_max_value = 3.0;
  c.set_alpha_to_one = false;
  DDIMScheduler s(c);
  s.set_timesteps(10);
  const torch::Tensor ours = s.step(x0, 900, torch::zeros_like(x0)).pred_original_sample;

  std::vector<double> thresholds;
  torch::Tensor expected = torch::empty({3, 50}, torch::kFloat64);
  const torch::Tensor flat = x0.reshape({3, 50}).to(torch::kFloat64);
  for (int64_t b = 0; b < 3; ++b) {
    const torch::Tensor sorted = std::get<0>(flat[b].abs().sort());
    const double pos = 0.9 * 49;
    const auto lo = static_cast<int64_t>(std::floor(pos));
    const double q = sorted[lo].item<double>() +
                     (pos - lo) * (sorted[lo + 1].item<double>() - sorted[lo].item<double>());
    const double th = std::min(std::max(q, 1.0), 3.0);
    thresholds.push_back(th);
    expected[b] = flat[b].clamp(-th, th) / th;
  }
  EXPECT_EQ(thresholds[0], 1.0);
  EXPECT_GT(thresholds[1], 1.0);
  EXPECT_LT(thresholds[1], 3.0);
  EXPECT_EQ(thresholds[2], 3.0);
  const double d = max_abs_diff(ours.reshape({3, 50}), expected);
  report("dynamic thresholding vs float64", d, 1e-6);
  EXPECT_LE(d, 1e-6);
}

TEST(NoiseScheduler, RescaledBetasHaveZeroTerminalSnr) {
  SchedulerConfig c;
  c.beta_schedule = BetaSchedule::kScaledLinear;
  c.beta_start = 0.00085;
  c.beta_end = 0.012;
  const DDPMScheduler plain(c);
  c.rescale_betas_zero_snr = true;
  const DDPMScheduler rescaled(c);

  // Algorithm 1 of Lin et al. in float64 from the plain table.
  const torch::Tensor sq = plain.alphas_cumprod().to(torch::kFloat64).sqrt();
  const double first = sq[0].item<double>(), last = sq[-1].item<double>();
  const torch::Tensor expected_ac = ((sq - last) * (first / (first - last))).pow(2);
  const double diff = max_abs_diff(rescaled.alphas_cumprod(), expected_ac);
  report("rescale_betas_zero_snr alphas_cumprod vs float64", diff, kGoldenAbsTol);
  EXPECT_LE(diff, kGoldenAbsTol);
  EXPECT_EQ(rescaled.alphas_cumprod()[-1].item<float>(), 0.0f);
  EXPECT_EQ(rescaled.betas()[-1].item<float>(), 1.0f);

  // SNR is 0 at T - 1; the epsilon min-SNR weight is its limit 1 there, not NaN.
  const torch::Tensor snr = rescaled.snr(torch::tensor({0, 999}));
  EXPECT_EQ(snr[1].item<float>(), 0.0f);
  const torch::Tensor w = min_snr_weights(snr, 5.0, PredictionType::kEpsilon);
  EXPECT_EQ(w[1].item<float>(), 1.0f);
  EXPECT_FLOAT_EQ(w[0].item<float>(), 5.0f / snr[0].item<float>());
}

TEST(NoiseScheduler, SigmoidAndTrainedBetas) {
  SchedulerConfig c;
  c.beta_schedule = BetaSchedule::kSigmoid;
  const DDPMScheduler sigmoid(c);
  const torch::Tensor x = torch::linspace(-6, 6, 1000, torch::kFloat64);
  const torch::Tensor expected = torch::sigmoid(x) * (0.02 - 0.0001) + 0.0001;
  EXPECT_LE(max_abs_diff(sigmoid.betas(), expected), 1e-7);
  EXPECT_TRUE(contains(error_of([&] { DDIMScheduler{c}; }), "sigmoid"));

  // trained_betas replace the schedule, converted to float32.
  SchedulerConfig t;
  t.num_train_timesteps = 4;
  t.trained_betas = std::vector<double>{0.1, 0.2, 0.3, 0.4};
  t.beta_schedule = BetaSchedule::kSigmoid;  // ignored, as in Diffusers
  const DDIMScheduler trained(t);
  EXPECT_TRUE(trained.betas().equal(torch::tensor({0.1f, 0.2f, 0.3f, 0.4f})));
  EXPECT_NEAR(trained.alphas_cumprod()[3].item<float>(), 0.9 * 0.8 * 0.7 * 0.6, 1e-7);
}

// ------------------------------------------------------------------ add_noise errors

TEST(NoiseScheduler, ForwardProcessRefusesBadTimesteps) {
  const DDPMScheduler s;
  const torch::Tensor x = torch::zeros({4, 3, 8, 8});
  const auto add_noise_error = [&](const torch::Tensor& timesteps) {
    return error_of([&] { s.add_noise(x, x, timesteps); });
  };
  EXPECT_TRUE(contains(add_noise_error(torch::tensor({0, 1, 2, 1000})),
                       "add_noise: timestep 1000 is outside [0, 999]"));
  EXPECT_TRUE(contains(add_noise_error(torch::tensor({-1, 1, 2, 3})), "timestep -1"));
  EXPECT_TRUE(contains(add_noise_error(torch::tensor({1.0, 2.0, 3.0, 4.0})), "integer tensor"));
  EXPECT_TRUE(contains(add_noise_error(torch::tensor({1, 2})), "batch of 4"));
  EXPECT_TRUE(contains(error_of([&] { s.get_velocity(x, x, torch::tensor({1000})); }),
                       "get_velocity: timestep 1000"));
  EXPECT_TRUE(contains(error_of([&] { s.add_noise(x, x.slice(0, 0, 2), torch::tensor({1})); }),
                       "[2, 3, 8, 8]"));
}

}  // namespace
}  // namespace difftrain::diffusion
