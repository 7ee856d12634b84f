// Diffusers' AutoencoderKL: parity with the tiny SD fixture (moments, posterior, seeded sample,
// decode), exact key names, non-square inputs, other configurations, save/load, config errors.

#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"

#include "test_util.h"

#include <ATen/CPUGeneratorImpl.h>
#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace {

using difftrain::models::AutoencoderKL;
using difftrain::models::AutoencoderKLConfig;
using difftrain::test::error_of;
using difftrain::test::max_abs;
using difftrain::test::read_json;
using difftrain::test::temp_dir;
using difftrain::test::write_text;
using nlohmann::json;
namespace fs = std::filesystem;

using difftrain::test::kTinySdGolden;
const std::string kVae = kTinySdGolden + "vae";

std::vector<std::string> keys_of(const difftrain::io::TensorMap& m) {
  std::vector<std::string> out;
  for (const auto& [k, v] : m) out.push_back(k);
  return out;
}

TEST(AutoencoderKL, MatchesDiffusersFixture) {
  AutoencoderKL vae = difftrain::models::load_autoencoder_kl(kVae);
  vae->eval();
  auto io = difftrain::io::load_safetensors(kVae + "/io.safetensors").tensors;
  torch::NoGradGuard no_grad;

  // moments = quant_conv(encoder(image)), before the clamp.
  auto children = vae->named_children();
  torch::Tensor moments =
      children["encoder"]->as<difftrain::models::VaeEncoderImpl>()->forward(io.at("image"));
  moments = children["quant_conv"]->as<difftrain::models::Conv2dImpl>()->forward(moments);

  auto posterior = vae->encode(io.at("image"));
  at::Generator gen = at::detail::createCPUGenerator(0);
  torch::Tensor sample = posterior.sample(gen);
  torch::Tensor decoded = vae->decode(io.at("latent"));

  const std::vector<std::pair<std::string, torch::Tensor>> checks = {
      {"moments", moments},
      {"posterior_mean", posterior.mean},
      {"posterior_logvar", posterior.logvar},
      {"posterior_std", posterior.std},
      {"posterior_sample_seed0", sample},
      {"decoded", decoded}};
  for (const auto& [name, got] : checks) {
    ASSERT_EQ(got.sizes(), io.at(name).sizes()) << name;
    const double d = max_abs(got, io.at(name));
    std::printf("AutoencoderKL max |%s - diffusers| = %.3g (tol 1e-4)\n", name.c_str(), d);
    EXPECT_LT(d, 1e-4) << name;
  }
  EXPECT_TRUE(torch::equal(posterior.mode(), posterior.mean));
  // Another seed gives other noise.
  at::Generator gen1 = at::detail::createCPUGenerator(1);
  EXPECT_GT(max_abs(posterior.sample(gen1), io.at("posterior_sample_seed0")), 1e-3);
}

TEST(AutoencoderKL, KeysAreExactlyDiffusersKeys) {
  AutoencoderKL vae(difftrain::models::read_autoencoder_kl_config(kVae + "/config.json"));
  auto file =
      difftrain::io::load_safetensors(kVae + "/diffusion_pytorch_model.safetensors").tensors;
  auto own = difftrain::models::named_tensors(*vae);
  EXPECT_EQ(keys_of(own), keys_of(file));
  EXPECT_EQ(own.size(), 124u);
  for (const auto& [k, v] : file) {
    ASSERT_TRUE(own.count(k)) << k;
    EXPECT_EQ(own.at(k).sizes(), v.sizes()) << k;
  }
}

TEST(AutoencoderKL, NonSquareInputsKeepTheirShape) {
  AutoencoderKL vae = difftrain::models::load_autoencoder_kl(kVae);
  torch::NoGradGuard no_grad;
  torch::manual_seed(0);
  torch::Tensor x = torch::rand({1, 3, 32, 48}) * 2 - 1;
  auto posterior = vae->encode(x);
  EXPECT_EQ(posterior.mean.sizes(), (std::vector<int64_t>{1, 4, 16, 24}));
  torch::Tensor y = vae->decode(posterior.mode());
  EXPECT_EQ(y.sizes(), (std::vector<int64_t>{1, 3, 32, 48}));
  EXPECT_TRUE(torch::isfinite(y).all().item<bool>());
  // A side that is not a multiple of the downsample factor is refused.
  EXPECT_THROW(vae->encode(torch::zeros({1, 3, 32, 47})), c10::Error);
}

TEST(AutoencoderKL, ScalesLatentsWithScalingAndShiftFactor) {
  AutoencoderKLConfig c;
  c.block_out_channels = {32};
  c.scaling_factor = 0.5;
  AutoencoderKL vae(c);
  torch::Tensor z = torch::randn({1, 4, 3, 3});
  EXPECT_TRUE(torch::allclose(vae->scale_latents(z), z * 0.5));
  c.shift_factor = 0.25;
  AutoencoderKL shifted(c);
  EXPECT_TRUE(torch::allclose(shifted->scale_latents(z), (z - 0.25) * 0.5));
  EXPECT_TRUE(torch::allclose(shifted->unscale_latents(shifted->scale_latents(z)), z));
}

