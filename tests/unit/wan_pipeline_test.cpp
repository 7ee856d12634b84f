// Wan sampling against Diffusers' own (tests/golden/wan/make_pipeline.py): UniPCMultistepScheduler
// with flow sigmas (Wan's scheduler: flow_shift 3 and 5, orders 1-3, 1 to 50 steps,
// lower_order_final off, a disabled corrector) step for step; WanPipeline's prompt cleaning and
// UMT5 embeddings from strings (make_text_encoder.py); WanPipeline.__call__ seed for seed (CFG,
// no CFG, frame rounding, two prompts x two videos, Wan 2.2 A14B's expert switch); refusals.
#include "../../src/families/wan/wan_pipeline.h"

#include "difftrain/diffusion/sampler.h"
#include "difftrain/families/family.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/text_encoders/clip_vision_model.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

namespace wan_pipeline_test {

using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::max_abs;
namespace wan = difftrain::families::wan;

const std::string kWanDir = kGoldenDir + "wan";

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

TEST(UniPcFlow, EveryConfigStepsAsDiffusers) {
  const auto j = read_json(kWanDir + "/unipc_flow.json");
  const auto f = difftrain::io::load_safetensors(kWanDir + "/unipc_flow.safetensors").tensors;
  int checked = 0;
  for (const auto& [name, c] : j.at("configs").items()) {
    SCOPED_TRACE(name);
    nlohmann::json config = j.at("base_config");
    config["_class_name"] = "UniPCMultistepScheduler";
    for (const auto& [k, v] : c.at("config").items()) {
      if (k != "num_inference_steps") config[k] = v;
    }
    const int64_t n = c.at("config").at("num_inference_steps").get<int64_t>();
    auto s = difftrain::diffusion::make_sampler(config, "", name);
    s->set_timesteps(n);
    EXPECT_TRUE(torch::equal(s->timesteps().to(torch::kInt64), f.at(name + ".timesteps")));
    EXPECT_TRUE(torch::equal(s->sigmas(), f.at(name + ".sigmas")));
    torch::Tensor x = f.at(name + ".sample_init");
    const auto& out = f.at(name + ".model_output");
    const auto& want = f.at(name + ".prev_sample");
    for (int64_t i = 0; i < n; ++i) {
      x = s->step(out[i], s->timestep(i), x);
      const auto& w = want[i];
      if (!torch::isfinite(w).all().item<bool>()) {  // lower_order_final off: inf as Diffusers
        EXPECT_TRUE(torch::equal(torch::isinf(x), torch::isinf(w))) << "step " << i;
        break;
      }
      EXPECT_LT(max_abs(x, w), 1e-5 * std::max(1.0, w.abs().max().item<double>())) << "step " << i;
      x = w;  // each step from the reference's sample
    }
    ++checked;
  }
  EXPECT_EQ(checked, 21);
}

TEST(WanPrompts, CleaningAndUmt5EmbeddingsFromStringsMatchDiffusers) {
  torch::NoGradGuard no_grad;
  const auto j = read_json(kWanDir + "/prompts_expected.json");
  const auto f = difftrain::io::load_safetensors(kWanDir + "/prompt_embeds.safetensors").tensors;
  const auto tok = difftrain::models::T5Tokenizer::load(kWanDir + "/tiny_wan/tokenizer");
  auto enc = difftrain::models::load_t5_encoder(kWanDir + "/tiny_wan/text_encoder");
  for (const auto& [name, c] : j.at("cases").items()) {
    if (c.value("dtype", "float32") != "float32") continue;
    SCOPED_TRACE(name);
    const auto& a = c.at("arguments");
    std::vector<std::string> prompts;
    if (a.at("prompt").is_string()) {
      prompts = {a.at("prompt").get<std::string>()};
    } else {
      prompts = a.at("prompt").get<std::vector<std::string>>();
    }
    const auto cleaned = c.at("cleaned_prompts").get<std::vector<std::string>>();
    for (size_t i = 0; i < prompts.size(); ++i) {
      EXPECT_EQ(wan::wan_prompt_clean(prompts[i]), cleaned[i]);
    }
    const int64_t msl = a.at("max_sequence_length").get<int64_t>();
    const int64_t k = a.at("num_videos_per_prompt").get<int64_t>();
    const auto e = wan::encode_wan_prompts(tok, enc, prompts, msl).repeat_interleave(k, 0);
    EXPECT_LT(max_abs(e, f.at(name + ".prompt_embeds")), 2e-5);
  }
}

TEST(WanPipeline, SamplingMatchesDiffusersSeedForSeed) {
  torch::NoGradGuard no_grad;
  const auto j = read_json(kWanDir + "/tiny_wan/sample_e2e.json");
  const auto f =
      difftrain::io::load_safetensors(kWanDir + "/tiny_wan/sample_e2e.safetensors").tensors;
  for (const auto& [name, c] : j.at("cases").items()) {
    SCOPED_TRACE(name);
    const auto& a = c.at("arguments");
    auto p = wan::load_wan_pipeline(kWanDir + "/" + c.at("folder").get<std::string>());
    difftrain::diffusion::GenerateRequest r;
    if (a.at("prompt").is_string()) {
      r.prompts = {a.at("prompt").get<std::string>()};
    } else {
      r.prompts = a.at("prompt").get<std::vector<std::string>>();
    }
    if (a.contains("negative_prompt") && a.at("negative_prompt").is_string()) {
      r.negative_prompts = {a.at("negative_prompt").get<std::string>()};
    }
    r.guidance_scale = a.at("guidance_scale").get<double>();
    if (a.contains("guidance_scale_2")) r.options["guidance_scale_2"] = a.at("guidance_scale_2");
    r.height = a.at("height").get<int64_t>();
    r.width = a.at("width").get<int64_t>();
    r.options["num_frames"] = a.at("num_frames").get<int64_t>();
    r.num_inference_steps = a.at("num_inference_steps").get<int64_t>();
    r.num_images = a.at("num_videos_per_prompt").get<int64_t>();
    r.seed = a.at("seed").get<uint64_t>();
    const auto out = p.generate(r);
    const auto& frames = f.at(name + ".frames");
    ASSERT_EQ(out.images.sizes(), frames.sizes());
    const double dl = max_abs(out.latents, f.at(name + ".latents_final"));
    const double df = max_abs(out.images, frames);
    std::cout << name << ": latents " << dl << ", frames " << df << "\n";
    EXPECT_LT(dl, 1e-4);
    EXPECT_LT(df, 1e-4);
    EXPECT_LT(max_abs(out.prompt_embeds, f.at(c.at("prompt_embeds_key").get<std::string>())), 2e-5);
  }
}

TEST(WanPipeline, RefusesWhatItCannotRun) {
  auto p = wan::load_wan_pipeline(kWanDir + "/tiny_wan");
  difftrain::diffusion::GenerateRequest r;
  r.prompts = {"a"};
  r.height = 40;
  r.width = 48;
  r.num_inference_steps = 1;
  r.options["num_frames"] = 1;
  EXPECT_NE(error_of([&] { p.generate(r); }).find("divisible by 16"), std::string::npos);
  difftrain::diffusion::PipelineLoadOptions o;
  o.lora = "x.safetensors";
  EXPECT_NE(
      error_of([&] { wan::load_wan_pipeline(kWanDir + "/tiny_wan", o); }).find("x.safetensors"),
      std::string::npos);
}

// Wan LoRA files as WanLoraLoaderMixin reads them (make_lora.py): Diffusers (alpha in the header
// metadata), the original / ComfyUI / musubi-tuner names with .alpha, kohya's lora_unet_ names of
// the original modules, an I2V file with the image branch and the top-level modules; merged, the
// transformer's output equals Diffusers' fused one; convert writes the original names back.
TEST(WanLora, EveryLayoutGivesDiffusersOutputAndConvertsBack) {
  torch::NoGradGuard no_grad;
  const auto j = read_json(kWanDir + "/lora/cases.json");
  const auto want = difftrain::io::load_safetensors(kWanDir + "/lora/expected.safetensors").tensors;
  const auto inputs =
      difftrain::io::load_safetensors(kWanDir + "/tiny_wan/forward.safetensors").tensors;
  auto forward_case = [&](const std::string& c) {
    std::map<std::string, torch::Tensor> in;
    for (const char* k :
         {"hidden_states", "timestep", "encoder_hidden_states", "encoder_hidden_states_image"}) {
      if (inputs.count(c + "." + k)) in[k] = inputs.at(c + "." + k);
    }
    return in;
  };
  int checked = 0;
  for (const auto& [key, e] : j.at("entries").items()) {
    if (e.at("file").is_null() || !e.at("fused").get<bool>()) continue;
    SCOPED_TRACE(key);
    const std::string dir = kWanDir + "/tiny_wan/" + e.at("transformer").get<std::string>();
    const auto out = wan::forward_wan(dir, forward_case(e.at("forward_case").get<std::string>()),
                                      "in", kWanDir + "/lora/" + e.at("file").get<std::string>(),
                                      e.at("lora_scale").get<double>())
                         .at("out");
    const double d = max_abs(out, want.at(key));
    std::cout << key << ": " << d << "\n";
    EXPECT_LT(d, 2e-5);
    ++checked;
  }
  EXPECT_GE(checked, 5);
  // lora convert --to comfyui / kohya with the folder: the original module names.
  const std::string tmp = testing::TempDir();
  for (const auto& [format, probe] :
       {std::pair<difftrain::io::LoraFormat, std::string>{
            difftrain::io::LoraFormat::kComfyUI,
            "diffusion_model.blocks.0.self_attn.q.lora_down.weight"},
        {difftrain::io::LoraFormat::kKohya, "lora_unet_blocks_1_ffn_2.lora_up.weight"}}) {
    const std::string out = tmp + "/wan_convert_" + probe.substr(0, 10) + ".safetensors";
    difftrain::families::convert_lora(kWanDir + "/lora/diffusers.safetensors", out, format,
                                      kWanDir + "/tiny_wan");
    EXPECT_TRUE(difftrain::io::load_safetensors(out).tensors.count(probe)) << probe;
    const auto again =
        wan::forward_wan(kWanDir + "/tiny_wan", forward_case("t2v_f5"), "in", out, 1.0).at("out");
    EXPECT_LT(max_abs(again, want.at("diffusers.t2v_f5.out")), 2e-5) << probe;
  }
}

// WanImageToVideoPipeline as Wan 2.2 runs it (no image encoder; make_i2v.py): the first frame
// (and, for FLF2V, the last) resized with PIL's lanczos, the clip of it and zeros VAE-encoded,
// normalised and concatenated after a 4-channel mask to the noise; CFG and none; seed for seed.
// Wan 2.2 TI2V-5B (tests/golden/wan/make_ti2v.py): the 48-channel VAE, per-token timesteps,
// sizes floored to whole 32-pixel patches, and image to video from the same folder (the image's
// latents replace the first latent frame, whose tokens get t = 0).
TEST(WanTi2v, TextAndImageToVideoMatchDiffusersSeedForSeed) {
  torch::NoGradGuard no_grad;
  const std::string dir = kWanDir + "/tiny_wan_ti2v";
  const auto j = read_json(dir + "/sample_ti2v.json");
  const auto f = difftrain::io::load_safetensors(dir + "/sample_ti2v.safetensors").tensors;
  int checked = 0;
  for (const auto& [name, c] : j.at("cases").items()) {
    SCOPED_TRACE(name);
    const auto& a = c.at("arguments");
    auto p = wan::load_wan_pipeline(dir);
    EXPECT_TRUE(p.folder.expand_timesteps);
    if (a.contains("image")) {
      const std::string text = a.at("image").get<std::string>();
      p.image = f.at(text.substr(0, text.find(' ')));
    }
    difftrain::diffusion::GenerateRequest r;
    r.prompts = {a.at("prompt").get<std::string>()};
    r.guidance_scale = a.at("guidance_scale").get<double>();
    r.height = a.at("height").get<int64_t>();
    r.width = a.at("width").get<int64_t>();
    r.options["num_frames"] = a.at("num_frames").get<int64_t>();
    r.num_inference_steps = a.at("num_inference_steps").get<int64_t>();
    r.seed = a.at("seed").get<uint64_t>();
    const auto out = p.generate(r);
    const double dl = max_abs(out.latents, f.at(name + ".latents_final"));
    const double df = max_abs(out.images, f.at(name + ".frames"));
    std::cout << name << ": latents " << dl << ", frames " << df << "\n";
    EXPECT_LT(dl, 1e-4);
    EXPECT_LT(df, 1e-4);
    ++checked;
  }
  EXPECT_EQ(checked, 4);
}

// Wan 2.1 image to video's CLIP vision encoder (tests/golden/wan/make_clip_vision.py: a
// transcription of Transformers' CLIPVisionModel and CLIPImageProcessor): the processor's resize,
// crop, rescale and normalisation, every hidden state, and the pipeline with its image encoder
// seed for seed (the penultimate hidden states as the image context of both CFG branches).
TEST(WanImageToVideo21, ClipVisionAndSamplingMatchTheReference) {
  torch::NoGradGuard no_grad;
  const std::string dir = kWanDir + "/tiny_wan_i2v21";
  const auto cases = difftrain::io::load_safetensors(dir + "/clip_cases.safetensors").tensors;
  auto clip = difftrain::models::load_clip_vision_model(dir + "/image_encoder");
  const auto processor = difftrain::models::ClipImageProcessorOptions::load(
      dir + "/image_processor/preprocessor_config.json");
  for (const std::string name : {"image_h40_w60", "image_h28_w28", "gray_h100_w30"}) {
    SCOPED_TRACE(name);
    const auto px =
        difftrain::models::clip_image_pixel_values({cases.at(name + ".rgb")}, processor);
    EXPECT_LT(max_abs(px, cases.at(name + ".pixel_values")), 1e-6);
    const auto out = clip->forward(px);
    const auto ref = cases.at(name + ".hidden_states");
    ASSERT_EQ(static_cast<int64_t>(out.hidden_states.size()), ref.size(0));
    for (int64_t i = 0; i < ref.size(0); ++i) {
      EXPECT_LT(max_abs(out.hidden_states[static_cast<size_t>(i)], ref[i]), 1e-5) << i;
    }
    EXPECT_LT(max_abs(out.pooler_output, cases.at(name + ".pooler_output")), 1e-5);
    EXPECT_LT(
        max_abs(out.hidden_states[out.hidden_states.size() - 2], cases.at(name + ".image_embeds")),
        1e-5);
  }
  const auto f = difftrain::io::load_safetensors(dir + "/sample_i2v21.safetensors").tensors;
  const auto a = read_json(dir + "/sample_i2v21.json").at("case").at("arguments");
  auto p = wan::load_wan_pipeline(dir);
  EXPECT_EQ(p.class_name(), "WanImageToVideoPipeline");
  ASSERT_TRUE(p.image_encoder);
  p.image = f.at("source_image");
  difftrain::diffusion::GenerateRequest r;
  r.prompts = {a.at("prompt").get<std::string>()};
  r.guidance_scale = a.at("guidance_scale").get<double>();
  r.height = a.at("height").get<int64_t>();
  r.width = a.at("width").get<int64_t>();
  r.options["num_frames"] = a.at("num_frames").get<int64_t>();
  r.num_inference_steps = a.at("num_inference_steps").get<int64_t>();
  r.seed = a.at("seed").get<uint64_t>();
  const auto out = p.generate(r);
  const double dl = max_abs(out.latents, f.at("latents_final"));
  const double df = max_abs(out.images, f.at("frames"));
  std::cout << "Wan 2.1 I2V: latents " << dl << ", frames " << df << "\n";
  EXPECT_LT(dl, 1e-4);
  EXPECT_LT(df, 1e-4);
}

TEST(WanImageToVideo, SamplingMatchesDiffusersSeedForSeed) {
  torch::NoGradGuard no_grad;
  const std::string dir = kWanDir + "/tiny_wan_i2v";
  const auto j = read_json(dir + "/sample_i2v.json");
  const auto f = difftrain::io::load_safetensors(dir + "/sample_i2v.safetensors").tensors;
  auto source = [&](const nlohmann::json& v) {
    const std::string text = v.get<std::string>();
    return f.at(text.substr(0, text.find(' ')));
  };
  int checked = 0;
  for (const auto& [name, c] : j.at("cases").items()) {
    SCOPED_TRACE(name);
    const auto& a = c.at("arguments");
    auto p = wan::load_wan_pipeline(dir);
    EXPECT_EQ(p.class_name(), "WanImageToVideoPipeline");
    p.image = source(a.at("image"));
    if (a.contains("last_image") && !a.at("last_image").is_null()) {
      p.last_image = source(a.at("last_image"));
    }
    difftrain::diffusion::GenerateRequest r;
    r.prompts = {a.at("prompt").get<std::string>()};
    r.guidance_scale = a.at("guidance_scale").get<double>();
    r.height = a.at("height").get<int64_t>();
    r.width = a.at("width").get<int64_t>();
    r.options["num_frames"] = a.at("num_frames").get<int64_t>();
    r.num_inference_steps = a.at("num_inference_steps").get<int64_t>();
    r.seed = a.at("seed").get<uint64_t>();
    const auto out = p.generate(r);
    const double dl = max_abs(out.latents, f.at(name + ".latents_final"));
    const double df = max_abs(out.images, f.at(name + ".frames"));
    std::cout << name << ": latents " << dl << ", frames " << df << "\n";
    EXPECT_LT(dl, 1e-4);
    EXPECT_LT(df, 1e-4);
    ++checked;
  }
  EXPECT_EQ(checked, 4);
  // A text-to-video folder takes no image; an image-to-video one needs it.
  auto t2v = wan::load_wan_pipeline(kWanDir + "/tiny_wan");
  difftrain::diffusion::GenerateRequest r;
  r.prompts = {"a"};
  r.height = 32;
  r.width = 48;
  r.num_inference_steps = 2;
  r.options["num_frames"] = 1;
  r.options["image"] = "x.png";
  EXPECT_NE(error_of([&] { t2v.generate(r); }).find("image-to-video"), std::string::npos);
  auto i2v = wan::load_wan_pipeline(dir);
  r.options.erase("image");
  EXPECT_NE(error_of([&] { i2v.generate(r); }).find("--image"), std::string::npos);
}

}  // namespace wan_pipeline_test
