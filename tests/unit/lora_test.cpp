// LoRA files: the three formats of the Diffusers fixture (the same LoRA, r = 4, alpha = 4) parse
// to the same updates; merge_lora adds exactly scale * up @ down to a module tree named like
// Diffusers' UNet; malformed files and mismatched models give one-line errors naming the problem.

#include "difftrain/models/lora/lora.h"
#include "difftrain/core/error.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"

#include "source_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <set>

namespace {

using difftrain::test::error_of;
using difftrain::test::max_abs;
using difftrain::test::temp_dir;

namespace fs = std::filesystem;
using difftrain::io::LoraFormat;
using difftrain::io::LoraTarget;
using difftrain::io::LoraWeights;
using difftrain::io::TensorMap;

const std::string kLora =
    std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/lora/";

// ---------------------------------------------------------------- a UNet-shaped module tree
// Registered names follow Diffusers' UNet2DConditionModel, so parameter names are its keys:
// down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0.weight and so on.

struct AttentionImpl : torch::nn::Module {
  AttentionImpl(int64_t dim, int64_t context_dim) {
    using torch::nn::LinearOptions;
    to_q = register_module("to_q", torch::nn::Linear(LinearOptions(dim, dim).bias(false)));
    to_k = register_module("to_k", torch::nn::Linear(LinearOptions(context_dim, dim).bias(false)));
    to_v = register_module("to_v", torch::nn::Linear(LinearOptions(context_dim, dim).bias(false)));
    to_out = register_module(
        "to_out", torch::nn::ModuleList(torch::nn::Linear(dim, dim), torch::nn::Dropout(0.0)));
  }
  torch::nn::Linear to_q{nullptr}, to_k{nullptr}, to_v{nullptr};
  torch::nn::ModuleList to_out{nullptr};
};
TORCH_MODULE(Attention);

struct TransformerBlockImpl : torch::nn::Module {
  TransformerBlockImpl(int64_t dim, int64_t context_dim) {
    norm1 = register_module("norm1", torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim})));
    attn1 = register_module("attn1", Attention(dim, dim));
    attn2 = register_module("attn2", Attention(dim, context_dim));
  }
  torch::nn::LayerNorm norm1{nullptr};
  Attention attn1{nullptr}, attn2{nullptr};
};
TORCH_MODULE(TransformerBlock);

struct Transformer2DImpl : torch::nn::Module {
  Transformer2DImpl(int64_t dim, int64_t context_dim) {
    proj_in = register_module("proj_in", torch::nn::Linear(dim, dim));
    transformer_blocks = register_module("transformer_blocks", torch::nn::ModuleList());
    transformer_blocks->push_back(TransformerBlock(dim, context_dim));
  }
  torch::nn::Linear proj_in{nullptr};
  torch::nn::ModuleList transformer_blocks{nullptr};
};
TORCH_MODULE(Transformer2D);

struct BlockImpl : torch::nn::Module {
  BlockImpl(int64_t dim, int64_t context_dim, int num_attentions) {
    attentions = register_module("attentions", torch::nn::ModuleList());
    for (int i = 0; i < num_attentions; ++i) attentions->push_back(Transformer2D(dim, context_dim));
  }
  torch::nn::ModuleList attentions{nullptr};
};
TORCH_MODULE(Block);

// The attention layers of tests/golden/diffusers/unet_cond: width 32 (64 in the middle), cross
// attention dim 32 (`context_dim` lets a test build a mismatched model).
struct TinyUNetImpl : torch::nn::Module {
  explicit TinyUNetImpl(int64_t context_dim = 32) {
    conv_in = register_module("conv_in", torch::nn::Conv2d(torch::nn::Conv2dOptions(4, 32, 3)));
    down_blocks = register_module("down_blocks", torch::nn::ModuleList(Block(32, context_dim, 1)));
    mid_block = register_module("mid_block", Block(64, context_dim, 1));
    up_blocks = register_module(
        "up_blocks", torch::nn::ModuleList(Block(32, context_dim, 0), Block(32, context_dim, 2)));
  }
  torch::nn::Conv2d conv_in{nullptr};
  torch::nn::ModuleList down_blocks{nullptr}, up_blocks{nullptr};
  Block mid_block{nullptr};
};
TORCH_MODULE(TinyUNet);

