// Stable Diffusion folders and text-to-image sampling against the Diffusers 0.31 reference
// (tests/golden/sd/tiny_sd: StableDiffusionPipeline, DDIM 10 steps, guidance 7.5, seed 42).

#include "difftrain/families/stable_diffusion/pipeline.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora_training.h"
#include "source_dir.h"
#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace difftrain {
namespace {

namespace fs = std::filesystem;
using test::error_of;
using test::max_abs;

const std::string kSd = std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd";

// A copy of the fixture folder whose model_index.json is `index` (the parts are symlinked).
std::string folder_with_index(const std::string& stem, const nlohmann::json& index) {
  const std::string dir = test::temp_dir(stem);
  for (const char* part : {"unet", "vae", "text_encoder", "tokenizer", "scheduler"}) {
    fs::create_directory_symlink(fs::path(kSd) / part, fs::path(dir) / part);
  }
  io::write_file_atomic(dir + "/model_index.json", index.dump(2));
  return dir;
}

nlohmann::json fixture_index() {
  return nlohmann::json::parse(io::read_file(kSd + "/model_index.json"));
}

TEST(SdPipeline, Txt2ImgMatchesDiffusers) {
  auto ref = io::load_safetensors(kSd + "/txt2img_seed42.safetensors").tensors;
  auto sd = families::stable_diffusion::load_stable_diffusion(kSd);
  EXPECT_EQ(sd.scheduler->class_name(), "DDIMScheduler");

  // The initial latents come from a CPU generator seeded 42, as torch.randn in Python.
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(42);
  auto drawn = at::randn({2, 4, 16, 16}, gen, torch::kFloat32);
  EXPECT_EQ(max_abs(drawn, ref.at("latents_init")), 0.0);

  families::stable_diffusion::TextToImageOptions o;
  o.prompts = {"a photo of a cat", "an astronaut riding a horse on mars, highly detailed"};
  o.guidance_scale = 7.5;
  o.num_inference_steps = 10;
  o.seed = 42;
  auto out = families::stable_diffusion::text_to_image(sd, o);
  EXPECT_TRUE(torch::equal(sd.scheduler->timesteps(), ref.at("timesteps")));
  const double embeds = max_abs(out.prompt_embeds, ref.at("prompt_embeds"));
  const double scale = ref.at("latents_final").abs().max().item<double>();
  const double latents = max_abs(out.latents, ref.at("latents_final"));
  const double images = max_abs(out.images, ref.at("images"));
  std::cout << "prompt_embeds " << embeds << ", latents_final " << latents << " (|ref| max "
            << scale << "), images " << images << "\n";
  EXPECT_LE(embeds, 1e-4);
  EXPECT_LE(latents, 1e-4 * scale);  // the README's bound: 1e-4 relative to max|ref|
  EXPECT_LE(images, 1e-4);
  EXPECT_EQ(out.images.sizes(), ref.at("images").sizes());
}

TEST(SdPipeline, ImagesPerPromptAreRepeatedPromptMajor) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kSd);
  families::stable_diffusion::TextToImageOptions o;
  o.prompts = {"a photo of a cat", "a dog"};
  o.num_images_per_prompt = 2;
  o.num_inference_steps = 2;
  o.seed = 3;
  auto out = families::stable_diffusion::text_to_image(sd, o);
  ASSERT_EQ(out.images.size(0), 4);
  // Rows: negatives [4] then prompts [4]: cat, cat, dog, dog.
  ASSERT_EQ(out.prompt_embeds.size(0), 8);
  EXPECT_EQ(max_abs(out.prompt_embeds[4], out.prompt_embeds[5]), 0.0);
  EXPECT_GT(max_abs(out.prompt_embeds[5], out.prompt_embeds[6]), 1e-3);
  EXPECT_LE(max_abs(out.prompt_embeds[0], out.prompt_embeds[3]), 1e-5);  // "" negatives
  // Without guidance no negative prompt is encoded.
  o.guidance_scale = 1.0;
  EXPECT_EQ(families::stable_diffusion::text_to_image(sd, o).prompt_embeds.size(0), 4);
}

TEST(SdPipeline, NonSquareSizeAndErrors) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kSd);
  families::stable_diffusion::TextToImageOptions o;
  o.prompts = {"a cat"};
  o.num_inference_steps = 1;
  o.height = 32;
  o.width = 48;
  EXPECT_EQ(families::stable_diffusion::text_to_image(sd, o).images.sizes(),
            (std::vector<int64_t>{1, 32, 48, 3}));
  o.width = 33;
  EXPECT_NE(
      error_of([&] { families::stable_diffusion::text_to_image(sd, o); }).find("multiples of 2"),
      std::string::npos);
  o.width = 32;
  o.negative_prompts = {"a", "b"};
  EXPECT_NE(
      error_of([&] { families::stable_diffusion::text_to_image(sd, o); }).find("negative prompts"),
      std::string::npos);
  o.negative_prompts = {};
  o.prompts = {};
  EXPECT_NE(error_of([&] {
              families::stable_diffusion::text_to_image(sd, o);
            }).find("at least one prompt"),
            std::string::npos);
}

