// Diffusers UNets: output parity with the Diffusers 0.31 fixtures, exact key names, strict loading,
// save/reload, config errors, gradient checkpointing, and configurations beyond the fixtures.

#include "difftrain/models/unets/unet.h"
#include "difftrain/core/error.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/attention.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/pretrained.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace {

using difftrain::test::error_of;
using difftrain::test::max_abs;
using difftrain::test::read_json;
using difftrain::test::temp_dir;

namespace fs = std::filesystem;
using difftrain::models::UNet;
using difftrain::models::UNetConditioning;
using difftrain::models::UNetConfig;
using nlohmann::json;

using difftrain::test::kDiffusersGolden;

// GELU's gradient when the incoming gradient is not contiguous (here: the output is used
// transposed). LibTorch 1.13's own gelu_backward gets this wrong on the CPU (inf/NaN or garbage);
// models::gelu, which GEGLU, FeedForward, CLIP and activation("gelu") use, must equal float64
// autograd through the written-out formulas.
TEST(Layers, GeluGradientIsRightForNonContiguousIncomingGradients) {
  torch::manual_seed(3);
  const torch::Tensor x0 = torch::randn({37, 29}) * 3;
  const torch::Tensor w = torch::randn({29, 37});
  for (const bool tanh_approx : {false, true}) {
    for (const bool via_activation : {false, true}) {
      if (tanh_approx && via_activation) continue;  // activation() names only the exact gelu
      torch::Tensor x = x0.clone().requires_grad_(true);
      const torch::Tensor y = via_activation ? difftrain::models::activation("gelu", x)
                                             : difftrain::models::gelu(x, tanh_approx);
      (y.t() * w).sum().backward();  // dL/dy = w^T: a non-contiguous gradient

      torch::Tensor xd = x0.to(torch::kFloat64).requires_grad_(true);
      const torch::Tensor yd =
          tanh_approx
              ? 0.5 * xd * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (xd + 0.044715 * xd * xd * xd)))
              : 0.5 * xd * (1 + torch::erf(xd / std::sqrt(2.0)));
      (yd.t() * w.to(torch::kFloat64)).sum().backward();
      const double out_diff = max_abs(y.to(torch::kFloat64), yd.detach());
      const double grad_diff = max_abs(x.grad().to(torch::kFloat64), xd.grad());
      std::printf("gelu%s%s: max |out - f64| %.3g, max |grad - f64| %.3g (tol 1e-5)\n",
                  tanh_approx ? " (tanh)" : "", via_activation ? " via activation()" : "", out_diff,
                  grad_diff);
      EXPECT_LT(out_diff, 1e-5);
      EXPECT_LT(grad_diff, 1e-5);
    }
  }
}

TEST(UNet, ClassConditionalUNet2DMatchesDiffusers) {
  UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet2d");
  unet->eval();
  auto io = difftrain::io::load_safetensors(kDiffusersGolden + "unet2d/io.safetensors").tensors;
  torch::NoGradGuard no_grad;
  UNetConditioning cond;
  cond.class_labels = io.at("class_labels");
  auto out = unet->forward(io.at("sample"), io.at("timestep"), cond);
  const double diff = max_abs(out, io.at("out"));
  std::printf("UNet2DModel (class-conditional) max |out - diffusers| = %.3g (tol 1e-4)\n", diff);
  EXPECT_LT(diff, 1e-4);
  // The labels matter: other labels give a clearly different output.
  cond.class_labels = (io.at("class_labels") + 1) % 10;
  EXPECT_GT(max_abs(unet->forward(io.at("sample"), io.at("timestep"), cond), io.at("out")), 1e-3);
}

TEST(UNet, ConditionUNetMatchesDiffusers) {
  UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
  unet->eval();
  auto io = difftrain::io::load_safetensors(kDiffusersGolden + "unet_cond/io.safetensors").tensors;
  torch::NoGradGuard no_grad;
  UNetConditioning cond;
  cond.encoder_hidden_states = io.at("encoder_hidden_states");
  auto out = unet->forward(io.at("sample"), io.at("timestep"), cond);
  const double diff = max_abs(out, io.at("out"));
  std::printf("UNet2DConditionModel max |out - diffusers| = %.3g (tol 1e-4)\n", diff);
  EXPECT_LT(diff, 1e-4);
  // A scalar timestep broadcasts over the batch like a [B] one.
  auto t0 = io.at("timestep")[0];
  auto per_item = unet->forward(io.at("sample"), t0.expand({2}).clone(), cond);
  EXPECT_LT(max_abs(unet->forward(io.at("sample"), t0, cond), per_item), 1e-6);
}