TensorMap snapshot(const torch::nn::Module& model) {
  TensorMap out;
  for (const auto& p : model.named_parameters()) out[p.key()] = p.value().detach().clone();
  return out;
}

LoraWeights read_fixture(const std::string& name) {
  return difftrain::io::read_lora(kLora + name + ".safetensors");
}

std::vector<std::string> module_names(const LoraWeights& lora) {
  std::vector<std::string> names;
  for (const auto& t : lora.targets("unet")) names.push_back(t.module);
  return names;
}

// ---------------------------------------------------------------- the fixture's three formats

TEST(LoraFormat, ParsesTheThreeFixtureFormats) {
  const auto diffusers = read_fixture("pytorch_lora_weights");
  const auto peft = read_fixture("peft_format");
  const auto kohya = read_fixture("kohya_format");
  EXPECT_EQ(diffusers.format, LoraFormat::kDiffusers);
  EXPECT_EQ(peft.format, LoraFormat::kPeft);
  EXPECT_EQ(kohya.format, LoraFormat::kKohya);
  // 4 attention blocks x 2 attentions x {to_q, to_k, to_v, to_out.0}.
  for (const auto* lora : {&diffusers, &peft, &kohya}) {
    EXPECT_EQ(lora->components.size(), 1u);
    EXPECT_EQ(lora->count("unet"), 32u);
    EXPECT_EQ(lora->count("text_encoder"), 0u);
    for (const auto& t : lora->targets("unet")) {
      EXPECT_EQ(t.rank(), 4);
      EXPECT_DOUBLE_EQ(t.scale(), 1.0);  // alpha 4 / r 4, or no alpha
      EXPECT_EQ(t.resolved, lora != &kohya);
    }
  }
  for (const auto& t : kohya.targets("unet")) EXPECT_EQ(t.alpha, std::optional<double>(4.0));
  for (const auto& t : diffusers.targets("unet")) EXPECT_FALSE(t.alpha.has_value());
  EXPECT_EQ(module_names(diffusers), module_names(peft));
  const auto& first = diffusers.targets("unet").front();
  EXPECT_EQ(first.module, "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k");
  EXPECT_EQ(first.key, "unet.down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_k.lora");
  EXPECT_EQ(kohya.targets("unet").front().module,
            "down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_k");
}

TEST(LoraFormat, ResolvesKohyaNamesAgainstModuleNames) {
  const auto diffusers = read_fixture("pytorch_lora_weights");
  auto kohya = read_fixture("kohya_format");
  auto names = module_names(diffusers);
  // Decoys: modules a UNet has that the LoRA does not target, including the to_out ModuleList
  // itself and names whose underscore forms are prefixes of targets.
  for (const char* decoy :
       {"conv_in", "down_blocks.0.attentions.0.proj_in",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out",
        "down_blocks.0.attentions.0.transformer_blocks.0.attn1", "mid_block.attentions.0.proj_out",
        "up_blocks.1.attentions.1.transformer_blocks.0.ff.net.0.proj", "time_embedding.linear_1"}) {
    names.insert(names.begin() + 3, decoy);
  }
  difftrain::io::resolve_kohya_names(kohya, "unet", names);
  EXPECT_EQ(module_names(kohya), module_names(diffusers));
  for (const auto& t : kohya.targets("unet")) EXPECT_TRUE(t.resolved);
  EXPECT_EQ(kohya.targets("unet").front().key,
            "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_k");
  EXPECT_EQ(
      difftrain::io::kohya_name("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0"),
      "down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_out_0");
}