TEST(SdPipeline, ClipSkipChangesEmbeddings) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kSd);
  auto last = sd.text_encoders.encode({"a photo of a cat"}, 0).embeds;
  auto pen = sd.text_encoders.encode({"a photo of a cat"}, 1).embeds;
  EXPECT_EQ(last.sizes(), pen.sizes());
  EXPECT_GT(max_abs(last, pen), 1e-3);
}

TEST(SdPipeline, FolderChecks) {
  EXPECT_TRUE(families::stable_diffusion::is_stable_diffusion_folder(kSd));
  EXPECT_FALSE(families::stable_diffusion::is_stable_diffusion_folder(kSd + "/unet"));
  EXPECT_NE(error_of([] {
              families::stable_diffusion::resolve_stable_diffusion_folder("/no/such/sd");
            }).find("no such folder"),
            std::string::npos);

  auto index = fixture_index();
  index["safety_checker"] = {"stable_diffusion", "StableDiffusionSafetyChecker"};
  auto notes = families::stable_diffusion::resolve_stable_diffusion_folder(
      folder_with_index("sd_safety", index));
  ASSERT_EQ(notes.notes.size(), 1u);
  EXPECT_NE(notes.notes[0].find("safety_checker"), std::string::npos);

  index = fixture_index();
  index["text_encoder_2"] = {"transformers", "CLIPTextModelWithProjection"};
  EXPECT_NE(error_of([&] {
              families::stable_diffusion::resolve_stable_diffusion_folder(
                  folder_with_index("sd_xl", index));
            }).find("no tokenizer_2"),
            std::string::npos);

  index = fixture_index();
  index["vae"] = {"diffusers", "AutoencoderTiny"};
  const std::string msg = error_of([&] {
    families::stable_diffusion::resolve_stable_diffusion_folder(folder_with_index("sd_vae", index));
  });
  EXPECT_NE(msg.find("AutoencoderTiny"), std::string::npos) << msg;
  EXPECT_NE(msg.find("supported: AutoencoderKL"), std::string::npos) << msg;

  // Another pipeline with the same component classes is refused by name (issue 38: an inpainting
  // folder trained silently as text-to-image).
  index = fixture_index();
  index["_class_name"] = "StableDiffusionInpaintPipeline";
  const std::string inpaint = error_of([&] {
    families::stable_diffusion::resolve_stable_diffusion_folder(
        folder_with_index("sd_inpaint", index));
  });
  EXPECT_NE(inpaint.find("model_index.json: pipeline class \"StableDiffusionInpaintPipeline\" is "
                         "not supported; difftrain runs StableDiffusionPipeline"),
            std::string::npos)
      << inpaint;
  index["_class_name"] = "StableDiffusionImg2ImgPipeline";  // the same weights: accepted
  EXPECT_NO_THROW(families::stable_diffusion::resolve_stable_diffusion_folder(
      folder_with_index("sd_img2img", index)));

  index = fixture_index();
  index.erase("vae");
  EXPECT_NE(error_of([&] {
              families::stable_diffusion::resolve_stable_diffusion_folder(
                  folder_with_index("sd_novae", index));
            }).find("no \"vae\" component"),
            std::string::npos);
}