// Three blocks (downsample factor 4), two resnets per block, random weights: the layout of keys
// Diffusers would write, and a save/load through safetensors that changes nothing.
TEST(AutoencoderKL, ThreeBlockConfigBuildsAndRoundTripsThroughSafetensors) {
  const std::string dir = temp_dir("vae_three_blocks");
  json j = read_json(kVae + "/config.json");
  j["block_out_channels"] = {32, 64, 64};
  j["down_block_types"] = {"DownEncoderBlock2D", "DownEncoderBlock2D", "DownEncoderBlock2D"};
  j["up_block_types"] = {"UpDecoderBlock2D", "UpDecoderBlock2D", "UpDecoderBlock2D"};
  j["layers_per_block"] = 2;
  j["latent_channels"] = 3;
  write_text(dir + "/config.json", j.dump(2));
  AutoencoderKLConfig c = difftrain::models::read_autoencoder_kl_config(dir + "/config.json");
  EXPECT_EQ(c.downsample_factor(), 4);
  torch::manual_seed(1);
  AutoencoderKL vae(c);
  auto own = difftrain::models::named_tensors(*vae);
  for (const char* key :
       {"encoder.down_blocks.1.resnets.1.conv2.weight",
        "encoder.down_blocks.1.downsamplers.0.conv.weight",
        "encoder.down_blocks.0.resnets.0.norm1.weight",
        "encoder.mid_block.attentions.0.to_out.0.bias",
        "encoder.mid_block.attentions.0.group_norm.weight",
        "encoder.mid_block.resnets.1.conv1.bias", "decoder.up_blocks.0.resnets.2.conv1.weight",
        "decoder.up_blocks.1.upsamplers.0.conv.weight",
        "decoder.up_blocks.2.resnets.0.conv_shortcut.weight",
        "encoder.down_blocks.1.resnets.0.conv_shortcut.weight", "quant_conv.weight",
        "post_quant_conv.bias"}) {
    EXPECT_TRUE(own.count(key)) << key;
  }
  for (const char* key : {"encoder.down_blocks.2.downsamplers.0.conv.weight",
                          "decoder.up_blocks.2.upsamplers.0.conv.weight",
                          "decoder.up_blocks.0.resnets.3.conv1.weight",
                          "encoder.down_blocks.0.resnets.0.time_emb_proj.weight"}) {
    EXPECT_FALSE(own.count(key)) << key;
  }
  EXPECT_EQ(own.at("encoder.conv_out.weight").sizes(), (std::vector<int64_t>{6, 64, 3, 3}));
  EXPECT_EQ(own.at("decoder.conv_in.weight").sizes(), (std::vector<int64_t>{64, 3, 3, 3}));
  // Upsampling in reversed channel order: 64 -> 64 -> 32.
  EXPECT_EQ(own.at("decoder.up_blocks.2.resnets.0.conv1.weight").sizes(),
            (std::vector<int64_t>{32, 64, 3, 3}));
  EXPECT_EQ(own.at("decoder.conv_out.weight").sizes(), (std::vector<int64_t>{3, 32, 3, 3}));

  difftrain::io::TensorMap tensors;
  for (const auto& [k, v] : own) tensors[k] = v.detach();
  difftrain::io::save_safetensors(dir + "/diffusion_pytorch_model.safetensors", tensors);
  AutoencoderKL again = difftrain::models::load_autoencoder_kl(dir);
  EXPECT_EQ(keys_of(difftrain::models::named_tensors(*again)), keys_of(own));

  torch::NoGradGuard no_grad;
  torch::Tensor x = torch::rand({2, 3, 16, 24}) * 2 - 1;
  auto p1 = vae->encode(x);
  auto p2 = again->encode(x);
  EXPECT_EQ(p1.mean.sizes(), (std::vector<int64_t>{2, 3, 4, 6}));
  const double d_mean = max_abs(p1.mean, p2.mean);
  const double d_dec = max_abs(vae->decode(p1.mean), again->decode(p2.mean));
  std::printf("AutoencoderKL 3-block save/load: max diff mean %.3g, decode %.3g (tol 0)\n", d_mean,
              d_dec);
  EXPECT_EQ(d_mean, 0.0);
  EXPECT_EQ(d_dec, 0.0);
  EXPECT_EQ(vae->decode(p1.mean).sizes(), (std::vector<int64_t>{2, 3, 16, 24}));
  fs::remove_all(dir);
}

