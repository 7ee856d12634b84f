// StableDiffusionXLPipeline folders and text-to-image against the Diffusers 0.31 reference
// (tests/golden/sdxl/tiny_sdxl: Euler 8 steps, guidance 5, seed 42, negative prompt given).

#include "difftrain/diffusion/generate.h"
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/safetensors.h"
#include "sdxl_fixture.h"
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

using difftrain::test::kTinySdxl;
const std::vector<std::string>& kPrompts = test::kSdxlPrompts;

// Compares a run with a txt2img reference file (tolerances of the fixture README).
void expect_matches_reference(const families::stable_diffusion::TextToImageResult& out,
                              const std::map<std::string, torch::Tensor>& ref) {
  // prompt_embeds: [negative rows; positive rows].
  const auto embeds = torch::cat({ref.at("negative_prompt_embeds"), ref.at("prompt_embeds")});
  const auto pooled =
      torch::cat({ref.at("negative_pooled_prompt_embeds"), ref.at("pooled_prompt_embeds")});
  EXPECT_LE(max_abs(out.prompt_embeds, embeds), 1e-4);
  EXPECT_LE(max_abs(out.pooled_prompt_embeds, pooled), 1e-4);
  EXPECT_EQ(max_abs(out.add_time_ids, ref.at("add_time_ids")), 0.0);
  const double scale = ref.at("latents_final").abs().max().item<double>();
  const double latents = max_abs(out.latents, ref.at("latents_final"));
  const double images = max_abs(out.images, ref.at("images"));
  std::cout << "latents_final " << latents << " (|ref| max " << scale << "), images " << images
            << "\n";
  EXPECT_LE(latents, 1e-4 * scale);
  EXPECT_LE(images, 1e-4);
  EXPECT_EQ(out.images.sizes(), ref.at("images").sizes());
}

TEST(SdxlPipeline, FolderIsRecognised) {
  auto f = families::stable_diffusion::resolve_stable_diffusion_folder(kTinySdxl);
  // The SDXL family's extension of Stable Diffusion's pipeline reads the folder.
  ASSERT_NE(f.extension, nullptr);
  EXPECT_EQ(f.extension->display_name(), "SDXL");
  EXPECT_EQ(f.extension->default_guidance(), 5.0);
  EXPECT_TRUE(f.force_zeros_for_empty_prompt);
  EXPECT_EQ(f.pipeline_class, "StableDiffusionXLPipeline");
  EXPECT_EQ(f.scheduler_class, "EulerDiscreteScheduler");
  EXPECT_EQ(fs::path(f.extension_dirs.at("text_encoder_2")).filename(), "text_encoder_2");
  EXPECT_EQ(fs::path(f.extension_dirs.at("tokenizer_2")).filename(), "tokenizer_2");
  EXPECT_EQ(f.extension_dirs.size(), 2u);
  // A Stable Diffusion 1.x folder has none.
  const auto sd = families::stable_diffusion::resolve_stable_diffusion_folder(
      std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd");
  EXPECT_EQ(sd.extension, nullptr);
  EXPECT_TRUE(sd.extension_dirs.empty());
}

TEST(SdxlPipeline, Txt2ImgMatchesDiffusers) {
  auto ref = io::load_safetensors(kTinySdxl + "/txt2img_seed42.safetensors").tensors;
  auto sd = families::stable_diffusion::load_stable_diffusion(kTinySdxl);
  ASSERT_NE(sd.folder.extension, nullptr);
  ASSERT_EQ(sd.text_encoders.size(), 2u);
  EXPECT_EQ(sd.scheduler->class_name(), "EulerDiscreteScheduler");
  // The tokenizers' ids equal the reference's exactly.
  const auto ids = sd.text_encoders.tokenize(kPrompts);
  ASSERT_EQ(ids.size(), 2u);
  EXPECT_TRUE(torch::equal(ids[0].input_ids, ref.at("input_ids")));
  EXPECT_TRUE(torch::equal(ids[1].input_ids, ref.at("input_ids_2")));

  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(42);
  EXPECT_EQ(max_abs(at::randn({2, 4, 16, 16}, gen, torch::kFloat32), ref.at("latents_init")), 0.0);

  auto out = families::stable_diffusion::text_to_image(sd, test::sdxl_fixture_call());
  EXPECT_LE(max_abs(sd.scheduler->timesteps(), ref.at("timesteps")), 0.0);
  EXPECT_NEAR(sd.scheduler->init_noise_sigma(), ref.at("init_noise_sigma").item<double>(), 1e-5);
  expect_matches_reference(out, ref);
}

TEST(SdxlPipeline, GenerateDefaultsToGuidanceFiveAndTheFolderSize) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kTinySdxl);
  diffusion::Pipeline& pipe = sd;
  EXPECT_EQ(pipe.class_name(), "StableDiffusionXLPipeline");
  diffusion::GenerateRequest r;
  r.prompts = {kPrompts[0]};
  const auto resolved = pipe.resolve(r);
  EXPECT_EQ(*resolved.guidance_scale, 5.0);
  r.num_inference_steps = 2;
  auto out = pipe.generate(r);
  // sample_size 16 x VAE factor 2.
  EXPECT_EQ(out.images.sizes(), (c10::IntArrayRef{1, 32, 32, 3}));
}