// SD-1.5 ships PNDMScheduler: a folder naming it now samples with it (before: refused unless
// --scheduler ddim), and any sampler can be chosen instead. text_to_image follows
// StableDiffusionPipeline's order with every sampler: latents * init_noise_sigma, then per step
// scale_model_input on cat([x, x]), the UNet, guidance, step; checked against that loop written
// out here for PNDM (PLMS), Euler (init_noise_sigma and input scaling not 1) and DPM++ 2M Karras.
TEST(SdPipeline, FolderSchedulerAndAnySamplerFollowThePipelineLoop) {
  const std::string dir = test::temp_dir("sd_pndm");
  for (const char* part : {"unet", "vae", "text_encoder", "tokenizer"}) {
    fs::create_directory_symlink(fs::path(kSd) / part, fs::path(dir) / part);
  }
  fs::create_directory(fs::path(dir) / "scheduler");
  auto sc = nlohmann::json::parse(io::read_file(kSd + "/scheduler/scheduler_config.json"));
  sc["_class_name"] = "PNDMScheduler";
  sc["skip_prk_steps"] = true;
  io::write_file_atomic(dir + "/scheduler/scheduler_config.json", sc.dump(2));
  auto index = fixture_index();
  index["scheduler"] = {"diffusers", "PNDMScheduler"};
  io::write_file_atomic(dir + "/model_index.json", index.dump(2));

  for (const std::string kind : {"", "euler", "dpmpp_2m_karras"}) {
    families::stable_diffusion::StableDiffusionLoadOptions lo;
    lo.scheduler = kind;
    auto sd = families::stable_diffusion::load_stable_diffusion(dir, lo);
    const std::string want = kind.empty()      ? "PNDMScheduler"
                             : kind == "euler" ? "EulerDiscreteScheduler"
                                               : "DPMSolverMultistepScheduler";
    EXPECT_EQ(sd.scheduler->class_name(), want);
    families::stable_diffusion::TextToImageOptions o;
    o.prompts = {"a photo of a cat"};
    o.guidance_scale = 5.0;
    o.num_inference_steps = 4;
    o.seed = 7;
    const auto out = families::stable_diffusion::text_to_image(sd, o);

    // The same loop by hand, with a second sampler of the same kind.
    auto sampler = diffusion::load_sampler(dir + "/scheduler/scheduler_config.json", kind);
    sampler->set_timesteps(4);
    at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(7);
    torch::Tensor x = at::randn({1, 4, 16, 16}, gen, torch::kFloat32);
    x = x * sampler->init_noise_sigma();
    torch::NoGradGuard no_grad;
    models::UNetConditioning uc;
    uc.encoder_hidden_states = out.prompt_embeds;
    for (int64_t i = 0; i < sampler->timesteps().size(0); ++i) {
      const double t = sampler->timestep(i);
      const auto in = sampler->scale_model_input(torch::cat({x, x}), t);
      const auto parts = sd.unet->forward(in, sampler->timesteps()[i], uc).chunk(2, 0);
      x = sampler->step(parts[0] + 5.0 * (parts[1] - parts[0]), t, x, gen);
    }
    const double diff = max_abs(out.latents, x);
    std::printf("%s: pipeline vs written-out loop, max |latents diff| %.3g (tol 1e-6)\n",
                want.c_str(), diff);
    EXPECT_LE(diff, 1e-6) << want;
    if (kind == "euler") {
      EXPECT_GT(sampler->init_noise_sigma(), 1.0);
    }
  }
}

// Adapters on the UNet and the text encoder (as --train_text_encoder trains them), exported in
// each layout and loaded back through load_stable_diffusion(lora=...): the merged pipeline draws
// the images the adapters drew.
TEST(SdPipeline, TrainedLoraReloadsEqualInEveryFormat) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kSd);
  models::LoraConfig uc;
  uc.rank = 4;
  uc.alpha = 8;
  models::LoraLayers unet_lora(*sd.unet, uc);
  models::LoraConfig tc = uc;
  tc.target_modules = {"q_proj", "k_proj", "v_proj", "out_proj"};
  models::LoraLayers text_lora(*sd.text_encoders[0].module(), tc);
  {
    // Move every adapter away from its zero start, as training does.
    torch::NoGradGuard no_grad;
    torch::manual_seed(0);
    for (auto& p : unet_lora->parameters()) p.add_(torch::randn_like(p) * 0.2);
    for (auto& p : text_lora->parameters()) p.add_(torch::randn_like(p) * 0.2);
  }
  families::stable_diffusion::TextToImageOptions o;
  o.prompts = {"a photo of a cat"};
  o.num_inference_steps = 3;
  o.seed = 5;
  const auto adapted = families::stable_diffusion::text_to_image(sd, o).images;
  io::LoraWeights weights = unet_lora->to_lora_weights("unet");
  weights.components["text_encoder"] =
      text_lora->to_lora_weights("text_encoder").components["text_encoder"];
  EXPECT_EQ(weights.count("unet"), 32u);
  EXPECT_EQ(weights.count("text_encoder"), 8u);
  const std::string dir = test::temp_dir("sd_lora_reload");
  for (auto format : {io::LoraFormat::kDiffusers, io::LoraFormat::kPeft, io::LoraFormat::kKohya}) {
    const std::string path = dir + "/lora_" + io::to_string(format) + ".safetensors";
    io::write_lora(path, weights, format);
    families::stable_diffusion::StableDiffusionLoadOptions lo;
    lo.lora = path;
    auto merged = families::stable_diffusion::load_stable_diffusion(kSd, lo);
    const double d = max_abs(families::stable_diffusion::text_to_image(merged, o).images, adapted);
    std::cout << io::to_string(format) << ": merged vs adapters " << d << "\n";
    EXPECT_LE(d, 1e-4) << io::to_string(format);
  }
  auto plain = families::stable_diffusion::load_stable_diffusion(kSd);
  EXPECT_GT(max_abs(families::stable_diffusion::text_to_image(plain, o).images, adapted), 1e-3);
}

}  // namespace
}  // namespace difftrain
