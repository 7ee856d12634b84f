// The Z-Image family through its registry entry, as `difftrain sample`, `forward`, `lora convert`
// and `lora merge` run it, against Diffusers' own code (tests/golden/z_image/README.md):
// ZImagePipeline.__call__ from prompt strings (sample_e2e, make_sample_e2e.py: the chat
// template, Qwen3's hidden_states[-2] at the real tokens, CFG with a given and a default
// negative prompt, truncation to max_sequence_length), the transformer's list forward, and the
// LoRA layouts ZImageLoraLoaderMixin reads (lora/, make_lora.py), unfused and fused.
#include "difftrain/core/error.h"
#include "difftrain/families/family.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/transformers/z_image_transformer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace {

namespace fs = std::filesystem;
using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::max_abs;
using difftrain::test::read_json;
namespace families = difftrain::families;
namespace io = difftrain::io;

const std::string kZFolder = kGoldenDir + "z_image/tiny_z_image";
const std::string kZLora = kGoldenDir + "z_image/lora/";

difftrain::diffusion::GenerateRequest z_request(const nlohmann::json& args) {
  difftrain::diffusion::GenerateRequest r;
  r.prompts = args.at("prompt").get<std::vector<std::string>>();
  if (args.contains("negative_prompt") && args.at("negative_prompt").is_string()) {
    r.negative_prompts = {args.at("negative_prompt").get<std::string>()};
  }
  r.guidance_scale = args.at("guidance_scale").get<double>();
  r.options["cfg_normalization"] = args.value("cfg_normalization", false) ? 1.0 : 0.0;
  r.options["cfg_truncation"] = args.value("cfg_truncation", 1.0);
  r.num_images = args.at("num_images_per_prompt").get<int64_t>();
  r.num_inference_steps = args.at("num_inference_steps").get<int64_t>();
  r.height = args.at("height").get<int64_t>();
  r.width = args.at("width").get<int64_t>();
  r.seed = args.at("seed").get<uint64_t>();
  r.max_sequence_length = args.at("max_sequence_length").get<int64_t>();
  return r;
}

TEST(ZImageFamily, FoldersAreRecognisedByPipelineAndModelClass) {
  EXPECT_EQ(families::family_of(kZFolder).name(), "z-image");
  EXPECT_EQ(families::family_of(kZFolder + "/transformer").name(), "z-image");
  // An index without _class_name: a transformer with a Qwen3 text encoder.
  const auto dir = difftrain::test::temp_dir("z_index");
  auto index = read_json(kZFolder + "/model_index.json");
  index.erase("_class_name");
  difftrain::test::write_text(dir + "/model_index.json", index.dump());
  EXPECT_EQ(families::family_of(dir).name(), "z-image");
}