TEST(LoraFormat, KohyaNameErrors) {
  auto kohya = read_fixture("kohya_format");
  auto lost = kohya;
  const auto msg = error_of([&] {
    difftrain::io::resolve_kohya_names(lost, "unet", {"conv_in", "mid_block.attentions.0.proj_in"});
  });
  EXPECT_HAS(msg, "kohya_format.safetensors");
  EXPECT_HAS(msg, "lora_unet_down_blocks_0_attentions_0_transformer_blocks_0_attn1_to_k");
  EXPECT_HAS(msg, "is this LoRA for a different model?");
  // Two modules whose underscore forms coincide cannot be told apart.
  auto names = module_names(read_fixture("pytorch_lora_weights"));
  names.push_back("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out_0");
  const auto ambiguous =
      error_of([&] { difftrain::io::resolve_kohya_names(kohya, "unet", names); });
  EXPECT_HAS(ambiguous, "ambiguous");
  EXPECT_HAS(ambiguous, "attn1.to_out_0");
}

TEST(LoraFormat, SameDeltaInEveryFormat) {
  const auto diffusers = read_fixture("pytorch_lora_weights");
  const auto peft = read_fixture("peft_format");
  auto kohya = read_fixture("kohya_format");
  difftrain::io::resolve_kohya_names(kohya, "unet", module_names(diffusers));
  ASSERT_EQ(diffusers.count("unet"), peft.count("unet"));
  ASSERT_EQ(diffusers.count("unet"), kohya.count("unet"));
  double worst = 0;
  for (size_t i = 0; i < diffusers.count("unet"); ++i) {
    const auto& d = diffusers.targets("unet")[i];
    ASSERT_EQ(peft.targets("unet")[i].module, d.module);
    ASSERT_EQ(kohya.targets("unet")[i].module, d.module);
    const auto ref = difftrain::models::lora_delta(d);
    EXPECT_EQ(ref.sizes(), (std::vector<int64_t>{d.up.size(0), d.down.size(1)}));
    worst = std::max(worst, max_abs(difftrain::models::lora_delta(peft.targets("unet")[i]), ref));
    worst = std::max(worst, max_abs(difftrain::models::lora_delta(kohya.targets("unet")[i]), ref));
  }
  std::printf("delta across formats: max |diff| %.3g over %zu modules (tol 1e-6)\n", worst,
              diffusers.count("unet"));
  EXPECT_LE(worst, 1e-6);
}

// ---------------------------------------------------------------- other key forms