TEST(SdxlPipeline, NoNegativePromptGivesZeroNegativesWhenTheFolderSaysSo) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kTinySdxl);
  auto o = test::sdxl_fixture_call();
  o.negative_prompts.clear();
  o.num_inference_steps = 1;
  auto out = families::stable_diffusion::text_to_image(sd, o);
  EXPECT_EQ(out.prompt_embeds.narrow(0, 0, 2).abs().max().item<double>(), 0.0);
  EXPECT_EQ(out.pooled_prompt_embeds.narrow(0, 0, 2).abs().max().item<double>(), 0.0);
  EXPECT_GT(out.prompt_embeds.narrow(0, 2, 2).abs().max().item<double>(), 0.0);

  // With force_zeros_for_empty_prompt false the negatives are the encoding of "".
  sd.folder.force_zeros_for_empty_prompt = false;
  auto empty = families::stable_diffusion::text_to_image(sd, o);
  auto expect = sd.text_encoders.encode({"", ""});
  EXPECT_EQ(max_abs(empty.prompt_embeds.narrow(0, 0, 2), expect.embeds), 0.0);
  EXPECT_EQ(max_abs(empty.pooled_prompt_embeds.narrow(0, 0, 2), expect.pooled), 0.0);
}

TEST(SdxlPipeline, MicroConditioningReachesTheTimeIds) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kTinySdxl);
  auto o = test::sdxl_fixture_call();
  o.num_inference_steps = 1;
  o.options["original_size"] = {1024, 768};
  o.options["crops_coords_top_left"] = {16, 8};
  o.options["target_size"] = {64, 48};
  o.options["negative_original_size"] = {512, 512};
  auto out = families::stable_diffusion::text_to_image(sd, o);
  const auto ids = out.add_time_ids;
  ASSERT_EQ(ids.sizes(), (c10::IntArrayRef{4, 6}));
  auto row = [&](int64_t i) {
    auto r = ids[i].to(torch::kLong);
    return std::vector<int64_t>(r.data_ptr<int64_t>(), r.data_ptr<int64_t>() + 6);
  };
  EXPECT_EQ(row(0), (std::vector<int64_t>{512, 512, 16, 8, 64, 48}));  // negative
  EXPECT_EQ(row(3), (std::vector<int64_t>{1024, 768, 16, 8, 64, 48}));
  // And it changes the image against the default call.
  auto base = families::stable_diffusion::text_to_image(sd, [] {
    auto c = test::sdxl_fixture_call();
    c.num_inference_steps = 1;
    return c;
  }());
  EXPECT_GT(max_abs(out.latents, base.latents), 1e-3);
  o.options["crops_coords_top_left"] = {1, 2, 3};
  EXPECT_NE(error_of([&] {
              families::stable_diffusion::text_to_image(sd, o);
            }).find("--crops_coords_top_left takes two integers (top left), got 3"),
            std::string::npos);
  o.options["crops_coords_top_left"] = "16 8";
  EXPECT_NE(error_of([&] {
              families::stable_diffusion::text_to_image(sd, o);
            }).find("--crops_coords_top_left takes integers"),
            std::string::npos);
  // A name the extension does not read, and micro-conditioning on a Stable Diffusion 1.x folder.
  o.options = {{"aesthetic_score", 6}};
  EXPECT_NE(error_of([&] {
              families::stable_diffusion::text_to_image(sd, o);
            }).find("--aesthetic_score is not an option of StableDiffusionXLPipeline"),
            std::string::npos);
  auto sd1 = families::stable_diffusion::load_stable_diffusion(
      std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd");
  auto o1 = o;
  o1.prompts = {"a"};
  o1.negative_prompts = {};
  o1.options = {{"original_size", {64, 64}}};
  EXPECT_NE(error_of([&] {
              families::stable_diffusion::text_to_image(sd1, o1);
            }).find("--original_size: not options of StableDiffusionPipeline"),
            std::string::npos);
}

TEST(SdxlPipeline, GuidanceRescaleMatchesAFloat64Recomputation) {
  torch::manual_seed(3);
  auto cfg = torch::randn({2, 4, 5, 5}, torch::kFloat64);
  auto text = torch::randn({2, 4, 5, 5}, torch::kFloat64) * 3;
  auto got = families::stable_diffusion::rescale_noise_cfg(cfg.to(torch::kFloat32),
                                                           text.to(torch::kFloat32), 0.7);
  for (int64_t b = 0; b < 2; ++b) {
    // Sample std with Bessel's correction, per sample over C, H, W.
    auto std_of = [](const torch::Tensor& t) {
      const double mean = t.mean().item<double>();
      return std::sqrt((t - mean).pow(2).sum().item<double>() / (t.numel() - 1));
    };
    const double ratio = std_of(text[b]) / std_of(cfg[b]);
    auto want = 0.7 * cfg[b] * ratio + 0.3 * cfg[b];
    EXPECT_LE(max_abs(got[b], want), 1e-5);
  }
  auto sd = families::stable_diffusion::load_stable_diffusion(kTinySdxl);
  auto o = test::sdxl_fixture_call();
  o.num_inference_steps = 2;
  auto plain = families::stable_diffusion::text_to_image(sd, o);
  o.guidance_rescale = 0.7;
  auto rescaled = families::stable_diffusion::text_to_image(sd, o);
  EXPECT_GT(max_abs(plain.latents, rescaled.latents), 1e-3);
  o.guidance_rescale = 1.5;
  EXPECT_NE(
      error_of([&] { families::stable_diffusion::text_to_image(sd, o); }).find("guidance_rescale"),
      std::string::npos);
}