TEST(ZImageFamily, SampleFromPromptsEqualsZImagePipeline) {
  const auto ref = io::load_safetensors(kZFolder + "/sample_e2e.safetensors").tensors;
  const auto cases = read_json(kZFolder + "/sample_e2e.json").at("cases");
  const auto& family = families::family_of(kZFolder);
  auto pipe = family.load_pipeline(kZFolder, {});
  EXPECT_EQ(pipe->class_name(), "ZImagePipeline");
  for (const char* name : {"turbo", "cfg", "cfg_default_negative", "truncated"}) {
    const std::string k = name;
    const auto r = z_request(cases.at(k).at("arguments"));
    int64_t steps = 0;
    auto req = r;
    req.on_step = [&](int64_t i, int64_t) { steps = i; };
    const auto out = pipe->generate(req);
    EXPECT_EQ(steps, r.num_inference_steps) << k;
    // Each image's prompt embeddings: the fixture's per prompt, zero-padded to the longest.
    const int64_t per = r.num_images;
    for (size_t j = 0; j < r.prompts.size(); ++j) {
      const auto& e = ref.at(k + ".prompt_embeds." + std::to_string(j));
      for (int64_t c = 0; c < per; ++c) {
        const auto row = out.prompt_embeds[static_cast<int64_t>(j) * per + c];
        EXPECT_LT(max_abs(row.narrow(0, 0, e.size(0)), e), 1e-5) << k << " prompt " << j;
        if (row.size(0) > e.size(0)) {
          EXPECT_EQ(row.narrow(0, e.size(0), row.size(0) - e.size(0)).abs().max().item<float>(),
                    0.0f);
        }
      }
    }
    const double latents = max_abs(out.latents, ref.at(k + ".latents"));
    const double images = max_abs(out.images, ref.at(k + ".image"));
    std::printf("%s: latents %.3g, images %.3g (tol 1e-4)\n", name, latents, images);
    EXPECT_LT(latents, 1e-4) << k;
    EXPECT_LT(images, 1e-4) << k;
  }
  // The same images one by one with seed + i (the trainer's validation seeding) differ from the
  // batch's but the first equals a batch of one with that seed.
  auto one = z_request(cases.at("turbo").at("arguments"));
  one.prompts = {one.prompts[0]};
  const auto batch_of_one = pipe->generate(one);
  one.seeding = difftrain::diffusion::Seeding::kPerImage;
  const auto per_image = pipe->generate(one);
  EXPECT_EQ(max_abs(per_image.images, batch_of_one.images), 0.0);
}

TEST(ZImageFamily, SizesNotDivisibleBy16AndBadRequestsAreRefused) {
  auto pipe = families::family_of(kZFolder).load_pipeline(kZFolder, {});
  const auto cases = read_json(kZFolder + "/pipeline_cases.json").at("cases");
  difftrain::diffusion::GenerateRequest r;
  r.prompts = {"a cat"};
  r.num_inference_steps = 1;
  r.height = cases.at("bad_height").at("arguments").at("height").get<int64_t>();  // 50
  r.width = 32;
  auto msg = error_of([&] { pipe->generate(r); });
  EXPECT_HAS(msg, "--height 50 must be a positive multiple of 16");
  EXPECT_HAS(msg, "does not round");
  EXPECT_HAS(msg, "try 48");
  r.height = 32;
  r.width = 8;
  EXPECT_HAS(error_of([&] { pipe->generate(r); }), "--width 8 must be a positive multiple of 16");
  r.width = 32;
  r.negative_prompts = {"a", "b"};
  EXPECT_HAS(error_of([&] { pipe->generate(r); }), "got 2 --negative_prompt for 1 prompts");
  r.negative_prompts.clear();
  r.guidance_scale = -1;
  EXPECT_HAS(error_of([&] { pipe->generate(r); }), "--guidance_scale -1 must be >= 0");
  // A folder without its tokenizer names what is missing.
  const auto broken = difftrain::test::temp_dir("z_no_tokenizer");
  for (const char* part : {"model_index.json", "transformer", "vae", "scheduler", "text_encoder"}) {
    fs::create_symlink(fs::canonical(kZFolder + "/" + part), broken + "/" + part);
  }
  msg = error_of([&] { families::family_of(broken).load_pipeline(broken, {}); });
  EXPECT_HAS(msg, "tokenizer");
  EXPECT_HAS(msg, "no such folder");
}

