// Qwen-Image training against one step of Diffusers' train_dreambooth_lora_qwen_image.py
// (tests/golden/qwen_image/train_step, make_train_step.py): the VAE posterior of the images as
// one frame and the draw normalised by latents_mean / latents_std, the folder's unshifted
// training tables, the draws u -> indices, timesteps, sigmas, the noisy input, through
// QwenImageDenoiser (2x2 packing, img_shapes, t / 1000, the caption mask) the model prediction,
// the loss (weighting none, logit_normal with prior preservation and padded captions, sigma_sqrt
// on a portrait batch), and the LoRA and full fine-tuning gradients.
#include "../../src/families/qwen_image/denoiser.h"

#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/transformers/qwen_image_transformer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

namespace qwen_image_training_test {

using difftrain::diffusion::FlowMatchObjective;
using difftrain::diffusion::FlowMatchOptions;
using difftrain::diffusion::NoisedBatch;
using difftrain::families::qwen_image::QwenImageDenoiser;
using difftrain::test::max_abs;
using difftrain::test::read_json;
namespace dm = difftrain::models;

const std::string kQTiny = difftrain::test::kGoldenDir + "qwen_image/tiny_qwen_image/";
const std::string kQStep = difftrain::test::kGoldenDir + "qwen_image/train_step/";

difftrain::io::TensorMap q_step() {
  static const auto t = difftrain::io::load_safetensors(kQStep + "step.safetensors").tensors;
  return t;
}

// [B, C, 1, h, w] -> [B, C, h, w]: the task trains on one frame.
torch::Tensor frame(const torch::Tensor& t) { return t.squeeze(2); }

FlowMatchObjective q_objective(const std::string& scheme) {
  FlowMatchOptions o;
  o.weighting_scheme = scheme;
  return FlowMatchObjective(read_json(kQTiny + "scheduler/scheduler_config.json"),
                            "scheduler_config.json", o);
}

difftrain::diffusion::Conditioning q_conditioning(const difftrain::io::TensorMap& t,
                                                  const std::string& c) {
  const auto& embeds = t.at(c + ".prompt_embeds");
  const auto it = t.find(c + ".prompt_embeds_mask");
  const auto mask =
      it != t.end() ? it->second : torch::ones({embeds.size(0), embeds.size(1)}, torch::kInt64);
  return {{"encoder_hidden_states", embeds}, {"encoder_attention_mask", mask}};
}

NoisedBatch q_noised(const FlowMatchObjective& obj, const difftrain::io::TensorMap& t,
                     const std::string& c) {
  return obj.from_draws(frame(t.at(c + ".model_input")), frame(t.at(c + ".noise")), t.at(c + ".u"));
}

TEST(QwenImageTraining, PosteriorTablesDrawsPredictionsAndLossesMatchTheScript) {
  const auto t = q_step();
  const auto cases = read_json(kQStep + "cases.json").at("cases");
  QwenImageDenoiser denoiser(dm::load_qwen_image_transformer(kQTiny + "transformer"));
  torch::NoGradGuard no_grad;
  const auto tables = q_objective("none");
  // use_dynamic_shifting: the training tables stay unshifted, whatever the script's --shift.
  EXPECT_LE(max_abs(tables.train_timesteps(), t.at("schedule.timesteps")), 1e-6 * 1000);
  EXPECT_LE(max_abs(tables.train_sigmas(), t.at("schedule.sigmas")), 1e-6);
  // The posterior of the images as one frame; the draw mean + std eps, normalised.
  auto vae = dm::load_autoencoder_kl_qwen_image(kQTiny + "vae");
  const auto post = vae->encode(t.at("lora.pixel_values"));
  EXPECT_LE(max_abs(post.mean, t.at("lora.posterior_mean")), 2e-5);
  EXPECT_LE(max_abs(post.std, t.at("lora.posterior_std")), 2e-5);
  const auto sample =
      t.at("lora.posterior_mean") + t.at("lora.posterior_std") * t.at("lora.posterior_eps");
  EXPECT_LE(max_abs(sample, t.at("lora.latent_sample")), 1e-6);
  EXPECT_LE(max_abs(vae->normalize_latents(frame(t.at("lora.latent_sample"))),
                    frame(t.at("lora.model_input"))),
            1e-6);
  for (const char* name : {"full", "lora_logit_normal_prior", "lora_sigma_sqrt"}) {
    const std::string c = name;
    SCOPED_TRACE(c);
    const auto& args = cases.at(c).at("arguments");
    const auto obj = q_objective(args.at("weighting_scheme").get<std::string>());
    const auto draws = obj.sigmas_for(t.at(c + ".u"), frame(t.at(c + ".model_input")).sizes());
    EXPECT_TRUE(torch::equal(draws.indices, t.at(c + ".indices")));
    const NoisedBatch b = q_noised(obj, t, c);
    EXPECT_LE(max_abs(b.timesteps, t.at(c + ".timesteps")), 1e-6 * 1000);
    EXPECT_LE(max_abs(b.model_input, frame(t.at(c + ".noisy_model_input"))), 1e-6);
    EXPECT_LE(max_abs(b.target, frame(t.at(c + ".target"))), 1e-6);
    const auto weighting = t.at(c + ".weighting").reshape({-1});
    if (b.weights.defined()) {
      EXPECT_LE(max_abs(b.weights, weighting), 1e-5 * weighting.abs().max().item<double>());
    } else {
      EXPECT_EQ(max_abs(weighting, torch::ones_like(weighting)), 0.0);
    }
    if (c.rfind("lora", 0) == 0) continue;  // predictions with LoRA: the gradient test
    const auto pred = denoiser.denoise(b.model_input, b.timesteps, q_conditioning(t, c));
    EXPECT_LE(max_abs(pred, frame(t.at(c + ".model_pred"))), 1e-5);
    EXPECT_LE(max_abs(obj.losses(pred, b).mean(), t.at(c + ".loss")), 1e-5);
  }
}

// PEFT r=4, lora_alpha=4 on to_q/to_k/to_v/to_out.0 (8 modules), lora_B set non-zero.
TEST(QwenImageTraining, LoraAndFullFineTuneGradientsMatchTheScript) {
  const auto t = q_step();
  const auto cases = read_json(kQStep + "cases.json").at("cases");
  for (const char* name : {"lora", "lora_logit_normal_prior", "lora_sigma_sqrt"}) {
    const std::string c = name;
    SCOPED_TRACE(c);
    const auto& args = cases.at(c).at("arguments");
    const auto obj = q_objective(args.at("weighting_scheme").get<std::string>());
    const NoisedBatch b = q_noised(obj, t, c);
    auto model = dm::load_qwen_image_transformer(kQTiny + "transformer");
    for (auto& p : model->parameters()) p.set_requires_grad(false);
    dm::LoraConfig lc;
    lc.rank = 4;
    lc.alpha = 4;
    lc.target_modules = {"to_k", "to_q", "to_v", "to_out.0"};
    dm::LoraLayers lora(*model, lc);
    EXPECT_EQ(lora->module_names().size(), 8u);
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
    QwenImageDenoiser denoiser(model);
    const auto pred = denoiser.denoise(b.model_input, b.timesteps, q_conditioning(t, c));
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
    const double pred_diff = max_abs(pred, frame(t.at(c + ".model_pred")));
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
    EXPECT_LE(grad_diff, 1e-4 * std::max(grad_max, 1e-3));
  }
  // Full fine-tuning: every recorded parameter's gradient.
  const auto obj = q_objective("none");
  const NoisedBatch b = q_noised(obj, t, "full");
  auto model = dm::load_qwen_image_transformer(kQTiny + "transformer");
  model->train();
  QwenImageDenoiser denoiser(model);
  obj.losses(denoiser.denoise(b.model_input, b.timesteps, q_conditioning(t, "full")), b)
      .mean()
      .backward();
  double diff = 0, biggest = 0;
  size_t checked = 0;
  for (const auto& p : model->named_parameters()) {
    const auto it = t.find("full.grad." + p.key());
    if (it == t.end()) continue;
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    diff = std::max(diff, max_abs(p.value().grad(), it->second));
    biggest = std::max(biggest, it->second.abs().max().item<double>());
    ++checked;
  }
  std::printf("full fine-tune: %zu gradients, max abs diff %.3g (of %.3g)\n", checked, diff,
              biggest);
  EXPECT_EQ(checked, 71u);
  EXPECT_LE(diff, 1e-5 * std::max(1.0, biggest));
}

}  // namespace qwen_image_training_test