TEST(UNet, KeysAreExactlyDiffusersKeys) {
  for (const char* name : {"unet2d", "unet2d_uncond", "unet_cond"}) {
    UNet unet(UNetConfig::load(kDiffusersGolden + name + "/config.json"));
    auto file = difftrain::io::load_safetensors(kDiffusersGolden + name +
                                                "/diffusion_pytorch_model.safetensors")
                    .tensors;
    auto own = difftrain::models::named_tensors(*unet);
    std::vector<std::string> a, b;
    for (const auto& [k, v] : own) a.push_back(k);
    for (const auto& [k, v] : file) b.push_back(k);
    EXPECT_EQ(a, b) << name;
    for (const auto& [k, v] : file) {
      ASSERT_TRUE(own.count(k)) << k;
      EXPECT_EQ(own.at(k).sizes(), v.sizes()) << k;
    }
  }
}

TEST(UNet, SaveThenLoadRoundTripsAndDiffusersConfigStays) {
  UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
  const std::string dir = temp_dir("unet_save");
  difftrain::models::save_unet(*unet, dir);
  auto original = read_json(kDiffusersGolden + "unet_cond/config.json");
  auto saved = read_json(dir + "/config.json");
  EXPECT_EQ(saved, original);
  auto a = difftrain::io::load_safetensors(kDiffusersGolden +
                                           "unet_cond/diffusion_pytorch_model.safetensors")
               .tensors;
  auto b = difftrain::io::load_safetensors(dir + "/diffusion_pytorch_model.safetensors");
  ASSERT_EQ(a.size(), b.tensors.size());
  for (const auto& [k, v] : a) EXPECT_TRUE(torch::equal(v, b.tensors.at(k))) << k;
  EXPECT_EQ(b.metadata.at("format"), "pt");
  UNet again = difftrain::models::load_unet(dir);
  fs::remove_all(dir);
}

// Diffusers' `variant="fp16"` files: half-precision weights load into the float32 model.
TEST(UNet, Fp16VariantWeightsLoad) {
  const std::string dir = temp_dir("unet_fp16");
  fs::copy_file(kDiffusersGolden + "unet2d/config.json", dir + "/config.json");
  auto w = difftrain::io::load_safetensors(kDiffusersGolden +
                                           "unet2d/diffusion_pytorch_model.safetensors")
               .tensors;
  for (auto& [k, v] : w) v = v.to(torch::kFloat16);
  difftrain::io::save_safetensors(dir + "/diffusion_pytorch_model.fp16.safetensors", w);
  std::string msg = error_of([&] { difftrain::models::load_unet(dir); });
  EXPECT_NE(msg.find("diffusion_pytorch_model.safetensors: no such file"), std::string::npos)
      << msg;
  UNet unet = difftrain::models::load_unet(dir, "fp16");
  for (const auto& p : unet->parameters()) EXPECT_EQ(p.scalar_type(), torch::kFloat32);
  unet->eval();
  auto io = difftrain::io::load_safetensors(kDiffusersGolden + "unet2d/io.safetensors").tensors;
  torch::NoGradGuard no_grad;
  UNetConditioning cond;
  cond.class_labels = io.at("class_labels");
  const double diff =
      max_abs(unet->forward(io.at("sample"), io.at("timestep"), cond), io.at("out"));
  std::printf("fp16-rounded weights: max |out - diffusers fp32| = %.3g (tol 2e-2)\n", diff);
  EXPECT_LT(diff, 2e-2);
  fs::remove_all(dir);
}