TEST(LoraFormat, OlderDiffusersPeftPrefixesAndOtherComponents) {
  auto gen = at::detail::createCPUGenerator(3);
  auto w = [&](int64_t a, int64_t b) { return at::randn({a, b}, gen, torch::kFloat32); };
  const std::string attn = "down_blocks.0.attentions.0.transformer_blocks.0.attn1";
  // Diffusers' attention-processor form, plus text encoder keys in the same format.
  TensorMap legacy = {
      {"unet." + attn + ".processor.to_out_lora.down.weight", w(2, 32)},
      {"unet." + attn + ".processor.to_out_lora.up.weight", w(32, 2)},
      {"unet." + attn + ".processor.to_q_lora.down.weight", w(2, 32)},
      {"unet." + attn + ".processor.to_q_lora.up.weight", w(32, 2)},
      {"text_encoder.text_model.encoder.layers.0.self_attn.to_k_lora.down.weight", w(2, 8)},
      {"text_encoder.text_model.encoder.layers.0.self_attn.to_k_lora.up.weight", w(8, 2)},
      {"text_encoder.text_model.encoder.layers.1.mlp.fc1.lora_linear_layer.down.weight", w(2, 8)},
      {"text_encoder.text_model.encoder.layers.1.mlp.fc1.lora_linear_layer.up.weight", w(16, 2)},
  };
  const auto a = difftrain::io::parse_lora(legacy, "legacy.safetensors");
  EXPECT_EQ(a.format, LoraFormat::kDiffusers);
  EXPECT_EQ(module_names(a), (std::vector<std::string>{attn + ".to_out.0", attn + ".to_q"}));
  ASSERT_EQ(a.count("text_encoder"), 2u);
  EXPECT_EQ(a.targets("text_encoder")[0].module, "text_model.encoder.layers.0.self_attn.k_proj");
  EXPECT_EQ(a.targets("text_encoder")[1].module, "text_model.encoder.layers.1.mlp.fc1");

  // PEFT with base_model.model. and a named adapter; alpha from the caller.
  TensorMap peft = {
      {"base_model.model." + attn + ".to_v.lora_A.default.weight", w(4, 32)},
      {"base_model.model." + attn + ".to_v.lora_B.default.weight", w(32, 4)},
      {"unet." + attn + ".to_k.lora_A.weight", w(4, 32)},
      {"unet." + attn + ".to_k.lora_B.weight", w(32, 4)},
  };
  difftrain::io::LoraReadOptions opts;
  opts.alpha = 8;
  const auto b = difftrain::io::parse_lora(peft, "peft.safetensors", opts);
  EXPECT_EQ(b.format, LoraFormat::kPeft);
  EXPECT_EQ(module_names(b), (std::vector<std::string>{attn + ".to_k", attn + ".to_v"}));
  for (const auto& t : b.targets("unet")) EXPECT_DOUBLE_EQ(t.scale(), 2.0);  // 8 / 4
  opts.alpha = 0;
  EXPECT_HAS(error_of([&] { difftrain::io::parse_lora(peft, "peft.safetensors", opts); }), "alpha");

  // kohya text encoders (SD: lora_te_, SDXL: lora_te1_ / lora_te2_) are collected apart; an
  // alpha of 0 means alpha = r (kohya's rule), other alphas give alpha / r.
  TensorMap kohya = {
      {"lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_down.weight", w(2, 8)},
      {"lora_te_text_model_encoder_layers_0_self_attn_q_proj.lora_up.weight", w(8, 2)},
      {"lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", w(2, 8)},
      {"lora_te2_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", w(8, 2)},
      {"lora_unet_conv_in.alpha", torch::tensor(0.0)},
      {"lora_unet_conv_in.lora_down.weight", at::randn({2, 4, 3, 3}, gen)},
      {"lora_unet_conv_in.lora_up.weight", at::randn({32, 2, 1, 1}, gen)},
      {"lora_unet_mid_block_attentions_0_proj_in.alpha", torch::tensor(1, torch::kInt64)},
      {"lora_unet_mid_block_attentions_0_proj_in.lora_down.weight", w(2, 64)},
      {"lora_unet_mid_block_attentions_0_proj_in.lora_up.weight", w(64, 2)},
  };
  const auto c = difftrain::io::parse_lora(kohya, "kohya.safetensors");
  EXPECT_EQ(c.count("unet"), 2u);
  EXPECT_EQ(c.count("text_encoder"), 1u);
  EXPECT_EQ(c.count("text_encoder_2"), 1u);
  EXPECT_DOUBLE_EQ(c.targets("unet")[0].scale(), 1.0);
  EXPECT_DOUBLE_EQ(c.targets("unet")[1].scale(), 0.5);
  EXPECT_EQ(c.targets("unet")[0].down.dim(), 4);
}

// ---------------------------------------------------------------- malformed files

