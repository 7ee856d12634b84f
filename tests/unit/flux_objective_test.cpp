// Flow-matching training against Diffusers' train_dreambooth_lora_flux.py (the tiny FLUX.1
// fixture's train_step.*): for every weighting scheme, the draws u -> indices, timesteps,
// sigmas, noisy input, loss weights, and through FluxDenoiser the model prediction and loss;
// full fine-tuning and LoRA gradients. kohya's continuous samplings against a float64
// transcription, the per-sample streams, and the option errors.

#include "difftrain/core/error.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/families/family.h"
#include "difftrain/families/flux/denoiser.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora_training.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>

namespace {

using difftrain::diffusion::FlowMatchObjective;
using difftrain::diffusion::FlowMatchOptions;
using difftrain::diffusion::NoisedBatch;
using difftrain::families::flux::FluxDenoiser;
using difftrain::io::TensorMap;
using difftrain::test::error_of;
using difftrain::test::max_abs;
using difftrain::test::read_json;
namespace dm = difftrain::models;

const std::string kFluxDir = difftrain::test::kGoldenDir + "flux/tiny_flux/";

nlohmann::json flux_scheduler_config() {
  return read_json(kFluxDir + "scheduler/scheduler_config.json");
}

const TensorMap& train_step() {
  static const TensorMap t =
      difftrain::io::load_safetensors(kFluxDir + "train_step.safetensors").tensors;
  return t;
}

FlowMatchObjective objective_for(const std::string& scheme) {
  FlowMatchOptions o;
  o.weighting_scheme = scheme;
  return FlowMatchObjective(flux_scheduler_config(), "scheduler_config.json", o);
}

difftrain::diffusion::Conditioning fixture_conditioning() {
  const auto& t = train_step();
  return {{"encoder_hidden_states", t.at("prompt_embeds")},
          {"pooled_projections", t.at("pooled_prompt_embeds")},
          {"guidance", t.at("guidance")}};
}

TEST(FlowMatchObjective, TrainingTablesAreTheSchedulersUnshiftedFloat32Roundings) {
  const auto obj = objective_for("none");
  const auto& t = train_step();
  EXPECT_EQ(max_abs(obj.train_timesteps(), t.at("train_schedule_timesteps")), 0.0);
  EXPECT_EQ(max_abs(obj.train_sigmas(), t.at("train_schedule_sigmas")), 0.0);
  // T[873] is float32(0.127 * 1000), not 127 (the fixture README's example).
  EXPECT_NE(obj.train_timesteps()[873].item<float>(), 127.0f);
}

TEST(FlowMatchObjective, EverySchemeMatchesTheTrainingScriptThroughTheDenoiser) {
  const auto& t = train_step();
  const auto json = read_json(kFluxDir + "train_step.json");
  FluxDenoiser denoiser(dm::load_flux_transformer(kFluxDir + "transformer"));
  torch::NoGradGuard no_grad;
  for (const std::string s : {"logit_normal", "none", "mode", "cosmap"}) {
    SCOPED_TRACE(s);
    const auto obj = objective_for(s);
    const auto u = t.at(s + ".u");
    const auto draws = obj.sigmas_for(u, t.at("model_input").sizes());
    EXPECT_TRUE(torch::equal(draws.indices, t.at(s + ".indices")));
    const NoisedBatch b = obj.from_draws(t.at("model_input"), t.at("noise"), u);
    EXPECT_LE(max_abs(b.timesteps, t.at(s + ".timesteps")), 1e-6 * 1000);
    EXPECT_LE(max_abs(draws.sigmas, t.at(s + ".sigmas").reshape({-1})), 1e-6);
    EXPECT_LE(max_abs(b.model_input, t.at(s + ".noisy_model_input")), 1e-6);
    EXPECT_LE(max_abs(b.target, t.at("target")), 1e-6);
    const auto weighting = t.at(s + ".weighting").reshape({-1});
    if (b.weights.defined()) {
      EXPECT_LE(max_abs(b.weights, weighting), 1e-6);
    } else {
      EXPECT_EQ(max_abs(weighting, torch::ones_like(weighting)), 0.0);
    }
    const auto pred = denoiser.denoise(b.model_input, b.timesteps, fixture_conditioning());
    const auto loss = obj.losses(pred, b).mean();
    const double pred_diff = max_abs(pred, t.at(s + ".model_pred"));
    const double loss_diff = max_abs(loss, t.at(s + ".loss"));
    std::cout << "  " << s << ": model_pred " << pred_diff << " (2e-4), loss " << loss_diff
              << " (1e-5)\n";
    EXPECT_LE(pred_diff, 2e-4);
    EXPECT_LE(loss_diff, 1e-5);
    EXPECT_NEAR(loss.item<double>(), json["schemes"][s]["loss"].get<double>(), 1e-5);
  }
}

TEST(FlowMatchObjective, FullFineTuneAndLoraGradientsMatchTheTrainingScript) {
  const auto& t = train_step();
  const auto obj = objective_for("logit_normal");
  const NoisedBatch b = obj.from_draws(t.at("model_input"), t.at("noise"), t.at("logit_normal.u"));
  {
    auto model = dm::load_flux_transformer(kFluxDir + "transformer");
    model->train();
    FluxDenoiser denoiser(model);
    obj.losses(denoiser.denoise(b.model_input, b.timesteps, fixture_conditioning()), b)
        .mean()
        .backward();
    double diff = 0;
    for (const auto& p : model->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      diff = std::max(diff, max_abs(p.value().grad(), t.at("grad." + p.key())));
    }
    std::cout << "  full fine-tune gradients " << diff << " (2e-5)\n";
    EXPECT_LE(diff, 2e-5);
  }
  // PEFT r=4, lora_alpha=8 on to_k/to_q/to_v/to_out.0 (14 modules), lora_B set non-zero.
  auto model = dm::load_flux_transformer(kFluxDir + "transformer");
  for (auto& p : model->parameters()) p.set_requires_grad(false);
  dm::LoraConfig lc;
  lc.rank = 4;
  lc.alpha = 8;
  lc.target_modules = {"to_k", "to_q", "to_v", "to_out.0"};
  dm::LoraLayers lora(*model, lc);
  EXPECT_EQ(lora->module_names().size(), 14u);
  auto fixture_name = [](std::string key) {
    for (auto& c : key) c = c == '/' ? '.' : c;
    return key;
  };
  {
    torch::NoGradGuard no_grad;
    for (auto& p : lora->named_parameters()) {
      p.value().copy_(t.at("lora." + fixture_name(p.key())));
    }
  }
  FluxDenoiser denoiser(model);
  const auto pred = denoiser.denoise(b.model_input, b.timesteps, fixture_conditioning());
  const auto loss = obj.losses(pred, b).mean();
  loss.backward();
  EXPECT_LE(max_abs(pred, t.at("lora.model_pred")), 2e-4);
  EXPECT_LE(max_abs(loss, t.at("lora.loss")), 1e-5);
  double diff = 0;
  for (const auto& p : lora->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    diff = std::max(diff, max_abs(p.value().grad(), t.at("lora_grad." + fixture_name(p.key()))));
  }
  std::cout << "  LoRA gradients " << diff << " (2e-5)\n";
  EXPECT_LE(diff, 2e-5);
}

// kohya's continuous samplings (flux_train_utils.get_noisy_model_input_and_timesteps), in float64
// from the same normal draw.
// flux_shift is the FLUX.1 family's sampling: registered with the family.
void register_flux_family() { ASSERT_NE(difftrain::families::find_family("flux"), nullptr); }

TEST(FlowMatchObjective, KohyaSamplingsFollowTheirFormulas) {
  register_flux_family();
  ASSERT_EQ(difftrain::diffusion::flow_timestep_samplings(),
            (std::vector<std::string>{"sigma", "uniform", "sigmoid", "shift", "flux_shift"}));
  EXPECT_NE(error_of([] {
              difftrain::diffusion::register_flow_timestep_sampling(
                  {"flux_shift", [](const torch::Tensor& u, torch::IntArrayRef) { return u; }});
            }).find("registered already"),
            std::string::npos);
  const double shift = 3.1582, scale = 1.3;
  for (const std::string mode : {"uniform", "sigmoid", "shift", "flux_shift"}) {
    SCOPED_TRACE(mode);
    FlowMatchOptions o;
    o.timestep_sampling = mode;
    o.discrete_flow_shift = shift;
    o.sigmoid_scale = scale;
    const FlowMatchObjective obj(flux_scheduler_config(), "scheduler_config.json", o);
    auto g = difftrain::core::sample_generator(7, 0, 3, difftrain::core::SampleStream::kTimestep);
    const double u = obj.draw(g).item<double>();
    auto g2 = difftrain::core::sample_generator(7, 0, 3, difftrain::core::SampleStream::kTimestep);
    const double z = mode == "uniform" ? torch::rand({1}, g2, torch::kFloat32).item<double>()
                                       : torch::randn({1}, g2, torch::kFloat32).item<double>();
    double expect = mode == "uniform" ? z : 1 / (1 + std::exp(-scale * z));
    if (mode == "shift") expect = expect * shift / (1 + (shift - 1) * expect);
    EXPECT_NEAR(u, expect, 1e-6);
    const auto x0 = torch::zeros({1, 16, 64, 32});
    const auto b = obj.from_draws(x0, torch::ones_like(x0), torch::tensor({static_cast<float>(u)}));
    double sigma = u;
    if (mode == "flux_shift") {
      const double m = (1.15 - 0.5) / (4096 - 256);
      const double mu = m * (32 * 16) + 0.5 - m * 256;
      sigma = std::exp(mu) / (std::exp(mu) + (1 / u - 1));
    }
    EXPECT_NEAR(b.model_input[0][0][0][0].item<double>(), sigma, 1e-6);
    EXPECT_NEAR(b.timesteps[0].item<double>(), 1000 * sigma, 1e-3);
    EXPECT_FALSE(b.weights.defined());
  }
}

// Video latents [B, C, F, H, W]: every timestep sampling gives each frame what an image of that
// frame's size gets (flux_shift's sequence length is one frame's packed H x W); other ranks are
// refused by the scheme that needs the size.
TEST(FlowMatchObjective, VideoLatentsGetEachFrameTheImageDraws) {
  register_flux_family();
  for (const std::string mode : {"sigma", "uniform", "sigmoid", "shift", "flux_shift"}) {
    SCOPED_TRACE(mode);
    FlowMatchOptions o;
    o.timestep_sampling = mode;
    const FlowMatchObjective obj(flux_scheduler_config(), "scheduler_config.json", o);
    torch::manual_seed(5);
    const auto clip = torch::randn({2, 4, 3, 8, 6});
    const auto noise = torch::randn_like(clip);
    const auto u = torch::tensor({0.3f, 0.8f});
    const auto video = obj.from_draws(clip, noise, u);
    ASSERT_EQ(video.model_input.sizes(), clip.sizes());
    for (int64_t f = 0; f < 3; ++f) {
      const auto image = obj.from_draws(clip.select(2, f), noise.select(2, f), u);
      EXPECT_TRUE(torch::equal(video.model_input.select(2, f), image.model_input)) << f;
      EXPECT_TRUE(torch::equal(video.target.select(2, f), image.target)) << f;
      EXPECT_TRUE(torch::equal(video.timesteps, image.timesteps));
    }
  }
  FlowMatchOptions o;
  o.timestep_sampling = "flux_shift";
  const FlowMatchObjective obj(flux_scheduler_config(), "scheduler_config.json", o);
  const auto flat = torch::zeros({2, 4, 8});
  EXPECT_NE(error_of([&] {
              obj.from_draws(flat, flat, torch::tensor({0.5f, 0.5f}));
            }).find("[B, C, F, H, W]"),
            std::string::npos);
}

TEST(FlowMatchObjective, SigmaSqrtWeightsAndDensitiesHaveTheirShapes) {
  FlowMatchOptions o;
  o.weighting_scheme = "sigma_sqrt";
  const FlowMatchObjective obj(flux_scheduler_config(), "scheduler_config.json", o);
  const auto x0 = torch::zeros({2, 4, 2, 2});
  const auto b = obj.from_draws(x0, x0, torch::tensor({0.25f, 0.75f}));
  const auto s = obj.sigmas_for(torch::tensor({0.25f, 0.75f}), x0.sizes()).sigmas;
  EXPECT_LE(max_abs(b.weights, s.pow(-2)), 1e-6);
  // The "mode" density piles draws away from the middle less than uniform would; its mean over
  // many draws is 0.5 by symmetry, logit_normal's median is sigmoid(logit_mean).
  for (const std::string scheme : {"mode", "logit_normal"}) {
    FlowMatchOptions d;
    d.weighting_scheme = scheme;
    d.logit_mean = 0.0;
    const FlowMatchObjective o2(flux_scheduler_config(), "scheduler_config.json", d);
    double sum = 0;
    for (int64_t k = 0; k < 4000; ++k) {
      auto g = difftrain::core::sample_generator(1, 0, k, difftrain::core::SampleStream::kTimestep);
      const double u = o2.draw(g).item<double>();
      ASSERT_GT(u, 0.0);
      ASSERT_LT(u, 1.0);
      sum += u;
    }
    EXPECT_NEAR(sum / 4000, 0.5, 0.02) << scheme;
  }
}

TEST(FlowMatchObjective, EachSampleDrawsFromItsOwnStreams) {
  const auto obj = objective_for("logit_normal");
  const auto x0 = torch::randn({3, 16, 4, 6});
  const std::vector<int64_t> keys = {5, 9, 2};
  const auto all = obj.noise(x0, keys, 4, torch::kCPU);
  for (size_t i = 0; i < keys.size(); ++i) {
    const auto one = obj.noise(x0.slice(0, i, i + 1), {keys[i]}, 4, torch::kCPU);
    EXPECT_TRUE(torch::equal(one.model_input[0], all.model_input[i]));
    EXPECT_TRUE(torch::equal(one.timesteps[0], all.timesteps[i]));
  }
  const auto other_epoch = obj.noise(x0, keys, 5, torch::kCPU);
  EXPECT_FALSE(torch::equal(other_epoch.model_input, all.model_input));
}

TEST(FlowMatchObjective, BadOptionsAndConfigsAreOneLineErrors) {
  FlowMatchOptions o;
  o.weighting_scheme = "lognorm";
  EXPECT_NE(error_of([&] {
              FlowMatchObjective(flux_scheduler_config(), "s.json", o);
            }).find("--weighting_scheme lognorm: unknown; use one of none, logit_normal"),
            std::string::npos);
  o = {};
  o.timestep_sampling = "flux";
  EXPECT_NE(error_of([&] {
              FlowMatchObjective(flux_scheduler_config(), "s.json", o);
            }).find("--timestep_sampling flux"),
            std::string::npos);
  o = {};
  o.logit_std = 0;
  EXPECT_NE(error_of([&] {
              FlowMatchObjective(flux_scheduler_config(), "s.json", o);
            }).find("--logit_std 0"),
            std::string::npos);
  const nlohmann::json ddpm = {{"_class_name", "DDPMScheduler"}};
  EXPECT_NE(error_of([&] {
              FlowMatchObjective(ddpm, "s.json", {});
            }).find("needs a FlowMatchEulerDiscreteScheduler"),
            std::string::npos);
}

TEST(FluxDenoiser, RefusesUnknownAndMissingConditioning) {
  FluxDenoiser denoiser(dm::load_flux_transformer(kFluxDir + "transformer"));
  auto cond = fixture_conditioning();
  const auto x = train_step().at("model_input");
  const auto t = torch::full({2}, 500.0f);
  cond["time_ids"] = torch::zeros({2, 6});
  EXPECT_NE(error_of([&] { denoiser.denoise(x, t, cond); }).find("no conditioning 'time_ids'"),
            std::string::npos);
  cond.erase("time_ids");
  cond.erase("pooled_projections");
  EXPECT_NE(error_of([&] { denoiser.denoise(x, t, cond); }).find("pooled_projections (CLIP)"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              denoiser.denoise(x.slice(3, 0, 31), t, fixture_conditioning());
            }).find("H and W even"),
            std::string::npos);
}

}  // namespace
