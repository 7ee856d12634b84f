// Wan's models against Diffusers' own (tests/golden/wan: make_transformer.py, make_vae.py):
// WanTransformer3DModel for Wan 2.1 text-to-video (one frame, five frames at an odd grid, a batch
// of two timesteps), 2.1 image-to-video (the CLIP-feature branch), 2.2's 5B text-image-to-video
// (per-token timesteps), and bf16 as from_pretrained leaves it (the float32 modules kept) and as
// .to(bfloat16) casts it; config refusals.
#include "difftrain/io/safetensors.h"
#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"
#include "difftrain/models/text_encoders/t5_encoder.h"
#include "difftrain/models/tokenizers/t5_tokenizer.h"
#include "difftrain/models/transformers/wan_transformer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <iostream>

namespace wan_models_test {

using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::max_abs;
namespace models = difftrain::models;

const std::string kTinyWan = kGoldenDir + "wan/tiny_wan";

nlohmann::json read_json(const std::string& path) {
  std::ifstream in(path);
  return nlohmann::json::parse(in);
}

difftrain::io::TensorMap forward_cases() {
  static const difftrain::io::TensorMap f =
      difftrain::io::load_safetensors(kTinyWan + "/forward.safetensors").tensors;
  return f;
}

torch::Tensor run_case(models::WanTransformer3DModel& m, const difftrain::io::TensorMap& f,
                       const std::string& name) {
  torch::NoGradGuard no_grad;
  const auto image = f.count(name + ".encoder_hidden_states_image")
                         ? f.at(name + ".encoder_hidden_states_image")
                         : torch::Tensor();
  return m
      ->forward(f.at(name + ".hidden_states"), f.at(name + ".timestep"),
                f.at(name + ".encoder_hidden_states"), image)
      .to(torch::kFloat32);
}

TEST(WanTransformer, Float32CasesMatchDiffusers) {
  const auto f = forward_cases();
  const auto cases = read_json(kTinyWan + "/forward.json").at("cases");
  int checked = 0;
  for (const auto& [name, c] : cases.items()) {
    if (c.at("dtype").get<std::string>() != "float32") continue;
    SCOPED_TRACE(name);
    auto m = models::load_wan_transformer(kTinyWan + "/" + c.at("folder").get<std::string>());
    m->eval();
    const auto out = run_case(m, f, name);
    const auto& want = f.at(name + ".out");
    ASSERT_EQ(out.sizes(), want.sizes());
    const double d = max_abs(out, want);
    std::cout << name << ": max abs diff " << d << " (outputs up to "
              << want.abs().max().item<double>() << ")\n";
    EXPECT_LT(d, 2e-5);
    ++checked;
  }
  EXPECT_EQ(checked, 7);
}

TEST(WanTransformer, Bf16KeepsTheFloat32ModulesAsFromPretrainedDoes) {
  const auto f = forward_cases();
  // from_pretrained(torch_dtype=bf16): time_embedder, the scale/shift tables, norm2 in float32.
  auto kept = models::load_wan_transformer(kTinyWan + "/transformer", torch::kBFloat16);
  kept->eval();
  for (const auto& p : kept->named_parameters()) {
    const bool fp32 = p.key().find("time_embedder") != std::string::npos ||
                      p.key().find("scale_shift_table") != std::string::npos ||
                      p.key().find("norm2") != std::string::npos;
    EXPECT_EQ(p.value().scalar_type(), fp32 ? torch::kFloat32 : torch::kBFloat16) << p.key();
  }
  // bf16 rounds outputs near 3 to steps of 2^-6, so single values may differ by a step.
  const auto& f32 = f.at("t2v_f5.out");  // the same inputs in float32
  const auto mean_abs = [](const torch::Tensor& x, const torch::Tensor& y) {
    return (x.to(torch::kFloat64) - y.to(torch::kFloat64)).abs().mean().item<double>();
  };
  const auto a = run_case(kept, f, "t2v_bf16");
  // .to(bfloat16): everything in bf16.
  auto cast = models::load_wan_transformer(kTinyWan + "/transformer");
  cast->to(torch::kBFloat16);
  cast->eval();
  const auto b = run_case(cast, f, "t2v_bf16_to");
  for (const auto& [got, key] :
       {std::pair<torch::Tensor, std::string>{a, "t2v_bf16"}, {b, "t2v_bf16_to"}}) {
    const auto& want = f.at(key + ".out");
    const double ours = mean_abs(got, want), ref = mean_abs(want, f32);
    std::cout << key << ": mean abs diff to Diffusers' bf16 " << ours << " (max "
              << max_abs(got, want) << "); Diffusers' bf16 vs float32 " << ref << "\n";
    // Kernels differ (oneDNN vs OpenBLAS bf16 products round differently), so a third of the
    // values differ by a step: closer to Diffusers' bf16 than float32 is, and no less accurate.
    EXPECT_LT(ours, 0.75 * ref) << key;
    EXPECT_LT(mean_abs(got, f32), 1.5 * ref) << key;
    EXPECT_LE(max_abs(got, want), 2 * 0.015625) << key;
  }
}

TEST(WanTransformer, RefusesBadConfigsAndInputs) {
  nlohmann::json j = read_json(kTinyWan + "/transformer/config.json");
  j["qk_norm"] = "rms_norm";
  EXPECT_NE(error_of([&] {
              models::WanTransformerOptions::parse(j, "cfg.json");
            }).find("rms_norm_across_heads"),
            std::string::npos);
  j = read_json(kTinyWan + "/transformer/config.json");
  j["image_dim"] = 48;
  EXPECT_NE(error_of([&] {
              models::WanTransformerOptions::parse(j, "cfg.json");
            }).find("added_kv_proj_dim"),
            std::string::npos);
  auto m = models::load_wan_transformer(kTinyWan + "/transformer");
  torch::NoGradGuard no_grad;
  EXPECT_NE(
      error_of([&] {
        m->forward(torch::zeros({1, 16, 1, 3, 4}), torch::zeros({1}), torch::zeros({1, 4, 32}));
      }).find("multiples of the patch"),
      std::string::npos);
  EXPECT_NE(error_of([&] {
              m->forward(torch::zeros({1, 16, 1, 4, 4}), torch::zeros({1}),
                         torch::zeros({1, 4, 32}), torch::zeros({1, 257, 48}));
            }).find("not an I2V model"),
            std::string::npos);
}

}  // namespace wan_models_test

