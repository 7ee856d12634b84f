// FLUX.1 LoRA layouts against the fixtures (tests/golden/flux/tiny_flux_lora): the Diffusers
// file, the same LoRA with per-module alphas and in kohya / BFL names (dense and block-sparse
// fused qkv) give every module the same delta; ComfyUI, XLabs and single-block linear1 files
// split as BFL fuses them; kohya files written here read back with their ranks and alphas; broken
// files are refused naming the key.

#include "difftrain/core/error.h"
#include "difftrain/families/flux/lora_layouts.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora.h"
#include "source_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdio>

namespace difftrain {
namespace {

using test::error_of;
using test::max_abs;

const std::string kFluxLoraFixture =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux_lora";
const std::string kFluxLoraModel =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";

// The tiny transformer: 2 double and 2 single blocks, D = 32, MLP 128.
families::flux::FluxLoraDims flux_tiny_dims() { return {2, 2, 32, 128}; }

// Every target's delta, by "<component>.<module>"; CLIP kohya names resolved against its weights.
std::map<std::string, torch::Tensor> flux_deltas(io::LoraWeights lora) {
  if (lora.count("text_encoder") > 0) {
    std::vector<std::string> names;
    for (const auto& [name, e] :
         io::read_safetensors_header(kFluxLoraModel + "/text_encoder/model.safetensors").tensors) {
      (void)e;
      if (name.size() > 7 && name.compare(name.size() - 7, 7, ".weight") == 0) {
        names.push_back(name.substr(0, name.size() - 7));
      }
    }
    io::resolve_kohya_names(lora, "text_encoder", names);
  }
  std::map<std::string, torch::Tensor> out;
  for (const auto& [component, targets] : lora.components) {
    for (const auto& t : targets) {
      out[component + "." + t.module] = models::lora_delta(t).to(torch::kFloat64);
    }
  }
  return out;
}

double flux_max_delta_diff(const std::map<std::string, torch::Tensor>& a,
                           const std::map<std::string, torch::Tensor>& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [name, d] : a) {
    const auto it = b.find(name);
    if (it == b.end()) {
      ADD_FAILURE() << name << " is missing";
      continue;
    }
    worst = std::max(worst, max_abs(d, it->second));
  }
  return worst;
}

TEST(FluxLora, TheThreeFixtureFilesGiveEveryModuleTheSameDelta) {
  const auto reference = flux_deltas(families::flux::read_flux_lora(
      kFluxLoraFixture + "/pytorch_lora_weights.safetensors", flux_tiny_dims()));
  EXPECT_EQ(reference.size(), 44u);  // 32 transformer + 12 CLIP modules
  for (const char* file : {"diffusers_alpha_lora.safetensors", "kohya_flux_lora.safetensors"}) {
    SCOPED_TRACE(file);
    const auto lora =
        families::flux::read_flux_lora(kFluxLoraFixture + "/" + file, flux_tiny_dims());
    EXPECT_EQ(lora.count("transformer"), 32u);
    EXPECT_EQ(lora.count("text_encoder"), 12u);
    EXPECT_EQ(lora.count("unet"), 0u);
    const double d = flux_max_delta_diff(flux_deltas(lora), reference);
    std::printf("%s: max delta difference %.3g (limit 1e-5)\n", file, d);
    EXPECT_LE(d, 1e-5);
  }
  // The kohya file's txt qkv is block-sparse (rank 12 stacked): split back into rank-4 LoRAs with
  // scale alpha / 12; its img qkv is dense (one shared down, rank 4).
  const auto kohya = families::flux::read_flux_lora(
      kFluxLoraFixture + "/kohya_flux_lora.safetensors", flux_tiny_dims());
  for (const auto& t : kohya.targets("transformer")) {
    if (t.module == "transformer_blocks.0.attn.add_k_proj") {
      EXPECT_EQ(t.rank(), 4);
      EXPECT_NEAR(t.scale(), 24.0 / 12.0, 1e-12);
    }
    if (t.module == "transformer_blocks.0.attn.to_k") {
      EXPECT_EQ(t.rank(), 4);
    }
  }
}

// A kohya-style file's tensors for one BFL module.
void flux_put(std::map<std::string, torch::Tensor>& m, const std::string& stem,
              const torch::Tensor& down, const torch::Tensor& up, double alpha) {
  m[stem + ".lora_down.weight"] = down;
  m[stem + ".lora_up.weight"] = up;
  m[stem + ".alpha"] = torch::tensor(static_cast<float>(alpha));
}

TEST(FluxLora, Linear1ComfyUiAndXlabsFilesSplitAsBflFusesThem) {
  torch::manual_seed(3);
  const auto dims = flux_tiny_dims();
  const int64_t D = dims.inner_dim;
  // single_blocks_1_linear1 at this width: q, k, v, proj_mlp rows 32, 32, 32, 128.
  std::map<std::string, torch::Tensor> kohya;
  const torch::Tensor down = torch::randn({4, D}), up = torch::randn({3 * D + 4 * D, 4});
  flux_put(kohya, "lora_unet_single_blocks_1_linear1", down, up, 2.0);
  io::LoraWeights lora = io::parse_lora(kohya, "linear1.safetensors");
  families::flux::convert_flux_lora(lora, dims);
  const auto deltas = flux_deltas(lora);
  const torch::Tensor full = (up.matmul(down) * 0.5).to(torch::kFloat64);
  EXPECT_LE(
      max_abs(deltas.at("transformer.single_transformer_blocks.1.attn.to_k"), full.narrow(0, D, D)),
      1e-6);
  EXPECT_LE(max_abs(deltas.at("transformer.single_transformer_blocks.1.proj_mlp"),
                    full.narrow(0, 3 * D, 4 * D)),
            1e-6);

  // ComfyUI: diffusion_model.<BFL module> with lora_A / lora_B, read by read_lora.
  const std::string dir = test::temp_dir("flux_lora_forms");
  std::map<std::string, torch::Tensor> comfy = {
      {"diffusion_model.single_blocks.1.linear1.lora_A.weight", down},
      {"diffusion_model.single_blocks.1.linear1.lora_B.weight", up},
      {"diffusion_model.single_blocks.1.linear1.alpha", torch::tensor(2.0F)}};
  io::save_safetensors(dir + "/comfy.safetensors", comfy);
  const auto c = flux_deltas(families::flux::read_flux_lora(dir + "/comfy.safetensors", dims));
  EXPECT_LE(flux_max_delta_diff(c, deltas), 1e-9);

  // XLabs: processor.qkv_lora1 (img q/k/v, shared down) and proj_lora2 (txt out), scale 1.
  const torch::Tensor xd = torch::randn({2, D}), xu = torch::randn({3 * D, 2});
  const torch::Tensor pd = torch::randn({2, D}), pu = torch::randn({D, 2});
  std::map<std::string, torch::Tensor> xlabs = {
      {"double_blocks.0.processor.qkv_lora1.down.weight", xd},
      {"double_blocks.0.processor.qkv_lora1.up.weight", xu},
      {"double_blocks.0.processor.proj_lora2.down.weight", pd},
      {"double_blocks.0.processor.proj_lora2.up.weight", pu}};
  io::save_safetensors(dir + "/xlabs.safetensors", xlabs);
  const auto x = flux_deltas(families::flux::read_flux_lora(dir + "/xlabs.safetensors", dims));
  ASSERT_EQ(x.size(), 4u);
  EXPECT_LE(max_abs(x.at("transformer.transformer_blocks.0.attn.to_v"),
                    xu.narrow(0, 2 * D, D).matmul(xd).to(torch::kFloat64)),
            1e-6);
  EXPECT_LE(max_abs(x.at("transformer.transformer_blocks.0.attn.to_add_out"),
                    pu.matmul(pd).to(torch::kFloat64)),
            1e-6);
}

TEST(FluxLora, AnUnprefixedPeftAdapterIsTheTransformers) {
  // PEFT's adapter_model.safetensors of the transformer alone: base_model.model.<module>, no
  // "transformer." component prefix.
  const auto all =
      io::load_safetensors(kFluxLoraFixture + "/pytorch_lora_weights.safetensors").tensors;
  std::map<std::string, torch::Tensor> bare;
  for (const auto& [key, t] : all) {
    const std::string head = "transformer.";
    if (key.rfind(head, 0) == 0) bare["base_model.model." + key.substr(head.size())] = t;
  }
  io::LoraWeights lora = io::parse_lora(bare, "adapter_model.safetensors");
  families::flux::convert_flux_lora(lora, flux_tiny_dims());
  EXPECT_EQ(lora.count("transformer"), 32u);
  EXPECT_EQ(lora.count("unet"), 0u);
}

TEST(FluxLora, KohyaFilesWrittenHereReadBackWithRanksAlphasAndDeltas) {
  const auto dims = flux_tiny_dims();
  for (const char* file :
       {"pytorch_lora_weights.safetensors", "diffusers_alpha_lora.safetensors"}) {
    SCOPED_TRACE(file);
    const auto lora = families::flux::read_flux_lora(kFluxLoraFixture + "/" + file, dims);
    const std::string out = test::temp_dir("flux_lora_write") + "/kohya.safetensors";
    io::write_lora(out, families::flux::flux_lora_to_bfl(lora), io::LoraFormat::kKohya);
    const auto header = io::read_safetensors_header(out);
    EXPECT_EQ(header.tensors.count("lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"), 1u);
    EXPECT_EQ(header.tensors.count("lora_unet_single_blocks_1_modulation_lin.alpha"), 1u);
    const auto back = families::flux::read_flux_lora(out, dims);
    const double d = flux_max_delta_diff(flux_deltas(back), flux_deltas(lora));
    std::printf("%s -> kohya -> read: max delta difference %.3g (limit 1e-5)\n", file, d);
    EXPECT_LE(d, 1e-5);
    for (const auto& t : back.targets("transformer")) EXPECT_EQ(t.rank(), 4) << t.module;
    // CLIP as sd-scripts' lora_flux names it, lora_te1_ (issue 56: Diffusers' FLUX loader
    // refuses lora_te_), also without a transformer target and without the BFL conversion.
    size_t te1 = 0;
    for (const auto& [key, e] : header.tensors) {
      (void)e;
      EXPECT_NE(key.rfind("lora_te_", 0), 0u) << key;
      te1 += key.rfind("lora_te1_text_model_", 0) == 0 ? 1 : 0;
    }
    EXPECT_EQ(te1, 3 * lora.count("text_encoder")) << "down, up and alpha of each CLIP target";
    auto clip_only = lora;
    clip_only.components.erase("transformer");
    const std::string clip_out = test::temp_dir("flux_lora_clip") + "/clip.safetensors";
    io::write_lora(clip_out, families::flux::flux_lora_to_bfl(clip_only), io::LoraFormat::kKohya);
    for (const auto& [key, e] : io::read_safetensors_header(clip_out).tensors) {
      (void)e;
      EXPECT_EQ(key.rfind("lora_te1_", 0), 0u) << key;
    }
    io::write_lora(clip_out, lora, io::LoraFormat::kKohya);  // "transformer": FLUX numbering too
    EXPECT_EQ(io::read_safetensors_header(clip_out).tensors.count(
                  "lora_te1_text_model_encoder_layers_0_mlp_fc1.lora_down.weight"),
              1u);
    // Diffusers / PEFT round trips of the converted LoRA.
    for (auto format : {io::LoraFormat::kDiffusers, io::LoraFormat::kPeft}) {
      const std::string p = test::temp_dir("flux_lora_write2") + "/lora.safetensors";
      io::write_lora(p, lora, format);
      EXPECT_LE(flux_max_delta_diff(flux_deltas(families::flux::read_flux_lora(p, dims)),
                                    flux_deltas(lora)),
                1e-5);
    }
  }
}

TEST(FluxLora, BrokenFilesAreRefusedNamingTheKey) {
  const auto dims = flux_tiny_dims();
  std::map<std::string, torch::Tensor> beyond;
  flux_put(beyond, "lora_unet_double_blocks_7_img_attn_proj", torch::randn({4, 32}),
           torch::randn({32, 4}), 4);
  io::LoraWeights a = io::parse_lora(beyond, "beyond.safetensors");
  std::string msg = error_of([&] { families::flux::convert_flux_lora(a, dims); });
  EXPECT_NE(msg.find("double block 7 is beyond the model's 2"), std::string::npos) << msg;
  std::map<std::string, torch::Tensor> rows;
  flux_put(rows, "lora_unet_double_blocks_0_img_attn_qkv", torch::randn({4, 32}),
           torch::randn({90, 4}), 4);
  io::LoraWeights b = io::parse_lora(rows, "rows.safetensors");
  msg = error_of([&] { families::flux::convert_flux_lora(b, dims); });
  EXPECT_NE(msg.find("lora_unet_double_blocks_0_img_attn_qkv"), std::string::npos) << msg;
  EXPECT_NE(msg.find("90 rows"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

}  // namespace
}  // namespace difftrain