TEST(ZImageFamily, ForwardOutputsAreTheTransformersListOutputs) {
  const auto ref = io::load_safetensors(kZFolder + "/forward.safetensors").tensors;
  for (const char* name : {"a", "b", "c"}) {
    const std::string k = name;
    std::map<std::string, torch::Tensor> inputs;
    for (const auto& [key, t] : ref) {
      if (key.rfind(k + ".", 0) == 0 && key.find(".out.") == std::string::npos &&
          key.find(".inter.") == std::string::npos) {
        inputs[key.substr(k.size() + 1)] = t;
      }
    }
    for (const std::string& dir : {kZFolder, kZFolder + "/transformer"}) {
      const auto out =
          families::family_of(dir).forward_outputs(dir, inputs, "forward.safetensors", "", 1.0);
      size_t n = 0;
      for (; ref.count(k + ".out." + std::to_string(n)) > 0; ++n) {
        const std::string o = "out." + std::to_string(n);
        ASSERT_EQ(out.count(o), 1u) << k;
        EXPECT_LT(max_abs(out.at(o), ref.at(k + "." + o)), 1e-5) << k << " " << o;
      }
      EXPECT_EQ(out.size(), n) << k;
    }
  }
  std::map<std::string, torch::Tensor> missing = {{"x.0", torch::zeros({16, 1, 4, 4})},
                                                  {"t", torch::zeros({1})}};
  const auto& family = families::family_of(kZFolder);
  auto msg = error_of([&] { family.forward_outputs(kZFolder, missing, "in.st", "", 1.0); });
  EXPECT_HAS(msg, "in.st: sample 0 has x.0 but no cap_feats.0");
  missing["cap_feats.0"] = torch::zeros({3, 48});
  missing["t"] = torch::zeros({2});
  EXPECT_HAS(error_of([&] { family.forward_outputs(kZFolder, missing, "in.st", "", 1.0); }),
             "'t' is [2]; expected [1], one per sample");
}

// Case a of forward.safetensors through the transformer with `lora` merged at `scale`.
std::vector<torch::Tensor> z_forward_with(const std::string& lora, double scale) {
  const auto ref = io::load_safetensors(kZFolder + "/forward.safetensors").tensors;
  std::map<std::string, torch::Tensor> inputs = {{"x.0", ref.at("a.x.0")},
                                                 {"x.1", ref.at("a.x.1")},
                                                 {"t", ref.at("a.t")},
                                                 {"cap_feats.0", ref.at("a.cap_feats.0")},
                                                 {"cap_feats.1", ref.at("a.cap_feats.1")}};
  const auto out =
      families::family_of(kZFolder).forward_outputs(kZFolder, inputs, "a", lora, scale);
  return {out.at("out.0"), out.at("out.1")};
}

TEST(ZImageFamily, LoraLayoutsApplyAsZImageLoraLoaderMixinDoes) {
  const auto expected = io::load_safetensors(kZLora + "expected.safetensors").tensors;
  for (const char* name : {"diffusers", "comfyui", "kohya", "extra_targets"}) {
    const std::string f = name;
    const std::string path = kZLora + f + ".safetensors";
    for (const auto& [scale, what] : {std::pair<double, std::string>{1.0, ".out."},
                                      std::pair<double, std::string>{0.5, ".fused_out."}}) {
      const auto out = z_forward_with(path, scale);
      for (size_t i = 0; i < 2; ++i) {
        const double diff = max_abs(out[i], expected.at(f + what + std::to_string(i)));
        EXPECT_LT(diff, 1e-5) << f << what << i;
        // The LoRA matters: far from the base output.
        EXPECT_GT(max_abs(out[i], expected.at("base.out." + std::to_string(i))), 0.05) << f;
      }
    }
  }
}