namespace wan_models_test {

// AutoencoderKLWan 2.1 is Qwen-Image's causal VAE (the same design and keys): its folder loads
// into models::AutoencoderKLQwenImage.
TEST(WanVae21, EncodeDecodeEqualDiffusersForImagesClipsAndBatches) {
  torch::NoGradGuard no_grad;
  const auto f = difftrain::io::load_safetensors(kTinyWan + "/vae_cases.safetensors").tensors;
  auto vae = models::load_autoencoder_kl_qwen_image(kTinyWan + "/vae");
  vae->eval();
  for (const std::string name : {"vae.image", "vae.f5", "vae.f9", "vae.batch2"}) {
    SCOPED_TRACE(name);
    const auto post = vae->encode(f.at(name + ".x"));
    EXPECT_LT(max_abs(post.mean, f.at(name + ".mean")), 2e-5);
    EXPECT_LT(max_abs(post.logvar, f.at(name + ".logvar")), 2e-5);
    EXPECT_LT(max_abs(vae->normalize_latents(post.mean), f.at(name + ".latents_normalised")), 1e-4);
    const auto decoded = vae->decode(f.at(name + ".mean"));
    EXPECT_LT(max_abs(decoded, f.at(name + ".sample")), 1e-4);
  }
  // Tiled decode as enable_tiling(32, 32, 24, 24) does it.
  models::QwenImageVaeTiling tiling;
  tiling.tile_sample_min_height = 32;
  tiling.tile_sample_min_width = 32;
  tiling.tile_sample_stride_height = 24;
  tiling.tile_sample_stride_width = 24;
  vae->enable_tiling(tiling);
  EXPECT_LT(max_abs(vae->decode(f.at("vae.tiled_decode.z")), f.at("vae.tiled_decode.sample")),
            1e-4);
  EXPECT_LT(max_abs(vae->encode(f.at("vae.tiled_encode.x")).mean, f.at("vae.tiled_encode.mean")),
            2e-5);
}

// Wan 2.2's 48-channel VAE (is_residual, patch_size 2, decoder_base_dim): the patchify, the
// residual blocks' averaged / duplicated shortcuts (the first latent frame's one frame), 16x
// spatial compression, the tiled paths in the patchified space.
TEST(WanVae22, EncodeDecodeEqualDiffusersForImagesClipsAndBatches) {
  torch::NoGradGuard no_grad;
  const auto f = difftrain::io::load_safetensors(kTinyWan + "/vae_cases.safetensors").tensors;
  auto vae = models::load_autoencoder_kl_qwen_image(kTinyWan + "/vae_22");
  vae->eval();
  EXPECT_EQ(vae->config().spatial_compression_ratio(), 16);
  EXPECT_EQ(vae->config().temporal_compression_ratio(), 4);
  EXPECT_EQ(vae->config().image_channels(), 3);
  for (const std::string name : {"vae_22.image", "vae_22.f5", "vae_22.f9", "vae_22.batch2"}) {
    SCOPED_TRACE(name);
    const auto post = vae->encode(f.at(name + ".x"));
    EXPECT_LT(max_abs(post.mean, f.at(name + ".mean")), 2e-5);
    EXPECT_LT(max_abs(post.logvar, f.at(name + ".logvar")), 2e-5);
    EXPECT_LT(max_abs(vae->normalize_latents(post.mean), f.at(name + ".latents_normalised")), 1e-4);
    const auto decoded = vae->decode(f.at(name + ".mean"));
    EXPECT_LT(max_abs(decoded, f.at(name + ".sample")), 1e-4);
  }
  models::QwenImageVaeTiling tiling;
  tiling.tile_sample_min_height = 32;
  tiling.tile_sample_min_width = 32;
  tiling.tile_sample_stride_height = 24;
  tiling.tile_sample_stride_width = 24;
  vae->enable_tiling(tiling);
  EXPECT_LT(
      max_abs(vae->encode(f.at("vae_22.tiled_encode.x")).mean, f.at("vae_22.tiled_encode.mean")),
      2e-5);
  tiling.tile_sample_min_height = 64;
  tiling.tile_sample_min_width = 64;
  tiling.tile_sample_stride_height = 48;
  tiling.tile_sample_stride_width = 48;
  vae->enable_tiling(tiling);
  EXPECT_LT(max_abs(vae->decode(f.at("vae_22.tiled_decode.z")), f.at("vae_22.tiled_decode.sample")),
            1e-4);
  // Sizes the patchify cannot take, in one line.
  EXPECT_NE(error_of([&] {
              (void)vae->encode(torch::zeros({1, 3, 1, 33, 32}));
            }).find("divisible by patch_size 2"),
            std::string::npos);
}

}  // namespace wan_models_test