TEST(AutoencoderKL, OptionalConvsAndMidAttentionFollowTheConfig) {
  AutoencoderKLConfig c;
  c.block_out_channels = {32, 32};
  c.down_block_types = {"DownEncoderBlock2D", "DownEncoderBlock2D"};
  c.up_block_types = {"UpDecoderBlock2D", "UpDecoderBlock2D"};
  c.use_quant_conv = false;
  c.use_post_quant_conv = false;
  c.mid_block_add_attention = false;
  AutoencoderKL vae(c);
  for (const auto& [k, v] : difftrain::models::named_tensors(*vae)) {
    EXPECT_EQ(k.find("quant_conv"), std::string::npos) << k;
    EXPECT_EQ(k.find("attentions"), std::string::npos) << k;
  }
  torch::NoGradGuard no_grad;
  auto posterior = vae->encode(torch::zeros({1, 3, 8, 8}));
  EXPECT_EQ(posterior.mean.sizes(), (std::vector<int64_t>{1, 4, 4, 4}));
  EXPECT_EQ(vae->decode(posterior.mean).sizes(), (std::vector<int64_t>{1, 3, 8, 8}));
}

TEST(AutoencoderKL, ConfigErrorsNameTheFieldAndTheFix) {
  const std::string dir = temp_dir("vae_config");
  const std::string path = dir + "/config.json";
  const json base = read_json(kVae + "/config.json");
  auto error_with = [&](const std::string& key, const json& value) {
    json j = base;
    j[key] = value;
    write_text(path, j.dump());
    return error_of([&] { difftrain::models::read_autoencoder_kl_config(path); });
  };
  std::string msg =
      error_with("down_block_types", {"DownEncoderBlock2D", "AttnDownEncoderBlock2D"});
  EXPECT_NE(msg.find(path + ": field \"down_block_types\" has \"AttnDownEncoderBlock2D\"; "
                            "supported: DownEncoderBlock2D"),
            std::string::npos)
      << msg;
  msg = error_with("up_block_types", {"UpDecoderBlock2D", "UpBlock2D"});
  EXPECT_NE(msg.find("field \"up_block_types\" has \"UpBlock2D\"; supported: UpDecoderBlock2D"),
            std::string::npos)
      << msg;
  msg = error_with("block_out_channels", {32, 48});
  EXPECT_NE(msg.find("field \"norm_num_groups\" (32) must divide every block_out_channels entry "
                     "(48)"),
            std::string::npos)
      << msg;
  msg = error_with("block_out_channels", {32, 64, 64});
  EXPECT_NE(msg.find("field \"down_block_types\" must have one entry per block_out_channels entry "
                     "(3), got 2"),
            std::string::npos)
      << msg;
  msg = error_with("_class_name", "VQModel");
  EXPECT_NE(msg.find("field \"_class_name\" is \"VQModel\"; supported: AutoencoderKL"),
            std::string::npos)
      << msg;
  msg = error_with("layers_per_block", "1");
  EXPECT_NE(msg.find("field \"layers_per_block\" must be an integer, got \"1\""), std::string::npos)
      << msg;
  msg = error_with("act_fn", "tanh");
  EXPECT_NE(msg.find("field \"act_fn\" is \"tanh\"; supported: silu"), std::string::npos) << msg;
  msg = error_with("use_quant_conv", 1);
  EXPECT_NE(msg.find("field \"use_quant_conv\" must be true or false"), std::string::npos) << msg;
  write_text(path, "[1, 2");
  msg = error_of([&] { difftrain::models::read_autoencoder_kl_config(path); });
  EXPECT_NE(msg.find(path + ": not valid JSON"), std::string::npos) << msg;

  // A folder without weights, and one with pickle weights only.
  write_text(path, base.dump());
  msg = error_of([&] { difftrain::models::load_autoencoder_kl(dir); });
  EXPECT_NE(msg.find("diffusion_pytorch_model.safetensors: no such file"), std::string::npos)
      << msg;
  write_text(dir + "/diffusion_pytorch_model.bin", "x");
  msg = error_of([&] { difftrain::models::load_autoencoder_kl(dir); });
  EXPECT_NE(msg.find("only pickle weights"), std::string::npos) << msg;
  fs::remove_all(dir);
}

TEST(AutoencoderKL, LoadingIsStrict) {
  const std::string dir = temp_dir("vae_strict");
  fs::copy_file(kVae + "/config.json", dir + "/config.json");
  auto w = difftrain::io::load_safetensors(kVae + "/diffusion_pytorch_model.safetensors").tensors;
  w.erase("decoder.up_blocks.1.resnets.1.norm2.bias");
  w["encoder.conv_in.weight"] = torch::zeros({32, 3, 1, 1});
  const std::string file = dir + "/diffusion_pytorch_model.safetensors";
  difftrain::io::save_safetensors(file, w);
  std::string msg = error_of([&] { difftrain::models::load_autoencoder_kl(dir); });
  EXPECT_NE(msg.find(file + ": the weights do not match the model's config; missing keys: "
                            "decoder.up_blocks.1.resnets.1.norm2.bias"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("wrong shapes: encoder.conv_in.weight (file [32, 3, 1, 1], model [32, 3, 3, "
                     "3])"),
            std::string::npos)
      << msg;
  fs::remove_all(dir);
}

}  // namespace
