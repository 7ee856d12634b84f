// Z-Image's denoising loop against ZImagePipeline's own runs (tests/golden/z_image/tiny_z_image,
// make_transformer.py): Turbo (no CFG, 4 steps, two prompts), CFG with renormalisation and a
// truncated last step (two images per prompt), and dynamic shifting (mu from the latent size):
// the timesteps and the final latents from the same initial noise.
#include "difftrain/families/z_image/denoise.h"

#include "difftrain/io/safetensors.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace {

using difftrain::test::kGoldenDir;
using difftrain::test::max_abs;

const std::string kZImagePipeline = kGoldenDir + "z_image/tiny_z_image";

TEST(ZImageDenoise, TurboCfgAndDynamicShiftingMatchZImagePipeline) {
  torch::NoGradGuard no_grad;
  const auto ref =
      difftrain::io::load_safetensors(kZImagePipeline + "/pipeline.safetensors").tensors;
  std::ifstream in(kZImagePipeline + "/pipeline_cases.json");
  const auto cases = nlohmann::json::parse(in).at("cases");
  auto transformer = difftrain::models::load_z_image_transformer(kZImagePipeline + "/transformer");
  for (const char* name : {"turbo", "cfg", "dynamic"}) {
    const std::string k = name;
    const auto& c = cases.at(k);
    const auto& args = c.at("arguments");
    const int64_t per_prompt = args.at("num_images_per_prompt").get<int64_t>();
    // Prompt embeddings repeated per image, prompt by prompt (p0, p0, p1, p1), as the pipeline.
    std::vector<torch::Tensor> pos, neg;
    for (size_t j = 0; j < args.at("prompt_embeds").size(); ++j) {
      for (int64_t r = 0; r < per_prompt; ++r) {
        pos.push_back(ref.at(k + ".prompt_embeds." + std::to_string(j)));
        if (!args.at("negative_prompt_embeds").is_null()) {
          neg.push_back(ref.at(k + ".negative_prompt_embeds." + std::to_string(j)));
        }
      }
    }
    difftrain::families::z_image::DenoiseOptions o;
    o.num_inference_steps = args.at("num_inference_steps").get<int64_t>();
    o.guidance_scale = args.at("guidance_scale").get<double>();
    if (args.contains("cfg_normalization")) {
      o.cfg_normalization = args.at("cfg_normalization").get<bool>() ? 1.0 : 0.0;
    }
    if (args.contains("cfg_truncation")) o.cfg_truncation = args.at("cfg_truncation").get<double>();
    auto sampler = difftrain::diffusion::make_sampler(
        c.at("scheduler_config"), "FlowMatchEulerDiscreteScheduler", k + " scheduler");
    int64_t reported = 0;
    const auto latents = difftrain::families::z_image::denoise(
        *transformer, *sampler, c.at("scheduler_config"), ref.at(k + ".noise"), pos, neg, o,
        [&](int64_t i, int64_t) { reported = i; });
    EXPECT_EQ(reported, o.num_inference_steps) << k;
    EXPECT_LT(max_abs(sampler->timesteps(), ref.at(k + ".timesteps")), 1e-3)
        << k << " " << sampler->timesteps() << ref.at(k + ".timesteps");
    const double diff = max_abs(latents, ref.at(k + ".latents"));
    std::cout << k << ": final latents max abs diff " << diff << " (tol 1e-4)\n";
    EXPECT_LT(diff, 1e-4) << k;
  }
}

TEST(ZImageDenoise, TheFolderVaeDecodesThePipelinesLatentsToItsImage) {
  // The FLUX.1-layout VAE with the folder's scaling and shift factors, as ZImagePipeline decodes.
  torch::NoGradGuard no_grad;
  const auto ref =
      difftrain::io::load_safetensors(kZImagePipeline + "/pipeline.safetensors").tensors;
  auto vae = difftrain::models::load_autoencoder_kl(kZImagePipeline + "/vae");
  const auto decoded = vae->decode(vae->unscale_latents(ref.at("turbo.latents")));
  const double raw = max_abs(decoded, ref.at("turbo.vae_decoded"));
  const auto image = (decoded / 2 + 0.5).clamp(0, 1);
  const double diff = max_abs(image, ref.at("turbo.image"));
  std::cout << "VAE decode max abs diff " << raw << ", image " << diff << " (tol 1e-4)\n";
  EXPECT_LT(raw, 1e-4);
  EXPECT_LT(diff, 1e-4);
}

}  // namespace