TEST(SdxlPipeline, BrokenFoldersAreNamed) {
  auto index = test::read_json(kTinySdxl + "/model_index.json");
  auto make = [&](const std::string& stem, const nlohmann::json& idx,
                  const std::vector<std::string>& parts) {
    const std::string dir = test::temp_dir(stem);
    for (const auto& part : parts) {
      fs::create_directory_symlink(fs::path(kTinySdxl) / part, fs::path(dir) / part);
    }
    io::write_file_atomic(dir + "/model_index.json", idx.dump(2));
    return dir;
  };
  const std::vector<std::string> all = {
      "unet", "vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"};
  // No tokenizer_2 listed.
  auto bad = index;
  bad.erase("tokenizer_2");
  auto msg = error_of(
      [&] { families::stable_diffusion::resolve_stable_diffusion_folder(make("xl_a", bad, all)); });
  EXPECT_NE(msg.find("no tokenizer_2"), std::string::npos) << msg;
  // text_encoder_2 listed but its folder is missing.
  msg = error_of([&] {
    families::stable_diffusion::resolve_stable_diffusion_folder(make(
        "xl_b", index, {"unet", "vae", "text_encoder", "tokenizer", "tokenizer_2", "scheduler"}));
  });
  EXPECT_NE(msg.find("text_encoder_2"), std::string::npos) << msg;
  // A text_encoder_2 of the wrong class.
  bad = index;
  bad["text_encoder_2"] = {"transformers", "T5EncoderModel"};
  msg = error_of(
      [&] { families::stable_diffusion::resolve_stable_diffusion_folder(make("xl_c", bad, all)); });
  EXPECT_NE(msg.find("T5EncoderModel"), std::string::npos) << msg;
  bad = index;
  bad["force_zeros_for_empty_prompt"] = "yes";
  msg = error_of(
      [&] { families::stable_diffusion::resolve_stable_diffusion_folder(make("xl_d", bad, all)); });
  EXPECT_NE(msg.find("force_zeros_for_empty_prompt"), std::string::npos) << msg;
}

TEST(SdxlPipeline, AFloat16VaeDecodesInFloat32WhenForceUpcast) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kTinySdxl);
  auto o = test::sdxl_fixture_call();
  o.num_inference_steps = 2;
  auto ref = families::stable_diffusion::text_to_image(sd, o);
  sd.vae->to(torch::kFloat16);
  auto out = families::stable_diffusion::text_to_image(sd, o);
  // Decoded with float16 weights made float32 again: close to the float32 run, finite, and the
  // VAE is float16 again afterwards.
  EXPECT_TRUE(torch::isfinite(out.images).all().item<bool>());
  EXPECT_LE(max_abs(out.images, ref.images), 5e-3);
  EXPECT_EQ(sd.vae->parameters()[0].scalar_type(), torch::kFloat16);
}

TEST(SdxlPipeline, ClipSkipTakesAnEarlierLayerOfBothEncoders) {
  auto sd = families::stable_diffusion::load_stable_diffusion(kTinySdxl);
  torch::NoGradGuard no_grad;
  auto& text = sd.text_encoders;
  const auto& clip = text.as<diffusion::ClipTextEncoder>(0);
  const auto& clip_2 = text.as<diffusion::ClipTextEncoder>(1);
  const auto ids = clip.tokenizer().encode_batch(kPrompts);
  const auto ids_2 = clip_2.tokenizer().encode_batch(kPrompts);
  auto a = clip.model().ptr()->forward(ids, 0, true);
  auto b = clip_2.model().ptr()->forward(ids_2, 0, true);
  for (int64_t skip : {0, 1}) {
    auto e = text.encode(kPrompts, skip);
    // hidden_states[-(skip + 2)] of each, concatenated; the pooled embedding never moves.
    const auto want = torch::cat({a.hidden_states[a.hidden_states.size() - 2 - skip],
                                  b.hidden_states[b.hidden_states.size() - 2 - skip]},
                                 -1);
    EXPECT_EQ(max_abs(e.embeds, want), 0.0) << skip;
    EXPECT_EQ(max_abs(e.pooled, b.text_embeds), 0.0) << skip;
  }
  // text_encoder has 2 layers (3 hidden states): clip_skip 1 reaches its embeddings, 2 is too far.
  EXPECT_NE(error_of([&] { text.encode(kPrompts, 2); }).find("clip_skip 2"), std::string::npos);
}

}  // namespace
}  // namespace difftrain
