// Training LoRA adapters: injected adapters leave the UNet's output unchanged until B moves; the
// adapted forward equals the base model with the exported LoRA merged in (Linear and Conv2d
// targets, alpha != rank); backward reaches only the adapters; bad targets give one-line errors.

#include "difftrain/models/lora/lora_training.h"
#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_adapter_config.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/unets/unet.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

namespace {

using difftrain::models::LoraConfig;
using difftrain::models::LoraLayers;
using difftrain::models::UNet;
using difftrain::models::UNetConditioning;
using difftrain::test::error_of;
using difftrain::test::max_abs;

using difftrain::test::kDiffusersGolden;

struct CondInputs {
  torch::Tensor x, t;
  UNetConditioning cond;
};

CondInputs cond_inputs() {
  auto io = difftrain::io::load_safetensors(kDiffusersGolden + "unet_cond/io.safetensors").tensors;
  CondInputs in;
  in.x = io.at("sample");
  in.t = io.at("timestep");
  in.cond.encoder_hidden_states = io.at("encoder_hidden_states");
  return in;
}

void randomise_up(LoraLayers& layers) {
  torch::NoGradGuard no_grad;
  torch::manual_seed(3);
  for (const auto& name : layers->module_names()) {
    auto a = layers->adapter(name);
    a->up_weight().normal_(0, 0.05);
  }
}

TEST(LoraTraining, FreshAdaptersChangeNothing) {
  UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
  unet->eval();
  const auto in = cond_inputs();
  torch::NoGradGuard no_grad;
  const auto before = unet->forward(in.x, in.t, in.cond);
  LoraLayers layers(*unet, LoraConfig{});
  EXPECT_GT(layers->module_names().size(), 4u);
  const auto after = unet->forward(in.x, in.t, in.cond);
  EXPECT_EQ(max_abs(before, after), 0.0);
}

// Tolerance 1e-5: float32 rounding of two orders of the same sums; a wrong scale or a missing
// target moves the output by more than 1e-3.
TEST(LoraTraining, AdaptedForwardEqualsMergedExport) {
  UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
  unet->eval();
  const auto in = cond_inputs();
  LoraConfig config;
  config.rank = 3;
  config.alpha = 6;  // scale 2
  config.target_modules = {"to_q", "to_k", "to_v", "to_out.0", "proj_in", "conv1", "ff.net.2"};
  LoraLayers layers(*unet, config);
  randomise_up(layers);
  torch::NoGradGuard no_grad;
  const auto adapted = unet->forward(in.x, in.t, in.cond);

  const auto weights = layers->to_lora_weights("unet");
  layers->detach();
  const auto plain = unet->forward(in.x, in.t, in.cond);
  difftrain::models::merge_lora(*unet, weights);
  const auto merged = unet->forward(in.x, in.t, in.cond);
  const double diff = max_abs(adapted, merged);
  std::cout << "adapted vs merged max abs diff " << diff << "\n";
  EXPECT_LT(diff, 1e-5);
  EXPECT_GT(max_abs(adapted, plain), 1e-3);  // the adapters did something
}

TEST(LoraTraining, BackwardReachesOnlyAdapters) {
  UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
  for (auto& p : unet->parameters()) p.set_requires_grad(false);
  LoraLayers layers(*unet, LoraConfig{});
  randomise_up(layers);
  const auto in = cond_inputs();
  unet->forward(in.x, in.t, in.cond).pow(2).mean().backward();
  for (const auto& p : unet->named_parameters()) {
    EXPECT_FALSE(p.value().grad().defined()) << p.key();
  }
  for (const auto& p : layers->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(p.value().grad().abs().max().item<double>(), 0.0) << p.key();
  }
  // Keys read like PEFT's, with the layer path slashed.
  EXPECT_TRUE(layers->named_parameters().contains(
      "down_blocks/0/attentions/0/transformer_blocks/0/attn1/to_q.lora_A.weight"));
}

TEST(LoraTraining, BadTargetsAreOneLineErrors) {
  UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
  LoraConfig config;
  config.target_modules = {"to_q", "nonexistent"};
  auto message = error_of([&] { LoraLayers layers(*unet, config); });
  EXPECT_NE(message.find("\"nonexistent\" matches no layer"), std::string::npos) << message;
  config.target_modules = {"to_out"};
  message = error_of([&] { LoraLayers layers(*unet, config); });
  EXPECT_NE(message.find("not a Linear or Conv2d"), std::string::npos) << message;
  config.target_modules = {"to_q"};
  config.rank = 0;
  message = error_of([&] { LoraLayers layers(*unet, config); });
  EXPECT_NE(message.find("rank is 0"), std::string::npos) << message;
}

// Rank 4, alpha 8 (scale 2) exported in each format and read back: r and alpha as trained (up
// not folded), in adapter_config.json (PEFT), lora_adapter_metadata (Diffusers, PEFT) or .alpha
// (kohya); the merged read-back runs like the adapted UNet. Tolerance 1e-5 as above.
TEST(LoraTraining, RankAndAlphaRoundTripInEveryFormat) {
  namespace io = difftrain::io;
  namespace fs = std::filesystem;
  UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
  unet->eval();
  const auto in = cond_inputs();
  LoraConfig config;
  config.rank = 4;
  config.alpha = 8;
  config.target_modules = {"to_q", "to_k", "to_v", "to_out.0", "proj_in", "ff.net.2", "conv1"};
  LoraLayers layers(*unet, config);
  randomise_up(layers);
  torch::NoGradGuard no_grad;
  const auto adapted = unet->forward(in.x, in.t, in.cond);
  const auto weights = layers->to_lora_weights("unet");
  layers->detach();
  const auto names = difftrain::models::lora_module_names(*unet);

  for (const auto format :
       {io::LoraFormat::kDiffusers, io::LoraFormat::kPeft, io::LoraFormat::kKohya}) {
    SCOPED_TRACE(io::to_string(format));
    const auto dir = difftrain::test::temp_dir("lora_alpha_" + io::to_string(format));
    const std::string path = dir + "/pytorch_lora_weights.safetensors";
    io::write_lora(path, weights, format);
    const auto file = io::load_safetensors(path);
    if (format == io::LoraFormat::kKohya) {
      EXPECT_FALSE(file.metadata.count(io::kLoraAdapterMetadataKey));
    } else {
      const auto meta = nlohmann::json::parse(file.metadata.at(io::kLoraAdapterMetadataKey));
      EXPECT_EQ(meta.at("unet.r"), 4);
      EXPECT_EQ(meta.at("unet.lora_alpha"), 8.0);
      EXPECT_TRUE(meta.at("unet.rank_pattern").empty());
      EXPECT_EQ(meta.at("unet.target_modules").size(), weights.count("unet"));
    }
    EXPECT_EQ(fs::exists(dir + "/adapter_config.json"), format == io::LoraFormat::kPeft);
    if (format == io::LoraFormat::kPeft) {
      const auto peft = difftrain::test::read_json(dir + "/adapter_config.json");
      EXPECT_EQ(peft.at("peft_type"), "LORA");
      EXPECT_EQ(peft.at("r"), 4);
      EXPECT_EQ(peft.at("lora_alpha"), 8.0);
      EXPECT_EQ(peft.at("target_modules").size(), weights.count("unet"));
      // Without the file's metadata, adapter_config.json alone gives the same alphas.
      auto bare = file.tensors;
      io::save_safetensors(dir + "/adapter_model.safetensors", bare);
      const io::LoraWeights bare_back = io::read_lora(dir + "/adapter_model.safetensors");
      for (const auto& t : bare_back.targets("unet")) {
        EXPECT_EQ(t.alpha.value_or(0), 8.0) << t.module;
      }
    }
    auto back = io::read_lora(path);
    io::resolve_kohya_names(back, "unet", names);
    ASSERT_EQ(back.count("unet"), weights.count("unet"));
    for (const auto& t : back.targets("unet")) {
      const auto& all = weights.targets("unet");
      const auto it =
          std::find_if(all.begin(), all.end(), [&](const auto& w) { return w.module == t.module; });
      ASSERT_NE(it, all.end()) << t.module;
      const auto& w = *it;
      EXPECT_EQ(t.rank(), 4) << t.module;
      EXPECT_EQ(t.alpha.value_or(0), 8.0) << t.module;
      EXPECT_TRUE(torch::equal(t.up, w.up)) << t.module;  // not folded
    }
    auto merged = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
    merged->eval();
    difftrain::models::merge_lora(*merged, back);
    const double diff = max_abs(merged->forward(in.x, in.t, in.cond), adapted);
    std::printf(
        "%s: r 4, alpha 8 read back; merged vs adapted forward max abs diff %.3g (tol "
        "1e-5)\n",
        io::to_string(format).c_str(), diff);
    EXPECT_LT(diff, 1e-5);
    fs::remove_all(dir);
  }
}

TEST(LoraTraining, TargetRuleIsPeftsSuffixMatch) {
  using difftrain::models::lora_target_matches;
  EXPECT_TRUE(lora_target_matches("a.attn1.to_q", {"to_q"}));
  EXPECT_TRUE(lora_target_matches("a.attn1.to_out.0", {"attn1.to_out.0"}));
  EXPECT_FALSE(lora_target_matches("a.attn1.xto_q", {"to_q"}));
  EXPECT_FALSE(lora_target_matches("a.to_q.x", {"to_q"}));
}

}  // namespace