TEST(LoraFormat, MalformedFilesNameFileAndKey) {
  const auto dir = temp_dir("lora_bad");
  auto gen = at::detail::createCPUGenerator(5);
  auto w = [&](std::vector<int64_t> shape) { return at::randn(shape, gen, torch::kFloat32); };
  const std::string m = "unet.mid_block.attentions.0.transformer_blocks.0.attn1.to_q";
  struct Case {
    const char* name;
    TensorMap tensors;
    std::vector<std::string> expect;
  };
  const std::vector<Case> cases = {
      {"down_without_up",
       {{m + ".lora.down.weight", w({4, 64})}},
       {m + ".lora.down.weight", "no matching up weight", m + ".lora.up.weight"}},
      {"up_without_down",
       {{"lora_unet_x.lora_up.weight", w({8, 4})}},
       {"lora_unet_x.lora_up.weight", "no matching down weight", "lora_unet_x.lora_down.weight"}},
      {"alpha_alone",
       {{"lora_unet_x.alpha", torch::tensor(4.0)}},
       {"lora_unet_x.alpha", "no matching down weight"}},
      {"rank_mismatch",
       {{m + ".lora_A.weight", w({4, 64})}, {m + ".lora_B.weight", w({64, 3})}},
       {m + ".lora_A.weight", "rank 4", "rank 3"}},
      {"three_d",
       {{m + ".lora.down.weight", w({4, 64, 3})}, {m + ".lora.up.weight", w({64, 4})}},
       {m + ".lora.down.weight", "[4, 64, 3]", "[r, in]"}},
      {"conv_up_not_1x1",
       {{"lora_unet_conv_in.lora_down.weight", w({4, 4, 3, 3})},
        {"lora_unet_conv_in.lora_up.weight", w({32, 4, 3, 3})}},
       {"lora_unet_conv_in.lora_up.weight", "[out, r, 1, 1]"}},
      {"int_weight",
       {{m + ".lora.down.weight", torch::ones({4, 64}, torch::kInt32)},
        {m + ".lora.up.weight", w({64, 4})}},
       {m + ".lora.down.weight", "Int", "floating point"}},
      {"bad_alpha",
       {{"lora_unet_x.alpha", w({2})},
        {"lora_unet_x.lora_down.weight", w({4, 8})},
        {"lora_unet_x.lora_up.weight", w({8, 4})}},
       {"lora_unet_x.alpha", "one real number"}},
      {"mixed_and_one_incomplete",  // conventions may differ per module (lora_conventions_test)
       {{"lora_unet_x.lora_down.weight", w({4, 8})},
        {"lora_unet_x.lora_up.weight", w({8, 4})},
        {m + ".lora_A.weight", w({4, 64})}},
       {m + ".lora_A.weight", "no matching up weight", m + ".lora_B.weight"}},
      {"lycoris",
       {{"lora_unet_x.hada_w1_a", w({4, 8})}},
       {"lora_unet_x.hada_w1_a", "not a LoRA weight in a known format", "LoHa"}},
      {"not_lora",
       {{"unet.conv_in.weight", w({4, 8})}},
       {"unet.conv_in.weight", "not a LoRA weight"}},
      {"twice",
       {{m + ".lora.down.weight", w({4, 64})},
        {m + ".lora.up.weight", w({64, 4})},
        {"unet.mid_block.attentions.0.transformer_blocks.0.attn1.processor.to_q_lora.down.weight",
         w({4, 64})}},
       {"both the down", "attn1.to_q'"}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE(c.name);
    const std::string path = dir + "/" + c.name + ".safetensors";
    difftrain::io::save_safetensors(path, c.tensors);
    const auto msg = error_of([&] { difftrain::io::read_lora(path); });
    std::printf("%s: %s\n", c.name, msg.c_str());
    EXPECT_HAS(msg, "LoRA file '" + path + "'");
    for (const auto& part : c.expect) EXPECT_HAS(msg, part);
    EXPECT_EQ(msg.find('\n'), std::string::npos);
  }
  const std::string empty = dir + "/empty.safetensors";
  difftrain::io::save_safetensors(empty, {});
  EXPECT_HAS(error_of([&] { difftrain::io::read_lora(empty); }), "holds no tensors");
  EXPECT_HAS(error_of([&] { difftrain::io::read_lora(dir + "/missing.safetensors"); }),
             "missing.safetensors");
  fs::remove_all(dir);
}

// ---------------------------------------------------------------- merging

// merge_lora against a float64 recomputation, for every target of `lora` (target i updates
// modules[i], or its own module when `modules` is empty).
void expect_merged(const TensorMap& before, torch::nn::Module& model, const LoraWeights& lora,
                   double lora_scale, const std::vector<std::string>& modules, double tol) {
  auto params = model.named_parameters();
  double worst = 0;
  std::set<std::string> touched;
  const auto& targets = lora.targets("unet");
  for (size_t i = 0; i < targets.size(); ++i) {
    const auto& t = targets[i];
    const std::string name = (modules.empty() ? t.module : modules[i]) + ".weight";
    touched.insert(name);
    auto up = t.up.to(torch::kFloat64).flatten(1), down = t.down.to(torch::kFloat64).flatten(1);
    auto expected = before.at(name).to(torch::kFloat64) +
                    (lora_scale * t.scale()) * torch::mm(up, down).view(before.at(name).sizes());
    worst = std::max(worst, max_abs(params[name], expected));
  }
  for (const auto& p : params) {
    if (!touched.count(p.key())) {
      EXPECT_TRUE(torch::equal(p.value(), before.at(p.key()))) << p.key();
    }
  }
  std::printf(
      "merge_lora (%s, scale %.2f): max |W - (W0 + s*up@down)| %.3g over %zu modules "
      "(tol %.0e)\n",
      difftrain::io::to_string(lora.format).c_str(), lora_scale, worst, targets.size(), tol);
  EXPECT_LE(worst, tol);
}

TEST(LoraMerge, AddsExactlyTheDeltaInEveryFormat) {
  torch::manual_seed(0);
  const auto names = module_names(read_fixture("pytorch_lora_weights"));
  for (const char* file : {"pytorch_lora_weights", "peft_format", "kohya_format"}) {
    SCOPED_TRACE(file);
    TinyUNet unet;
    const auto before = snapshot(*unet);
    const auto lora = read_fixture(file);
    const auto summary = difftrain::models::merge_lora(*unet, lora, 0.75);
    EXPECT_EQ(summary.modules_merged, 32);
    EXPECT_EQ(summary.other_component_targets, 0);
    // float32 weights of size ~0.2 and deltas ~0.1: one float32 rounding is ~3e-8.
    auto resolved = lora;  // merge_lora resolves kohya names itself; the check needs them too
    difftrain::io::resolve_kohya_names(resolved, "unet", names);
    expect_merged(before, *unet, resolved, 0.75, {}, 1e-6);
  }
}

TEST(LoraMerge, ConvAndOneByOneTargets) {
  torch::manual_seed(1);
  auto gen = at::detail::createCPUGenerator(11);
  TinyUNet unet;
  const auto before = snapshot(*unet);
  // conv_in is a 3x3 Conv2d [32, 4, 3, 3]; proj_in is a Linear [64, 64] given a 1x1-conv LoRA.
  const TensorMap tensors = {
      {"lora_unet_conv_in.alpha", torch::tensor(3.0)},
      {"lora_unet_conv_in.lora_down.weight", at::randn({2, 4, 3, 3}, gen)},
      {"lora_unet_conv_in.lora_up.weight", at::randn({32, 2, 1, 1}, gen)},
      {"lora_unet_mid_block_attentions_0_proj_in.lora_down.weight", at::randn({3, 64, 1, 1}, gen)},
      {"lora_unet_mid_block_attentions_0_proj_in.lora_up.weight", at::randn({64, 3, 1, 1}, gen)},
      {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_down.weight", at::randn({2, 8}, gen)},
      {"lora_te_text_model_encoder_layers_0_mlp_fc1.lora_up.weight", at::randn({8, 2}, gen)},
  };
  const auto lora = difftrain::io::parse_lora(tensors, "conv.safetensors");
  const auto summary = difftrain::models::merge_lora(*unet, lora, 1.0);
  EXPECT_EQ(summary.modules_merged, 2);
  EXPECT_EQ(summary.other_component_targets, 1);
  // Raw (unresolved) names come out in kohya order: conv_in, then mid_block... The conv update
  // reaches ~7 here, where one float32 rounding is ~5e-7.
  expect_merged(before, *unet, lora, 1.0, {"conv_in", "mid_block.attentions.0.proj_in"}, 1e-5);
}

TEST(LoraMerge, Bfloat16WeightsRoundOnce) {
  torch::manual_seed(2);
  TinyUNet unet;
  unet->to(torch::kBFloat16);
  const auto before = snapshot(*unet);
  const auto lora = read_fixture("pytorch_lora_weights");
  difftrain::models::merge_lora(*unet, lora, 1.0);
  auto params = unet->named_parameters();
  double worst = 0;
  for (const auto& t : lora.targets("unet")) {
    const auto name = t.module + ".weight";
    const auto expected = (before.at(name).to(torch::kFloat32) + difftrain::models::lora_delta(t))
                              .to(torch::kBFloat16);
    worst = std::max(worst, max_abs(params[name], expected));
  }
  std::printf("bf16 merge vs (W.float() + delta).bfloat16(): max |diff| %.3g (tol 0)\n", worst);
  EXPECT_EQ(worst, 0.0);
}

TEST(LoraMerge, ErrorsLeaveTheModelUntouched) {
  torch::manual_seed(3);
  const auto lora = read_fixture("pytorch_lora_weights");
  {
    // Cross-attention dim 16 instead of 32: attn2.to_k / to_v are [dim, 16].
    TinyUNet unet(16);
    const auto before = snapshot(*unet);
    const auto msg = error_of([&] { difftrain::models::merge_lora(*unet, lora); });
    EXPECT_HAS(msg, "pytorch_lora_weights.safetensors");
    EXPECT_HAS(msg, "down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k");
    EXPECT_HAS(msg, "[32, 32]");
    EXPECT_HAS(msg, "[32, 16]");
    for (const auto& p : unet->named_parameters())
      EXPECT_TRUE(torch::equal(p.value(), before.at(p.key())));
  }
  {
    auto extra = lora;
    auto target = extra.components["unet"].back();
    target.module = "up_blocks.1.attentions.1.transformer_blocks.0.attn3.to_q";
    target.key = "unet." + target.module + ".lora";
    extra.components["unet"].push_back(target);
    TinyUNet unet;
    const auto before = snapshot(*unet);
    const auto msg = error_of([&] { difftrain::models::merge_lora(*unet, extra); });
    EXPECT_HAS(msg, "attn3.to_q");
    EXPECT_HAS(msg, "is not in the model");
    EXPECT_HAS(msg, "different model");
    for (const auto& p : unet->named_parameters())
      EXPECT_TRUE(torch::equal(p.value(), before.at(p.key())));
  }
  {
    // kohya names that match no module of this model.
    TinyUNet unet;
    const TensorMap tensors = {
        {"lora_unet_input_blocks_1_1_proj_in.lora_down.weight", torch::ones({2, 32})},
        {"lora_unet_input_blocks_1_1_proj_in.lora_up.weight", torch::ones({32, 2})},
    };
    const auto sgm = difftrain::io::parse_lora(tensors, "sgm.safetensors");
    const auto msg = error_of([&] { difftrain::models::merge_lora(*unet, sgm); });
    EXPECT_HAS(msg, "lora_unet_input_blocks_1_1_proj_in");
    EXPECT_HAS(msg, "is this LoRA for a different model?");
  }
  TinyUNet unet;
  EXPECT_HAS(error_of([&] { difftrain::models::merge_lora(*unet, lora, std::nan("")); }),
             "lora_scale");
}

TEST(LoraMerge, NegativeScaleUndoes) {
  torch::manual_seed(4);
  TinyUNet unet;
  const auto before = snapshot(*unet);
  const auto lora = read_fixture("kohya_format");
  difftrain::models::merge_lora(*unet, lora, 1.0);
  difftrain::models::merge_lora(*unet, lora, -1.0);
  double worst = 0;
  for (const auto& p : unet->named_parameters())
    worst = std::max(worst, max_abs(p.value(), before.at(p.key())));
  std::printf("merge then unmerge: max |diff| %.3g (tol 1e-6)\n", worst);
  EXPECT_LE(worst, 1e-6);
}

}  // namespace
