// SDXL LoRA files against the Diffusers/PEFT reference (tests/golden/sdxl/tiny_sdxl_lora and
// tiny_sdxl_lora_peft): Diffusers/PEFT keys with text_encoder_2, kohya's SGM-named SDXL layout,
// merged into all three models and into text-to-image, and written back in every format.

#include "difftrain/families/stable_diffusion/pipeline.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/lora/lora_folder.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/models/unets/sgm_names.h"
#include "difftrain/models/unets/unet.h"
#include "sdxl_fixture.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace difftrain {
namespace {

using test::max_abs;

const std::string& kGolden = test::kSdxlGolden;
const std::string& kXl = test::kTinySdxl;
const std::string kLora = kGolden + "/tiny_sdxl_lora";
const std::string kPeft = kGolden + "/tiny_sdxl_lora_peft";

struct XlModels {
  models::ClipTextModel te1{nullptr}, te2{nullptr};
  models::UNet unet{nullptr};
};

XlModels load_models() {
  XlModels m;
  m.te1 = models::load_clip_text_model(kXl + "/text_encoder");
  m.te2 = models::load_clip_text_model(kXl + "/text_encoder_2");
  m.unet = models::load_unet(kXl + "/unet");
  m.te1->eval();
  m.te2->eval();
  m.unet->eval();
  return m;
}

// Per-component scales: {"unet": s, "text_encoder": s, "text_encoder_2": s}.
void merge_all(XlModels& m, const io::LoraWeights& lora,
               const std::map<std::string, double>& scales = {}) {
  auto scale = [&](const std::string& c) {
    auto it = scales.find(c);
    return it == scales.end() ? 1.0 : it->second;
  };
  EXPECT_GT(models::merge_lora(*m.unet, lora, scale("unet"), "unet").modules_merged, 0);
  EXPECT_GT(models::merge_lora(*m.te1, lora, scale("text_encoder"), "text_encoder").modules_merged,
            0);
  EXPECT_GT(
      models::merge_lora(*m.te2, lora, scale("text_encoder_2"), "text_encoder_2").modules_merged,
      0);
}

struct Outputs {
  torch::Tensor te1_penultimate, te2_penultimate, te2_text_embeds, unet_out;
  torch::Tensor te1_last, te1_pooled, te2_last, te2_pooled;
};

Outputs run_models(XlModels& m, const torch::Tensor& ids1, const torch::Tensor& ids2,
                   const std::map<std::string, torch::Tensor>& unet_in, const std::string& prefix) {
  torch::NoGradGuard no_grad;
  Outputs o;
  auto a = m.te1->forward(ids1, 0, true);
  o.te1_penultimate = a.hidden_states[a.hidden_states.size() - 2];
  o.te1_last = a.last_hidden_state;
  o.te1_pooled = a.pooler_output;
  auto b = m.te2->forward(ids2, 0, true);
  o.te2_penultimate = b.hidden_states[b.hidden_states.size() - 2];
  o.te2_last = b.last_hidden_state;
  o.te2_pooled = b.pooler_output;
  o.te2_text_embeds = b.text_embeds;
  models::UNetConditioning cond;
  cond.encoder_hidden_states = unet_in.at(prefix + "encoder_hidden_states");
  cond.text_embeds = unet_in.at(prefix + "text_embeds");
  cond.time_ids = unet_in.at(prefix + "time_ids");
  o.unet_out =
      m.unet->forward(unet_in.at(prefix + "sample"), unet_in.at(prefix + "timestep"), cond);
  return o;
}

// tiny_sdxl_lora/lora_io.safetensors.
void expect_lora_io(const Outputs& o) {
  auto io = io::load_safetensors(kLora + "/lora_io.safetensors").tensors;
  EXPECT_LE(max_abs(o.te1_penultimate, io.at("te1_penultimate_hidden_state")), 1e-4);
  EXPECT_LE(max_abs(o.te2_penultimate, io.at("te2_penultimate_hidden_state")), 1e-4);
  EXPECT_LE(max_abs(o.te2_text_embeds, io.at("te2_text_embeds")), 1e-4);
  EXPECT_LE(max_abs(o.unet_out, io.at("unet_out")), 1e-4);
}

Outputs run_lora_io_inputs(XlModels& m) {
  auto io = io::load_safetensors(kLora + "/lora_io.safetensors").tensors;
  return run_models(m, io.at("te1_input_ids"), io.at("te2_input_ids"), io, "unet_");
}

TEST(SdxlLora, DiffusersFileMatchesTheReference) {
  auto lora = io::read_lora(kLora + "/pytorch_lora_weights.safetensors");
  EXPECT_EQ(lora.count("text_encoder_2"), 3u * 6u);  // 6 linears x 3 layers
  auto m = load_models();
  merge_all(m, lora);
  expect_lora_io(run_lora_io_inputs(m));
}

TEST(SdxlLora, KohyaSgmFileMatchesTheReference) {
  auto lora = io::read_lora(kLora + "/kohya_sgm_lora.safetensors");
  EXPECT_EQ(lora.format, io::LoraFormat::kKohya);
  auto m = load_models();
  merge_all(m, lora);
  expect_lora_io(run_lora_io_inputs(m));
}

TEST(SdxlLora, SgmNamesFollowTheReferenceTable) {
  auto cfg = test::read_json(kPeft + "/lora_config.json");
  auto unet = models::load_unet(kXl + "/unet");
  size_t checked = 0;
  for (const auto& [diffusers, name] : cfg["kohya_names"].items()) {
    const std::string kohya = name.get<std::string>();
    if (diffusers.rfind("unet.", 0) != 0) continue;
    const std::string sgm = models::sgm_module_name(unet->config(), diffusers.substr(5));
    EXPECT_EQ("lora_unet_" + io::kohya_name(sgm), kohya) << diffusers;
    ++checked;
  }
  EXPECT_EQ(checked, 120u);
  // The rest of the table on this config: every module with an SGM name has its own, and the
  // known corners.
  const auto& c = unet->config();
  EXPECT_EQ(models::sgm_module_name(c, "conv_in"), "input_blocks.0.0");
  EXPECT_EQ(models::sgm_module_name(c, "down_blocks.0.resnets.1.conv1"),
            "input_blocks.2.0.in_layers.2");
  EXPECT_EQ(models::sgm_module_name(c, "down_blocks.0.downsamplers.0.conv"), "input_blocks.3.0.op");
  EXPECT_EQ(models::sgm_module_name(c, "down_blocks.1.resnets.0.conv_shortcut"),
            "input_blocks.4.0.skip_connection");
  EXPECT_EQ(models::sgm_module_name(c, "mid_block.resnets.1.time_emb_proj"),
            "middle_block.2.emb_layers.1");
  EXPECT_EQ(models::sgm_module_name(c, "up_blocks.0.upsamplers.0.conv"), "output_blocks.2.2.conv");
  EXPECT_EQ(models::sgm_module_name(c, "up_blocks.1.resnets.2.conv2"),
            "output_blocks.5.0.out_layers.3");
  EXPECT_EQ(models::sgm_module_name(c, "add_embedding.linear_2"), "label_emb.0.2");
  EXPECT_EQ(models::sgm_module_name(c, "conv_out"), "out.2");
  EXPECT_EQ(models::sgm_module_name(c, "down_blocks.7.resnets.0.conv1"), "");
  const auto names = models::lora_module_names(*unet);
  const auto aliases = models::sgm_aliases(c, names);
  std::set<std::string> targets;
  for (const auto& [sgm, m] : aliases) EXPECT_TRUE(targets.insert(m).second) << m;
  // Every conv and linear of the tiny UNet has an SGM name (norms inside blocks too).
  size_t unmapped = 0;
  for (const auto& n : names) unmapped += models::sgm_module_name(c, n).empty();
  EXPECT_EQ(unmapped, 0u);
}

TEST(SdxlLora, PeftFixtureWithItsScalesMatchesTheReference) {
  auto cfg = test::read_json(kPeft + "/lora_config.json");
  auto io = io::load_safetensors(kPeft + "/io.safetensors").tensors;
  const std::map<std::string, double> scales = {
      {"unet", cfg["unet"]["scale"].get<double>()},
      {"text_encoder", cfg["text_encoder"]["scale"].get<double>()},
      {"text_encoder_2", cfg["text_encoder_2"]["scale"].get<double>()}};
  auto check = [&](const Outputs& o) {
    EXPECT_LE(max_abs(o.te1_penultimate, io.at("text_encoder.penultimate_hidden_state")), 1e-4);
    EXPECT_LE(max_abs(o.te2_penultimate, io.at("text_encoder_2.penultimate_hidden_state")), 1e-4);
    EXPECT_LE(max_abs(o.te2_text_embeds, io.at("text_encoder_2.text_embeds")), 1e-4);
    EXPECT_LE(max_abs(o.unet_out, io.at("unet.out")), 1e-4);
    EXPECT_LE(max_abs(o.te1_last, io.at("text_encoder.last_hidden_state")), 1e-4);
    EXPECT_LE(max_abs(o.te1_pooled, io.at("text_encoder.pooler_output")), 1e-4);
    EXPECT_LE(max_abs(o.te2_last, io.at("text_encoder_2.last_hidden_state")), 1e-4);
    EXPECT_LE(max_abs(o.te2_pooled, io.at("text_encoder_2.pooler_output")), 1e-4);
  };
  {
    // Diffusers' mixed-key file (lora.down/up, lora_A/B, lora_linear_layer) holds no alpha:
    // the scales come from lora_config.json.
    auto lora = io::read_lora(kPeft + "/pytorch_lora_weights.safetensors");
    EXPECT_TRUE(lora.mixed);
    auto m = load_models();
    merge_all(m, lora, scales);
    check(run_models(m, io.at("text_encoder.input_ids"), io.at("text_encoder_2.input_ids"), io,
                     "unet."));
  }
  {
    // The kohya file carries its alphas (8, 3, 2): scale 1 from the caller.
    auto lora = io::read_lora(kPeft + "/kohya_sdxl_lora.safetensors");
    auto m = load_models();
    merge_all(m, lora);
    check(run_models(m, io.at("text_encoder.input_ids"), io.at("text_encoder_2.input_ids"), io,
                     "unet."));
  }
}

TEST(SdxlLora, EveryWrittenFormatReloadsToTheSameModels) {
  auto lora = io::read_lora(kLora + "/pytorch_lora_weights.safetensors");
  auto unet_cfg = models::load_unet(kXl + "/unet")->config();
  const std::string dir = test::temp_dir("sdxl_lora_formats");
  for (auto format : {io::LoraFormat::kDiffusers, io::LoraFormat::kPeft, io::LoraFormat::kKohya}) {
    const std::string path = dir + "/" + io::to_string(format) + ".safetensors";
    // kohya's SDXL layout names the UNet's modules in SGM form, text encoders lora_te1_/lora_te2_.
    io::write_lora(
        path, format == io::LoraFormat::kKohya ? models::with_sgm_unet_names(lora, unet_cfg) : lora,
        format);
    auto tensors = io::load_safetensors(path).tensors;
    if (format == io::LoraFormat::kKohya) {
      EXPECT_TRUE(tensors.count(
          "lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q.lora_down.weight"));
      EXPECT_TRUE(tensors.count("lora_te1_text_model_encoder_layers_0_self_attn_q_proj.alpha"));
      EXPECT_TRUE(tensors.count("lora_te2_text_model_encoder_layers_2_mlp_fc2.lora_up.weight"));
    } else {
      EXPECT_TRUE(tensors.count("text_encoder_2.text_model.encoder.layers.2.mlp.fc2." +
                                std::string(format == io::LoraFormat::kPeft
                                                ? "lora_A.weight"
                                                : "lora_linear_layer.down.weight")));
    }
    auto m = load_models();
    merge_all(m, io::read_lora(path));
    expect_lora_io(run_lora_io_inputs(m));
  }
}

TEST(SdxlLora, Txt2ImgWithEitherFileMatchesDiffusers) {
  auto ref = io::load_safetensors(kLora + "/txt2img_lora_seed42.safetensors").tensors;
  for (const char* file : {"pytorch_lora_weights.safetensors", "kohya_sgm_lora.safetensors"}) {
    families::stable_diffusion::StableDiffusionLoadOptions lo;
    lo.lora = kLora + "/" + file;
    auto sd = families::stable_diffusion::load_stable_diffusion(kXl, lo);
    auto out = families::stable_diffusion::text_to_image(sd, test::sdxl_fixture_call());
    const double scale = ref.at("latents_final").abs().max().item<double>();
    EXPECT_LE(max_abs(out.latents, ref.at("latents_final")), 1e-4 * scale) << file;
    EXPECT_LE(max_abs(out.images, ref.at("images")), 1e-4) << file;
    EXPECT_LE(max_abs(out.prompt_embeds,
                      torch::cat({ref.at("negative_prompt_embeds"), ref.at("prompt_embeds")})),
              1e-4)
        << file;
  }
}

TEST(SdxlLora, MergedFolderSamplesAsTheUnmergedLora) {
  // `difftrain lora merge` on an SDXL folder with the kohya SGM file: UNet and both encoders.
  const std::string out = test::temp_dir("sdxl_lora_merge") + "/merged";
  const auto summary =
      models::merge_lora_into_folder(kXl, kLora + "/kohya_sgm_lora.safetensors", out);
  EXPECT_EQ(summary.modules_merged, 132);  // 162 layers, 30 of them in the encoders
  EXPECT_EQ(summary.text_encoder_modules_merged, 2 * 6 + 3 * 6);
  EXPECT_TRUE(summary.skipped_components.empty());
  auto ref = io::load_safetensors(kLora + "/txt2img_lora_seed42.safetensors").tensors;
  auto sd = families::stable_diffusion::load_stable_diffusion(out);
  auto merged = families::stable_diffusion::text_to_image(sd, test::sdxl_fixture_call());
  const double scale = ref.at("latents_final").abs().max().item<double>();
  EXPECT_LE(max_abs(merged.latents, ref.at("latents_final")), 1e-4 * scale);
  EXPECT_LE(max_abs(merged.images, ref.at("images")), 1e-4);
  // The encoders' files keep every tensor name of the input.
  for (const char* te : {"text_encoder", "text_encoder_2"}) {
    auto a = io::load_safetensors(kXl + "/" + te + "/model.safetensors").tensors;
    auto b = io::load_safetensors(out + "/" + te + "/model.safetensors").tensors;
    EXPECT_EQ(a.size(), b.size()) << te;
    EXPECT_GT(max_abs(a.at("text_model.encoder.layers.0.self_attn.q_proj.weight"),
                      b.at("text_model.encoder.layers.0.self_attn.q_proj.weight")),
              0.0);
  }
}

}  // namespace
}  // namespace difftrain