namespace wan_models_test {

const std::string kWanDir = kGoldenDir + "wan";

// UMT5 (Wan's text encoder): T5 v1.1's blocks with a relative-position table in every block,
// run with the padding mask (make_text_encoder.py: a plain-torch transcription of Transformers'
// modeling_umt5.py checked against Wan's own t5.py restated in float64).
TEST(Umt5Encoder, HiddenStatesEqualTransformersWithAndWithoutTheMask) {
  torch::NoGradGuard no_grad;
  const auto f =
      difftrain::io::load_safetensors(kWanDir + "/text_encoder_expected.safetensors").tensors;
  auto enc = models::load_t5_encoder(kTinyWan + "/text_encoder");
  ASSERT_TRUE(enc->options().per_layer_position_bias());
  const auto out = enc->forward_all(f.at("input_ids"), f.at("attention_mask"));
  ASSERT_EQ(out.position_biases.size(), 2u);
  EXPECT_LT(max_abs(out.position_biases[0], f.at("position_bias.0")), 1e-6);
  EXPECT_LT(max_abs(out.position_biases[1], f.at("position_bias.1")), 1e-6);
  for (int i = 0; i < 3; ++i) {
    EXPECT_LT(max_abs(out.hidden_states[static_cast<size_t>(i)],
                      f.at("hidden_states." + std::to_string(i))),
              1e-5)
        << i;
  }
  EXPECT_LT(max_abs(out.last_hidden_state, f.at("last_hidden_state")), 1e-5);
  EXPECT_LT(max_abs(out.last_block_output, f.at("last_block_output")), 1e-5);
  EXPECT_LT(max_abs(enc->forward(f.at("input_ids")), f.at("last_hidden_state_nomask")), 1e-5);
  EXPECT_LT(max_abs(enc->forward(f.at("input_ids_nopad")), f.at("last_hidden_state_nopad")), 1e-5);
  EXPECT_LT(max_abs(enc->forward(f.at("input_ids_long"), f.at("attention_mask_long")),
                    f.at("last_hidden_state_long")),
            1e-5);
  // The buckets of offsets -600..600.
  EXPECT_TRUE(
      torch::equal(models::t5_relative_position_bucket(f.at("bucket_relative_position"), 32, 128),
                   f.at("bucket")));
  // bf16 as from_pretrained(torch_dtype=bf16) runs it (every weight bf16).
  auto bf16 = models::load_t5_encoder(kTinyWan + "/text_encoder", torch::kBFloat16);
  const auto b = bf16->forward(f.at("input_ids"), f.at("attention_mask")).to(torch::kFloat32);
  const double db = max_abs(b, f.at("last_hidden_state_bf16"));
  const double ref = max_abs(f.at("last_hidden_state_bf16"), f.at("last_hidden_state"));
  std::cout << "UMT5 bf16: max abs diff to Transformers' bf16 " << db << "; bf16 vs float32 " << ref
            << "\n";
  EXPECT_LT(db, 0.5 * ref);
}

TEST(Umt5Tokenizer, IdsEqualTransformersT5Tokenizer) {
  const auto tok = models::T5Tokenizer::load(kTinyWan + "/tokenizer");
  const auto j = read_json(kWanDir + "/prompts_expected.json");
  int checked = 0;
  for (const auto& c : j.at("tokenizer_cases")) {
    if (c.at("splits_added_tokens").get<bool>()) continue;  // not split out (t5_tokenizer.h)
    const std::string text = c.at("text").get<std::string>();
    SCOPED_TRACE(text);
    EXPECT_EQ(tok.piece_ids(text), c.at("token_ids").get<std::vector<int64_t>>());
    EXPECT_EQ(tok.encode(text, 32), c.at("input_ids_32").get<std::vector<int64_t>>());
    ++checked;
  }
  EXPECT_EQ(checked, 8);
}

}  // namespace wan_models_test
