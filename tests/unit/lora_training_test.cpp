// Training LoRA adapters: injected adapters leave the UNet's output unchanged until B moves; the
// adapted forward equals the base model with the exported LoRA merged in (Linear and Conv2d
// targets, alpha != rank); backward reaches only the adapters; bad targets give one-line errors.

#include "difftrain/models/lora_training.h"
#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/unet.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

namespace {

using difftrain::models::LoraConfig;
using difftrain::models::LoraLayers;
using difftrain::models::UNet;
using difftrain::models::UNetConditioning;
using difftrain::test::error_of;
using difftrain::test::max_abs;

const std::string kGolden = std::string(DIFFTRAIN_SOURCE_DIR) + "/tests/golden/diffusers/";

struct CondInputs {
  torch::Tensor x, t;
  UNetConditioning cond;
};

CondInputs cond_inputs() {
  auto io = difftrain::io::load_safetensors(kGolden + "unet_cond/io.safetensors").tensors;
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
  UNet unet = difftrain::models::load_unet(kGolden + "unet_cond");
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
  UNet unet = difftrain::models::load_unet(kGolden + "unet_cond");
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
  UNet unet = difftrain::models::load_unet(kGolden + "unet_cond");
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
  UNet unet = difftrain::models::load_unet(kGolden + "unet_cond");
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

TEST(LoraTraining, TargetRuleIsPeftsSuffixMatch) {
  using difftrain::models::lora_target_matches;
  EXPECT_TRUE(lora_target_matches("a.attn1.to_q", {"to_q"}));
  EXPECT_TRUE(lora_target_matches("a.attn1.to_out.0", {"attn1.to_out.0"}));
  EXPECT_FALSE(lora_target_matches("a.attn1.xto_q", {"to_q"}));
  EXPECT_FALSE(lora_target_matches("a.to_q.x", {"to_q"}));
}

}  // namespace
