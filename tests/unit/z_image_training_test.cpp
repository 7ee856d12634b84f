// Z-Image training against one step of Diffusers' train_dreambooth_lora_z_image.py
// (tests/golden/z_image/train_step, make_train_step.py): the folder's training tables, the draws
// u -> indices, timesteps, sigmas, the noisy input, through ZImageDenoiser the model prediction,
// the loss (weighting none, logit_normal with prior preservation, sigma_sqrt on a non-square
// batch), and the LoRA and full fine-tuning gradients.
#include "difftrain/core/error.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/families/z_image/denoiser.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/transformers/z_image_transformer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

namespace {

using difftrain::diffusion::FlowMatchObjective;
using difftrain::diffusion::FlowMatchOptions;
using difftrain::diffusion::NoisedBatch;
using difftrain::families::z_image::ZImageDenoiser;
using difftrain::test::error_of;
using difftrain::test::max_abs;
using difftrain::test::read_json;
namespace dm = difftrain::models;

const std::string kZTiny = difftrain::test::kGoldenDir + "z_image/tiny_z_image/";
const std::string kZStep = difftrain::test::kGoldenDir + "z_image/train_step/";

const difftrain::io::TensorMap& z_step() {
  static const auto t = difftrain::io::load_safetensors(kZStep + "step.safetensors").tensors;
  return t;
}

FlowMatchObjective z_objective(const std::string& scheme) {
  FlowMatchOptions o;
  o.weighting_scheme = scheme;
  return FlowMatchObjective(read_json(kZTiny + "scheduler/scheduler_config.json"),
                            "scheduler_config.json", o);
}

// The case's conditioning: each image's prompt embeddings (prompt_embeds.0 for the instance
// images; prompt_embeds.1 for the class half under prior preservation), zero-padded into one
// [B, L, D] with its mask, as the task's cached captions are.
difftrain::diffusion::Conditioning z_conditioning(const std::string& c, int64_t batch, bool prior) {
  const auto& t = z_step();
  std::vector<torch::Tensor> rows;
  for (int64_t i = 0; i < batch; ++i) {
    const bool cls = prior && i >= batch / 2;
    rows.push_back(t.at(c + ".prompt_embeds." + std::string(cls ? "1" : "0")));
  }
  const int64_t L = 32;
  auto embeds = torch::zeros({batch, L, rows[0].size(1)});
  auto mask = torch::zeros({batch, L}, torch::kInt64);
  for (int64_t i = 0; i < batch; ++i) {
    const int64_t n = rows[static_cast<size_t>(i)].size(0);
    embeds[i].narrow(0, 0, n).copy_(rows[static_cast<size_t>(i)]);
    mask[i].narrow(0, 0, n).fill_(1);
  }
  return {{"encoder_hidden_states", embeds}, {"encoder_attention_mask", mask}};
}

TEST(ZImageTraining, TablesDrawsPredictionsAndLossesMatchTheScript) {
  const auto& t = z_step();
  const auto cases = read_json(kZStep + "cases.json").at("cases");
  ZImageDenoiser denoiser(dm::load_z_image_transformer(kZTiny + "transformer"));
  torch::NoGradGuard no_grad;
  const auto tables = z_objective("none");
  EXPECT_LE(max_abs(tables.train_timesteps(), t.at("schedule.timesteps")), 1e-6 * 1000);
  EXPECT_LE(max_abs(tables.train_sigmas(), t.at("schedule.sigmas")), 1e-6);
  // The VAE posterior's mode, shifted and scaled, is the model input (the task's latent_mode).
  auto vae = dm::load_autoencoder_kl(kZTiny + "vae");
  const auto mode = vae->encode(t.at("lora.pixel_values")).mean;
  EXPECT_LE(max_abs(mode, t.at("lora.latent_mode")), 1e-5);
  EXPECT_LE(max_abs(vae->scale_latents(mode), t.at("lora.model_input")), 1e-5);
  for (const char* name : {"full", "lora_logit_normal_prior", "lora_sigma_sqrt"}) {
    const std::string c = name;
    SCOPED_TRACE(c);
    const auto& args = cases.at(c).at("arguments");
    const auto obj = z_objective(args.at("weighting_scheme").get<std::string>());
    const auto draws = obj.sigmas_for(t.at(c + ".u"), t.at(c + ".model_input").sizes());
    EXPECT_TRUE(torch::equal(draws.indices, t.at(c + ".indices")));
    const NoisedBatch b =
        obj.from_draws(t.at(c + ".model_input"), t.at(c + ".noise"), t.at(c + ".u"));
    EXPECT_LE(max_abs(b.timesteps, t.at(c + ".timesteps")), 1e-6 * 1000);
    EXPECT_LE(max_abs(b.model_input, t.at(c + ".noisy_model_input")), 1e-6);
    EXPECT_LE(max_abs(b.target, t.at(c + ".target")), 1e-6);
    const auto weighting = t.at(c + ".weighting").reshape({-1});
    if (b.weights.defined()) {
      EXPECT_LE(max_abs(b.weights, weighting), 1e-5 * weighting.abs().max().item<double>());
    } else {
      EXPECT_EQ(max_abs(weighting, torch::ones_like(weighting)), 0.0);
    }
    if (c.rfind("lora", 0) == 0) continue;  // predictions with LoRA: the gradient test
    const int64_t batch = b.model_input.size(0);
    const bool prior = args.at("with_prior_preservation").get<bool>();
    const auto pred = denoiser.denoise(b.model_input, b.timesteps, z_conditioning(c, batch, prior));
    const auto loss = obj.losses(pred, b).mean();
    EXPECT_LE(max_abs(pred, t.at(c + ".model_pred")), 1e-5);
    EXPECT_LE(max_abs(loss, t.at(c + ".loss")), 1e-5);
  }
}

// PEFT r=4, lora_alpha=4 on to_q/to_k/to_v/to_out.0 (16 modules), lora_B set non-zero.
TEST(ZImageTraining, LoraAndFullFineTuneGradientsMatchTheScript) {
  const auto& t = z_step();
  const auto cases = read_json(kZStep + "cases.json").at("cases");
  for (const char* name : {"lora", "lora_logit_normal_prior", "lora_sigma_sqrt"}) {
    const std::string c = name;
    SCOPED_TRACE(c);
    const auto& args = cases.at(c).at("arguments");
    const auto obj = z_objective(args.at("weighting_scheme").get<std::string>());
    const NoisedBatch b =
        obj.from_draws(t.at(c + ".model_input"), t.at(c + ".noise"), t.at(c + ".u"));
    auto model = dm::load_z_image_transformer(kZTiny + "transformer");
    for (auto& p : model->parameters()) p.set_requires_grad(false);
    dm::LoraConfig lc;
    lc.rank = 4;
    lc.alpha = 4;
    lc.target_modules = {"to_k", "to_q", "to_v", "to_out.0"};
    dm::LoraLayers lora(*model, lc);
    EXPECT_EQ(lora->module_names().size(), 16u);
    // Our "<module with slashes>.lora_A.weight" is PEFT's "<module>.lora_A.default.weight".
    auto fixture_name = [](std::string key) {
      for (auto& ch : key) ch = ch == '/' ? '.' : ch;
      const std::string suffix = ".weight";
      return key.substr(0, key.size() - suffix.size()) + ".default.weight";
    };
    {
      torch::NoGradGuard no_grad;
      for (auto& p : lora->named_parameters()) {
        p.value().copy_(t.at(c + ".lora." + fixture_name(p.key())));
      }
    }
    const int64_t batch = b.model_input.size(0);
    const bool prior = args.at("with_prior_preservation").get<bool>();
    ZImageDenoiser denoiser(model);
    const auto pred = denoiser.denoise(b.model_input, b.timesteps, z_conditioning(c, batch, prior));
    const auto losses = obj.losses(pred, b);
    torch::Tensor loss = losses.mean();
    if (prior) {
      const double w = args.at("prior_loss_weight").get<double>();
      const auto inst = losses.narrow(0, 0, batch / 2).mean();
      const auto cls = losses.narrow(0, batch / 2, batch / 2).mean();
      EXPECT_LE(max_abs(inst, t.at(c + ".instance_loss")), 1e-5);
      EXPECT_LE(max_abs(cls, t.at(c + ".prior_loss")), 1e-5);
      loss = inst + w * cls;
    }
    loss.backward();
    const double pred_diff = max_abs(pred, t.at(c + ".model_pred"));
    const double loss_diff = max_abs(loss, t.at(c + ".loss"));
    double grad_diff = 0, grad_max = 0;
    for (const auto& p : lora->named_parameters()) {
      ASSERT_TRUE(p.value().grad().defined()) << p.key();
      const auto& ref = t.at(c + ".grad." + fixture_name(p.key()));
      grad_diff = std::max(grad_diff, max_abs(p.value().grad(), ref));
      grad_max = std::max(grad_max, ref.abs().max().item<double>());
    }
    std::printf("%s: model_pred %.3g, loss %.3g, LoRA gradients %.3g (of %.3g)\n", name, pred_diff,
                loss_diff, grad_diff, grad_max);
    EXPECT_LE(pred_diff, 1e-5);
    EXPECT_LE(loss_diff, 1e-5);
    EXPECT_LE(grad_diff, 1e-5 * std::max(1.0, grad_max));
  }
  // Full fine-tuning: every recorded parameter's gradient (layers.1, the final layer, the pad
  // tokens).
  const auto obj = z_objective("none");
  const NoisedBatch b =
      obj.from_draws(t.at("full.model_input"), t.at("full.noise"), t.at("full.u"));
  auto model = dm::load_z_image_transformer(kZTiny + "transformer");
  model->train();
  ZImageDenoiser denoiser(model);
  obj.losses(denoiser.denoise(b.model_input, b.timesteps, z_conditioning("full", 2, false)), b)
      .mean()
      .backward();
  double diff = 0;
  size_t checked = 0;
  for (const auto& p : model->named_parameters()) {
    const auto it = t.find("full.grad." + p.key());
    if (it == t.end()) continue;
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    diff = std::max(diff, max_abs(p.value().grad(), it->second));
    ++checked;
  }
  std::printf("full fine-tune: %zu gradients, max abs diff %.3g\n", checked, diff);
  EXPECT_EQ(checked, 21u);
  EXPECT_LE(diff, 1e-5);
}

TEST(ZImageTraining, TheDenoiserRefusesUnknownAndMissingConditioning) {
  ZImageDenoiser denoiser(dm::load_z_image_transformer(kZTiny + "transformer"));
  const auto x = torch::zeros({1, 16, 4, 4});
  const auto t = torch::full({1}, 500.0);
  EXPECT_HAS(error_of([&] {
               denoiser.denoise(x, t, {{"pooled_projections", x}});
             }),
             "takes no conditioning 'pooled_projections'");
  EXPECT_HAS(error_of([&] { denoiser.denoise(x, t, {}); }), "needs encoder_hidden_states");
  EXPECT_HAS(error_of([&] {
               denoiser.denoise(x, t, {{"encoder_hidden_states", torch::zeros({2, 3, 48})}});
             }),
             "takes latents [B, C, H, W]");
}

}  // namespace
