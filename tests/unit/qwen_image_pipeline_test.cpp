// QwenImagePipeline against Diffusers' own (tests/golden/qwen_image: make_prompts.py for
// encode_prompt from prompt strings, make_pipeline.py for __call__ from prompt embeddings): the
// system template, the 34 dropped tokens, padding to the batch's longest, the cut to
// max_sequence_length, the tokenizer's truncation at 1058; the dynamic shift with the terminal
// stretch, custom sigmas, odd sizes floored, true CFG with its norm rescale, several images per
// prompt; refusals.
#include "../../src/families/qwen_image/qwen_image_pipeline.h"

#include "difftrain/families/family.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora_folder.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <fstream>

namespace qwen_image_pipeline_test {

using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::max_abs;
namespace qi = difftrain::families::qwen_image;

const std::string kQwenDir = kGoldenDir + "qwen_image";
const std::string kTiny = kQwenDir + "/tiny_qwen_image";

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

difftrain::io::TensorMap tensors(const std::string& path) {
  static std::map<std::string, difftrain::io::TensorMap> cache;
  auto it = cache.find(path);
  if (it == cache.end()) {
    it = cache.emplace(path, difftrain::io::load_safetensors(path).tensors).first;
  }
  return it->second;
}

qi::QwenImagePipeline& pipeline() {
  static qi::QwenImagePipeline p = qi::load_qwen_image_pipeline(kTiny);
  return p;
}

TEST(QwenImagePrompts, EncodePromptFromStringsMatchesDiffusers) {
  torch::NoGradGuard no_grad;
  const auto cases = read_json(kQwenDir + "/prompts_expected.json").at("cases");
  const auto& f = tensors(kQwenDir + "/prompt_embeds.safetensors");
  auto& text = pipeline().text_encoders;
  for (const auto& [name, c] : cases.items()) {
    SCOPED_TRACE(name);
    const auto prompts = c.at("arguments").at("prompt").get<std::vector<std::string>>();
    const auto tokens = text.tokenize(prompts);
    ASSERT_EQ(tokens.size(), 1u);
    EXPECT_TRUE(torch::equal(tokens[0].input_ids, f.at(name + ".input_ids"))) << name;
    EXPECT_TRUE(torch::equal(tokens[0].attention_mask, f.at(name + ".attention_mask"))) << name;
    const auto e = text.encode(prompts);
    const auto& want = f.at(name + ".get.prompt_embeds");
    ASSERT_EQ(e.embeds.sizes(), want.sizes()) << name;
    const double diff = max_abs(e.embeds, want);
    std::cout << name << ": prompt_embeds max abs diff " << diff << "\n";
    EXPECT_LT(diff, 2e-5) << name;
    EXPECT_TRUE(torch::equal(e.attention_mask.to(torch::kInt64),
                             f.at(name + ".get.prompt_embeds_mask").to(torch::kInt64)))
        << name;
  }
}

difftrain::diffusion::GenerateRequest request_of(const std::string& name, const nlohmann::json& c) {
  const auto& a = c.at("arguments");
  const auto& f = tensors(kTiny + "/pipeline.safetensors");
  difftrain::diffusion::GenerateRequest r;
  r.prompt_embeds = f.at(name + ".prompt_embeds");
  r.prompt_attention_mask = f.at(name + ".prompt_embeds_mask");
  for (int64_t i = 0; i < r.prompt_embeds.size(0); ++i)
    r.prompts.push_back("p" + std::to_string(i));
  if (!a.at("negative_prompt_embeds").is_null()) {
    r.negative_prompt_embeds = f.at(name + ".negative_prompt_embeds");
    r.negative_attention_mask = f.at(name + ".negative_prompt_embeds_mask");
  }
  r.height = a.at("height").get<int64_t>();
  r.width = a.at("width").get<int64_t>();
  if (a.contains("num_inference_steps")) r.num_inference_steps = a.at("num_inference_steps");
  r.num_images = a.at("num_images_per_prompt").get<int64_t>();
  r.max_sequence_length = a.at("max_sequence_length").get<int64_t>();
  r.options["true_cfg_scale"] = a.at("true_cfg_scale").get<double>();
  if (a.contains("sigmas")) r.options["sigmas"] = a.at("sigmas");
  r.seed = a.at("seed").get<uint64_t>();
  return r;
}

TEST(QwenImagePipeline, SamplingFromEmbeddingsMatchesDiffusers) {
  const auto cases = read_json(kTiny + "/pipeline_cases.json").at("cases");
  const auto& f = tensors(kTiny + "/pipeline.safetensors");
  for (const char* k : {"basic", "odd", "sigmas"}) {
    const std::string name = k;
    SCOPED_TRACE(name);
    const auto out = pipeline().generate(request_of(name, cases.at(name)));
    const auto& want_images = f.at(name + ".image");
    ASSERT_EQ(out.images.sizes(), want_images.sizes()) << name;
    const double dl = max_abs(out.latents, f.at(name + ".latents"));
    const double di = max_abs(out.images, want_images);
    std::cout << name << ": latents " << dl << ", images " << di << "\n";
    EXPECT_LT(dl, 1e-4) << name;
    EXPECT_LT(di, 1e-4) << name;
    // The schedule: the dynamic shift, the terminal stretch to 0.02, then 0.
    const auto sigmas = pipeline().scheduler->sigmas();
    EXPECT_LT(max_abs(sigmas, f.at(name + ".sigmas")), 1e-7) << name;
  }
}

TEST(QwenImagePipeline, TrueCfgWithSeveralImagesPerPromptMatchesDiffusersRowsWithTheirOwnMasks) {
  // Diffusers repeats the masks p0 p1 p0 p1 under embeddings p0 p0 p1 p1, so its rows 1 and 2
  // pair a prompt with the other's mask; rows 0 and 3 are right, and difftrain gives every row
  // its own prompt's mask. So: rows 0 and 3 equal Diffusers', rows 1 and 2 differ.
  const auto cases = read_json(kTiny + "/pipeline_cases.json").at("cases");
  const auto& f = tensors(kTiny + "/pipeline.safetensors");
  const auto out = pipeline().generate(request_of("cfg", cases.at("cfg")));
  ASSERT_EQ(out.latents.sizes(), f.at("cfg.latents").sizes());
  for (int64_t row : {0, 3}) {
    const double d = max_abs(out.latents[row], f.at("cfg.latents")[row]);
    std::cout << "cfg row " << row << ": latents " << d << "\n";
    EXPECT_LT(d, 1e-4) << row;
    EXPECT_LT(max_abs(out.images[row], f.at("cfg.image")[row]), 1e-4) << row;
  }
  EXPECT_GT(max_abs(out.latents[1], f.at("cfg.latents")[1]), 1e-3);
  // The guidance really acts: without it the first row changes.
  auto plain = request_of("cfg", cases.at("cfg"));
  plain.options["true_cfg_scale"] = 1.0;
  const auto unguided = pipeline().generate(plain);
  EXPECT_GT(max_abs(unguided.latents[0], out.latents[0]), 1e-3);
}

TEST(QwenImagePipeline, RefusesWhatThePipelineRefuses) {
  const auto cases = read_json(kTiny + "/pipeline_cases.json").at("cases");
  auto r = request_of("basic", cases.at("basic"));
  r.guidance_scale = 3.5;
  EXPECT_NE(error_of([&] { pipeline().generate(r); }).find("--true_cfg_scale"), std::string::npos);
  r = request_of("basic", cases.at("basic"));
  r.max_sequence_length = 2000;
  EXPECT_NE(error_of([&] { pipeline().generate(r); }).find("[1, 1024]"), std::string::npos);
  r = request_of("basic", cases.at("basic"));
  r.height = 8;
  EXPECT_NE(error_of([&] { pipeline().generate(r); }).find("--height 8 is below 16"),
            std::string::npos);
  const auto missing = error_of([] { qi::load_qwen_image_pipeline(kQwenDir); });
  EXPECT_NE(missing.find("model_index.json: no such file"), std::string::npos) << missing;
}

// ------------------------------------------------------------------ LoRA files

torch::Tensor q_forward_with(const std::string& lora, double scale) {
  const auto& ref = tensors(kTiny + "/forward.safetensors");
  std::map<std::string, torch::Tensor> inputs;
  for (const char* k : {"hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask",
                        "timestep", "img_shapes"}) {
    inputs[k] = ref.at(std::string("a.") + k);
  }
  return difftrain::families::family_of(kTiny)
      .forward_outputs(kTiny, inputs, "a", lora, scale)
      .at("out");
}

TEST(QwenImageLora, EveryLayoutAppliesAsQwenImageLoraLoaderMixinDoes) {
  const auto& expected = tensors(kQwenDir + "/lora/expected.safetensors");
  // peft_default: PEFT's raw adapter keys (`<module>.lora_A.default.weight`, no alpha: scale 1).
  for (const char* name : {"diffusers", "comfyui", "kohya", "extra_targets", "peft_default"}) {
    const std::string f = name;
    SCOPED_TRACE(f);
    const std::string path = kQwenDir + "/lora/" + f + ".safetensors";
    for (const auto& [scale, what] : {std::pair<double, std::string>{1.0, ".out"},
                                      std::pair<double, std::string>{0.5, ".fused_out"}}) {
      const auto out = q_forward_with(path, scale);
      const double diff = max_abs(out, expected.at(f + what));
      std::cout << f << what << " max abs diff " << diff << "\n";
      EXPECT_LT(diff, 2e-5) << f << what;
      // The LoRA matters: far from the base output.
      EXPECT_GT(max_abs(out, expected.at("base.out")), 5e-3) << f;
    }
  }
}

TEST(QwenImageLora, ConvertsBetweenLayoutsAndMergesIntoTheFolder) {
  namespace io = difftrain::io;
  namespace fam = difftrain::families;
  const auto& expected = tensors(kQwenDir + "/lora/expected.safetensors");
  const auto dir = difftrain::test::temp_dir("qwen_lora");
  const auto to_kohya = fam::convert_lora(kQwenDir + "/lora/comfyui.safetensors",
                                          dir + "/k.safetensors", io::LoraFormat::kKohya, kTiny);
  EXPECT_EQ(to_kohya.targets.at("transformer"), 8u);
  const auto kohya = io::load_safetensors(dir + "/k.safetensors").tensors;
  EXPECT_EQ(kohya.count("lora_unet_transformer_blocks_0_attn_to_out_0.lora_down.weight"), 1u);
  fam::convert_lora(dir + "/k.safetensors", dir + "/p.safetensors", io::LoraFormat::kPeft, kTiny);
  fam::convert_lora(dir + "/p.safetensors", dir + "/c.safetensors", io::LoraFormat::kComfyUI,
                    kTiny);
  const auto comfy = io::load_safetensors(dir + "/c.safetensors").tensors;
  EXPECT_EQ(comfy.count("diffusion_model.transformer_blocks.1.attn.to_v.lora_up.weight"), 1u);
  for (const char* f : {"/k.safetensors", "/p.safetensors", "/c.safetensors"}) {
    EXPECT_LT(max_abs(q_forward_with(dir + f, 1.0), expected.at("diffusers.out")), 2e-5) << f;
  }
  // lora merge: the folder's transformer with the LoRA fused at 0.5.
  difftrain::models::LoraFolderMergeOptions mo;
  mo.lora_scale = 0.5;
  fam::family_of(kTiny).merge_lora(kTiny, kQwenDir + "/lora/extra_targets.safetensors",
                                   dir + "/merged", mo);
  std::map<std::string, torch::Tensor> inputs;
  const auto& ref = tensors(kTiny + "/forward.safetensors");
  for (const char* k : {"hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask",
                        "timestep", "img_shapes"}) {
    inputs[k] = ref.at(std::string("a.") + k);
  }
  const auto merged =
      fam::family_of(dir + "/merged").forward_outputs(dir + "/merged", inputs, "a", "", 1.0);
  EXPECT_LT(max_abs(merged.at("out"), expected.at("extra_targets.fused_out")), 2e-5);
}

}  // namespace qwen_image_pipeline_test