TEST(ZImageFamily, LoraConvertsBetweenLayoutsAndMergesIntoTheFolder) {
  const auto expected = io::load_safetensors(kZLora + "expected.safetensors").tensors;
  const auto dir = difftrain::test::temp_dir("z_lora");
  // ComfyUI -> kohya (lora_unet_ names, as musubi-tuner and Diffusers' converter take) -> PEFT:
  // every form gives the same outputs.
  const auto to_kohya = families::convert_lora(
      kZLora + "comfyui.safetensors", dir + "/k.safetensors", io::LoraFormat::kKohya, kZFolder);
  EXPECT_EQ(to_kohya.targets.at("transformer"), 16u);
  const auto kohya = io::load_safetensors(dir + "/k.safetensors").tensors;
  EXPECT_EQ(kohya.count("lora_unet_layers_0_attention_to_out_0.lora_down.weight"), 1u);
  EXPECT_EQ(kohya.count("lora_unet_noise_refiner_0_attention_to_q.alpha"), 1u);
  families::convert_lora(dir + "/k.safetensors", dir + "/p.safetensors", io::LoraFormat::kPeft,
                         kZFolder);
  const auto peft = io::load_safetensors(dir + "/p.safetensors").tensors;
  EXPECT_EQ(peft.count("transformer.context_refiner.0.attention.to_k.lora_A.weight"), 1u);
  const auto out = z_forward_with(dir + "/p.safetensors", 1.0);
  EXPECT_LT(max_abs(out[0], expected.at("diffusers.out.0")), 1e-5);
  // lora merge: the folder's transformer weights fused at 0.5 as Diffusers' fuse_lora.
  const std::string merged = dir + "/merged";
  difftrain::models::LoraFolderMergeOptions o;
  o.lora_scale = 0.5;
  const auto summary = families::family_of(kZFolder).merge_lora(
      kZFolder, kZLora + "extra_targets.safetensors", merged, o);
  EXPECT_EQ(summary.modules_merged, 10);
  const auto weights =
      io::load_safetensors(merged + "/transformer/diffusion_pytorch_model.safetensors").tensors;
  size_t checked = 0;
  for (const auto& [key, t] : expected) {
    const std::string prefix = "extra_targets.fused.";
    if (key.rfind(prefix, 0) != 0) continue;
    EXPECT_LT(max_abs(weights.at(key.substr(prefix.size())), t), 1e-6) << key;
    ++checked;
  }
  EXPECT_EQ(checked, 10u);
  EXPECT_EQ(families::family_of(merged).name(), "z-image");
  // Written in ComfyUI / musubi-tuner form: the very keys (and alphas) of the fixture's
  // comfyui.safetensors, which Diffusers' ZImageLoraLoaderMixin reads; read back, the same outputs.
  families::convert_lora(kZLora + "diffusers.safetensors", dir + "/c.safetensors",
                         io::LoraFormat::kComfyUI, kZFolder);
  const auto comfy = io::load_safetensors(dir + "/c.safetensors").tensors;
  const auto fixture = io::load_safetensors(kZLora + "comfyui.safetensors").tensors;
  ASSERT_EQ(comfy.size(), fixture.size());
  for (const auto& [key, t] : fixture) {
    ASSERT_EQ(comfy.count(key), 1u) << key;
    if (key.size() > 6 && key.compare(key.size() - 6, 6, ".alpha") == 0) {
      EXPECT_EQ(comfy.at(key).item<float>(), t.item<float>()) << key;
    }
  }
  EXPECT_LT(max_abs(z_forward_with(dir + "/c.safetensors", 1.0)[1], expected.at("diffusers.out.1")),
            1e-5);
  // A family whose ComfyUI names differ (FLUX.1's BFL blocks) is refused, with no file left.
  const auto flux_msg = error_of([&] {
    families::convert_lora(kGoldenDir + "flux/tiny_flux_lora/pytorch_lora_weights.safetensors",
                           dir + "/f.safetensors", io::LoraFormat::kComfyUI,
                           kGoldenDir + "flux/tiny_flux");
  });
  EXPECT_HAS(flux_msg, "--to comfyui: no registered family reads these modules back");
  EXPECT_FALSE(fs::exists(dir + "/f.safetensors"));
  // An SDXL LoRA is refused, naming the family it is for; no output is left.
  const std::string sdxl_lora = kGoldenDir + "sdxl/tiny_sdxl_lora/kohya_sgm_lora.safetensors";
  auto msg = error_of([&] { z_forward_with(sdxl_lora, 1.0); });
  EXPECT_HAS(msg, "has no transformer targets");
  EXPECT_HAS(msg, "it is a sdxl LoRA");
  msg = error_of(
      [&] { families::family_of(kZFolder).merge_lora(kZFolder, sdxl_lora, dir + "/m2", {}); });
  EXPECT_HAS(msg, "it is a sdxl LoRA");
  EXPECT_FALSE(fs::exists(dir + "/m2"));
}

}  // namespace