TEST(UNet, LoadReportsMissingUnexpectedAndMisshapenKeysByName) {
  const std::string dir = temp_dir("unet_bad");
  fs::copy_file(kDiffusersGolden + "unet_cond/config.json", dir + "/config.json");
  auto w = difftrain::io::load_safetensors(kDiffusersGolden +
                                           "unet_cond/diffusion_pytorch_model.safetensors")
               .tensors;
  auto broken = w;
  broken.erase("mid_block.attentions.0.proj_in.weight");
  broken["mid_block.extra.weight"] = torch::zeros({2});
  broken["conv_in.bias"] = torch::zeros({5});
  difftrain::io::save_safetensors(dir + "/diffusion_pytorch_model.safetensors", broken);
  UNet unet(UNetConfig::load(dir + "/config.json"));
  auto before = unet->named_parameters()["conv_out.weight"].clone();
  std::string msg = error_of([&] {
    difftrain::models::load_weights(*unet, broken, dir + "/diffusion_pytorch_model.safetensors");
  });
  EXPECT_NE(msg.find("missing keys: mid_block.attentions.0.proj_in.weight"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("unexpected keys: mid_block.extra.weight"), std::string::npos) << msg;
  EXPECT_NE(msg.find("conv_in.bias (file [5], model [32])"), std::string::npos) << msg;
  // A refused load changes nothing.
  EXPECT_TRUE(torch::equal(before, unet->named_parameters()["conv_out.weight"]));

  fs::remove(dir + "/diffusion_pytorch_model.safetensors");
  msg = error_of([&] { difftrain::models::load_unet(dir); });
  EXPECT_NE(msg.find("diffusion_pytorch_model.safetensors: no such file"), std::string::npos)
      << msg;
  std::ofstream(dir + "/diffusion_pytorch_model.bin") << "pickle";
  msg = error_of([&] { difftrain::models::load_unet(dir); });
  EXPECT_NE(msg.find("safetensors only"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(UNet, ConfigErrorsNameTheFieldAndTheChoices) {
  auto base = read_json(kDiffusersGolden + "unet_cond/config.json");
  auto bad = base;
  bad["down_block_types"][0] = "SimpleCrossAttnDownBlock2D";
  std::string msg = error_of([&] { UNetConfig::from_json(bad, "cfg.json"); });
  EXPECT_NE(msg.find("cfg.json: field \"down_block_types\" has \"SimpleCrossAttnDownBlock2D\"; "
                     "supported: DownBlock2D, AttnDownBlock2D, CrossAttnDownBlock2D"),
            std::string::npos)
      << msg;
  bad = base;
  bad["act_fn"] = "tanh";
  msg = error_of([&] { UNetConfig::from_json(bad, "cfg.json"); });
  EXPECT_NE(msg.find("\"act_fn\" is \"tanh\"; supported: silu"), std::string::npos) << msg;
  bad = base;
  bad["addition_embed_type"] = "text";
  msg = error_of([&] { UNetConfig::from_json(bad, "cfg.json"); });
  EXPECT_NE(msg.find("addition_embed_type"), std::string::npos) << msg;
  bad = base;
  bad["block_out_channels"] = json::array({32});
  msg = error_of([&] { UNetConfig::from_json(bad, "cfg.json"); });
  EXPECT_NE(msg.find("block_out_channels"), std::string::npos) << msg;
  bad = base;
  bad["layers_per_block"] = "two";
  msg = error_of([&] { UNetConfig::from_json(bad, "cfg.json"); });
  EXPECT_NE(msg.find("\"layers_per_block\" must be an integer"), std::string::npos) << msg;
  bad = base;
  bad["_class_name"] = "UNet3DConditionModel";
  msg = error_of([&] { UNetConfig::from_json(bad, "cfg.json"); });
  EXPECT_NE(msg.find("supported: UNet2DModel, UNet2DConditionModel"), std::string::npos) << msg;
  // Missing fields take Diffusers' defaults: an empty config is SD-1.x's UNet.
  auto sd = UNetConfig::from_json(json::object(), "empty.json");
  EXPECT_EQ(sd.block_out_channels, (std::vector<int64_t>{320, 640, 1280, 1280}));
  EXPECT_EQ(sd.cross_attention_dim[0], 1280);
  EXPECT_EQ(sd.num_attention_heads[0], 8);
  EXPECT_EQ(sd.mid_block_type, "UNetMidBlock2DCrossAttn");
}

// Missing inputs are errors, not crashes.
TEST(UNet, MissingConditioningIsAClearError) {
  UNet cond_unet(UNetConfig::load(kDiffusersGolden + "unet_cond/config.json"));
  auto x = torch::randn({1, 4, 16, 16});
  std::string msg = error_of([&] { cond_unet->forward(x, torch::tensor({10})); });
  EXPECT_NE(msg.find("encoder_hidden_states"), std::string::npos) << msg;
  UNet class_unet(UNetConfig::load(kDiffusersGolden + "unet2d/config.json"));
  msg = error_of([&] { class_unet->forward(torch::randn({1, 3, 16, 16}), torch::tensor({10})); });
  EXPECT_NE(msg.find("class labels"), std::string::npos) << msg;
  UNetConditioning c;
  c.class_labels = torch::tensor({10});
  msg = error_of([&] { class_unet->forward(torch::randn({1, 3, 16, 16}), torch::tensor({1}), c); });
  EXPECT_NE(msg.find("class label 10 is outside [0, 10)"), std::string::npos) << msg;
}

// Gradient checkpointing recomputes in backward: same loss, same gradients, and it works when
// only some parameters (LoRA-style) are trainable and the input needs no grad.
TEST(UNet, GradientCheckpointingGivesTheSameGradients) {
  auto io = difftrain::io::load_safetensors(kDiffusersGolden + "unet_cond/io.safetensors").tensors;
  UNetConditioning cond;
  cond.encoder_hidden_states = io.at("encoder_hidden_states");
  auto run = [&](bool ckpt, bool only_attention) {
    UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
    unet->train();
    unet->set_gradient_checkpointing(ckpt);
    if (only_attention) {
      for (auto& p : unet->named_parameters()) {
        p.value().requires_grad_(p.key().find("attn2.to_k") != std::string::npos);
      }
    }
    auto out = unet->forward(io.at("sample"), io.at("timestep"), cond);
    auto loss = (out - io.at("sample")).pow(2).mean();
    loss.backward();
    std::map<std::string, torch::Tensor> grads;
    for (auto& p : unet->named_parameters()) {
      if (p.value().grad().defined()) grads[p.key()] = p.value().grad().clone();
    }
    return std::make_pair(loss.item<double>(), grads);
  };
  for (bool only_attention : {false, true}) {
    auto [loss_a, grads_a] = run(false, only_attention);
    auto [loss_b, grads_b] = run(true, only_attention);
    EXPECT_EQ(loss_a, loss_b);
    ASSERT_EQ(grads_a.size(), grads_b.size());
    ASSERT_FALSE(grads_a.empty());
    double worst = 0;
    for (const auto& [k, g] : grads_a) worst = std::max(worst, max_abs(g, grads_b.at(k)));
    std::printf("checkpointing (%s): %zu grads, max |diff| %.3g (tol 1e-6)\n",
                only_attention ? "attn2.to_k only" : "all", grads_a.size(), worst);
    EXPECT_LT(worst, 1e-6);
  }
}

// Configurations the fixtures do not cover: every block type, linear projection, several
// transformer layers, per-block heads, scale_shift, class embeddings, odd input sizes.
TEST(UNet, OtherConfigurationsBuildAndRun) {
  json c = {{"_class_name", "UNet2DConditionModel"},
            {"in_channels", 4},
            {"out_channels", 3},
            {"block_out_channels", {32, 64, 64}},
            {"layers_per_block", {1, 2, 1}},
            {"down_block_types", {"CrossAttnDownBlock2D", "AttnDownBlock2D", "DownBlock2D"}},
            {"up_block_types", {"UpBlock2D", "AttnUpBlock2D", "CrossAttnUpBlock2D"}},
            {"attention_head_dim", {2, 8, 4}},
            {"cross_attention_dim", 24},
            {"transformer_layers_per_block", 2},
            {"use_linear_projection", true},
            {"upcast_attention", true},
            {"resnet_time_scale_shift", "scale_shift"},
            {"num_class_embeds", 5},
            {"time_embedding_act_fn", "silu"},
            {"norm_num_groups", 16}};
  UNet unet(UNetConfig::from_json(c, "test"));
  auto named = difftrain::models::named_tensors(*unet);
  // Linear projections are 2-D; two transformer layers; scale_shift doubles time_emb_proj.
  EXPECT_EQ(named.at("down_blocks.0.attentions.0.proj_in.weight").sizes(),
            (std::vector<int64_t>{32, 32}));
  EXPECT_TRUE(named.count("down_blocks.0.attentions.0.transformer_blocks.1.attn2.to_k.weight"));
  EXPECT_EQ(named.at("down_blocks.0.attentions.0.transformer_blocks.0.attn2.to_k.weight").sizes(),
            (std::vector<int64_t>{32, 24}));
  EXPECT_EQ(named.at("down_blocks.0.resnets.0.time_emb_proj.weight").size(0), 64);
  EXPECT_EQ(named.at("down_blocks.1.attentions.1.group_norm.weight").size(0), 64);
  EXPECT_EQ(named.at("class_embedding.weight").sizes(), (std::vector<int64_t>{5, 128}));
  // The up AttnUpBlock2D (position 1) uses attention_head_dim[1] = 8 channels per head.
  EXPECT_EQ(named.at("up_blocks.1.resnets.2.conv1.weight").size(1), 64 + 32);
  EXPECT_EQ(named.count("mid_block.attentions.0.transformer_blocks.1.ff.net.0.proj.weight"), 1u);
  EXPECT_EQ(named.at("mid_block.attentions.0.transformer_blocks.0.ff.net.0.proj.weight").sizes(),
            (std::vector<int64_t>{512, 64}));
  UNetConditioning cond;
  cond.encoder_hidden_states = torch::randn({2, 5, 24});
  cond.class_labels = torch::tensor({0, 4});
  torch::NoGradGuard no_grad;
  unet->eval();
  // 17x17 is not a multiple of 4: the up blocks upsample to the skips' exact sizes.
  auto out = unet->forward(torch::randn({2, 4, 17, 17}), torch::tensor({3.5f}), cond);
  EXPECT_EQ(out.sizes(), (std::vector<int64_t>{2, 3, 17, 17}));
  // float64 run of the same weights agrees: nothing in the graph is dtype-fragile.
  auto x = torch::randn({2, 4, 16, 16});
  auto y32 = unet->forward(x, torch::tensor({999}), cond);
  unet->to(torch::kFloat64);
  UNetConditioning cond64 = cond;
  cond64.encoder_hidden_states = cond.encoder_hidden_states.to(torch::kFloat64);
  auto y64 = unet->forward(x.to(torch::kFloat64), torch::tensor({999}), cond64);
  EXPECT_LT(max_abs(y32, y64), 1e-4);

  json d = {{"_class_name", "UNet2DModel"},
            {"block_out_channels", {32, 32}},
            {"layers_per_block", 1},
            {"down_block_types", {"AttnDownBlock2D", "DownBlock2D"}},
            {"up_block_types", {"UpBlock2D", "AttnUpBlock2D"}},
            {"downsample_type", "resnet"},
            {"upsample_type", "resnet"},
            {"attention_head_dim", nullptr},
            {"class_embed_type", "timestep"},
            {"time_embedding_type", "fourier"},
            {"norm_num_groups", 8}};
  UNet unet2(UNetConfig::from_json(d, "test2"));
  auto named2 = difftrain::models::named_tensors(*unet2);
  EXPECT_TRUE(named2.count("down_blocks.0.downsamplers.0.conv1.weight"));
  EXPECT_TRUE(named2.count("up_blocks.0.upsamplers.0.conv2.weight"));
  EXPECT_TRUE(named2.count("time_proj.weight"));
  EXPECT_EQ(named2.at("class_embedding.linear_1.weight").sizes(), (std::vector<int64_t>{128, 64}));
  // attention_head_dim null: one head of all channels.
  EXPECT_EQ(named2.at("mid_block.attentions.0.to_q.weight").sizes(),
            (std::vector<int64_t>{32, 32}));
  unet2->eval();
  UNetConditioning c2;
  c2.class_labels = torch::tensor({3.0f});
  auto out2 = unet2->forward(torch::randn({1, 3, 8, 8}), torch::tensor({0.5f}), c2);
  EXPECT_EQ(out2.sizes(), (std::vector<int64_t>{1, 3, 8, 8}));
  EXPECT_TRUE(torch::isfinite(out2).all().item<bool>());
}

}  // namespace

namespace {

// LoRA fixture: the same r=4 LoRA on unet_cond in three key formats; Diffusers' output with the
// LoRA applied is io.safetensors' `out`.
TEST(UNet, LoraAppliedOutputMatchesDiffusersInEveryFormat) {
  auto io = difftrain::io::load_safetensors(kDiffusersGolden + "lora/io.safetensors").tensors;
  UNetConditioning cond;
  cond.encoder_hidden_states = io.at("encoder_hidden_states");
  torch::NoGradGuard no_grad;
  UNet base = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
  base->eval();
  auto base_out = base->forward(io.at("sample"), io.at("timestep"), cond);
  for (const char* file : {"pytorch_lora_weights.safetensors", "peft_format.safetensors",
                           "kohya_format.safetensors"}) {
    UNet unet = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
    unet->eval();
    auto lora = difftrain::io::read_lora(kDiffusersGolden + "lora/" + file);
    auto summary = difftrain::models::merge_lora(*unet, lora, 1.0);
    EXPECT_EQ(summary.modules_merged, 32) << file;
    auto out = unet->forward(io.at("sample"), io.at("timestep"), cond);
    const double diff = max_abs(out, io.at("out"));
    std::printf("LoRA %s: max |out - diffusers| = %.3g (tol 1e-4); LoRA changes out by %.3g\n",
                file, diff, max_abs(out, base_out));
    EXPECT_LT(diff, 1e-4) << file;
    EXPECT_GT(max_abs(out, base_out), 1e-3) << file;  // the LoRA is not a no-op
  }
  // lora_scale 0 leaves the base model; 0.5 lands between.
  UNet half = difftrain::models::load_unet(kDiffusersGolden + "unet_cond");
  half->eval();
  difftrain::models::merge_lora(
      *half, difftrain::io::read_lora(kDiffusersGolden + "lora/peft_format.safetensors"), 0.5);
  auto half_out = half->forward(io.at("sample"), io.at("timestep"), cond);
  EXPECT_GT(max_abs(half_out, base_out), 1e-4);
  EXPECT_GT(max_abs(half_out, io.at("out")), 1e-4);
}

}  // namespace

namespace {

// Long sequences are computed in query chunks; the result equals unchunked attention.
TEST(UNet, ChunkedAttentionEqualsOneShotAttention) {
  torch::manual_seed(3);
  const int64_t B = 1, heads = 2, N = 4608, S = 2048, d = 8;  // 2*4608*2048 > 16M: 2 chunks
  auto q = torch::randn({B, N, heads * d}), k = torch::randn({B, S, heads * d}),
       v = torch::randn({B, S, heads * d});
  auto out = difftrain::models::multi_head_attention(q, k, v, heads, false, false);
  auto split = [&](const torch::Tensor& t, int64_t len) {
    return t.to(torch::kFloat64).reshape({B, len, heads, d}).permute({0, 2, 1, 3});
  };
  auto probs = (torch::matmul(split(q, N), split(k, S).transpose(-1, -2)) / std::sqrt(double(d)))
                   .softmax(-1);
  auto ref = torch::matmul(probs, split(v, S)).permute({0, 2, 1, 3}).reshape({B, N, heads * d});
  const double diff = max_abs(out, ref);
  std::printf("chunked attention vs float64 one-shot: %.3g (tol 1e-5)\n", diff);
  EXPECT_LT(diff, 1e-5);
}

// The unfused path (bf16, float64) on small shapes: LibTorch 1.13's CPU baddbmm with beta = 0
// gave NaN scores on some of them (a 3 x 2 tile of Qwen-Image's VAE attention, 2 tokens in
// bf16), so the scores are a bmm and a scale.
TEST(Attention, SmallBf16AndFloat64ShapesAreFiniteAndRight) {
  torch::manual_seed(3);
  for (const int64_t n : {1, 2, 4, 6, 9, 30}) {
    for (const int64_t c : {8, 16, 64}) {
      for (const auto dt : {torch::kFloat64, torch::kBFloat16}) {
        const auto q = torch::randn({1, n, c}).to(dt), k = torch::randn({1, n, c}).to(dt),
                   v = torch::randn({1, n, c}).to(dt);
        const auto out = difftrain::models::multi_head_attention(q, k, v, 1, false, false);
        const auto f64 = [](const torch::Tensor& t) { return t.to(torch::kFloat64); };
        const auto ref = torch::matmul(
            (torch::matmul(f64(q), f64(k).transpose(1, 2)) / std::sqrt(double(c))).softmax(-1),
            f64(v));
        const double diff = max_abs(out, ref);
        EXPECT_LT(diff, dt == torch::kFloat64 ? 1e-12 : 0.1) << n << " " << c << " " << dt;
      }
    }
  }
}

}  // namespace
