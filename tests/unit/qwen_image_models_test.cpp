// Qwen-Image's three models against the fixtures of tests/golden/qwen_image (Diffusers' own code
// and a plain-torch transcription of Transformers' Qwen2.5-VL, see its README):
// QwenImageTransformer2DModel (masks, odd grids, Edit's two images, zero_cond_t, Layered's
// additional_t_cond + layer-3D RoPE, bf16, gradient checkpointing), AutoencoderKLQwenImage (image,
// batch, 5-frame video through the feature cache, tiled encode and decode, latents
// normalisation), and the Qwen2.5-VL language model as a text encoder (right and left padding,
// every hidden state, bf16, multimodal RoPE positions).
#include "difftrain/io/safetensors.h"
#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"
#include "difftrain/models/text_encoders/qwen3_model.h"
#include "difftrain/models/transformers/qwen_image_transformer.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <filesystem>
#include <fstream>

namespace qwen_image_models_test {

using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::max_abs;
using difftrain::test::temp_dir;
using difftrain::test::write_text;
namespace fs = std::filesystem;
namespace m = difftrain::models;

const std::string kQwenDir = kGoldenDir + "qwen_image";
const std::string kTiny = kQwenDir + "/tiny_qwen_image";

difftrain::io::TensorMap file(const std::string& path) {
  static std::map<std::string, difftrain::io::TensorMap> cache;
  auto it = cache.find(path);
  if (it == cache.end()) {
    it = cache.emplace(path, difftrain::io::load_safetensors(path).tensors).first;
  }
  return it->second;
}

std::vector<m::QwenImageGrids> grids_of(const torch::Tensor& shapes) {
  std::vector<m::QwenImageGrids> out;
  for (int64_t b = 0; b < shapes.size(0); ++b) {
    m::QwenImageGrids g;
    for (int64_t k = 0; k < shapes.size(1); ++k) {
      g.push_back({shapes[b][k][0].item<int64_t>(), shapes[b][k][1].item<int64_t>(),
                   shapes[b][k][2].item<int64_t>()});
    }
    out.push_back(g);
  }
  return out;
}

torch::Tensor run_case(m::QwenImageTransformer2DModel& model, const difftrain::io::TensorMap& f,
                       const std::string& k, torch::Dtype dtype = torch::kFloat32) {
  const auto get = [&](const std::string& name) {
    const auto it = f.find(k + "." + name);
    return it == f.end() ? torch::Tensor() : it->second;
  };
  return model
      ->forward(get("hidden_states").to(dtype), get("encoder_hidden_states").to(dtype),
                get("encoder_hidden_states_mask"), get("timestep"), grids_of(get("img_shapes")),
                get("additional_t_cond"))
      .to(torch::kFloat32);
}

void expect_case(m::QwenImageTransformer2DModel& model, const std::string& fixture,
                 const std::string& k, double tol) {
  const auto& f = file(fixture);
  const auto out = run_case(model, f, k);
  const auto& want = f.at(k + ".out");
  ASSERT_EQ(out.sizes(), want.sizes()) << k;
  const double diff = max_abs(out, want);
  std::cout << "case " << k << " max abs diff " << diff << " (tol " << tol << ")\n";
  EXPECT_LT(diff, tol) << k;
}

TEST(QwenImageTransformer, EveryForwardCaseMatchesDiffusers) {
  torch::NoGradGuard no_grad;
  auto model = m::load_qwen_image_transformer(kTiny + "/transformer");
  for (const char* k : {"a", "b", "c", "edit"}) {
    expect_case(model, kTiny + "/forward.safetensors", k, 2e-5);
  }
}

TEST(QwenImageTransformer, RopeTablesMatchDiffusersForTargetAndReferenceImages) {
  const auto& f = file(kTiny + "/forward.safetensors");
  for (const char* k : {"a", "b", "c", "edit"}) {
    const std::string c = k;
    const auto grids = grids_of(f.at(c + ".img_shapes"));
    const int64_t S = f.at(c + ".encoder_hidden_states").size(1);
    const auto [img, txt] = m::qwen_image_rope(grids[0], S, {4, 6, 6});
    // Diffusers keeps one complex factor per pair; ours repeat each for the interleaved pair.
    const auto pick = [](const torch::Tensor& t) {
      return t.index(
          {torch::indexing::Slice(), torch::indexing::Slice(0, torch::indexing::None, 2)});
    };
    EXPECT_LT(max_abs(pick(img.cos), f.at(c + ".inter.img_freqs_cos")), 1e-6) << c;
    EXPECT_LT(max_abs(pick(img.sin), f.at(c + ".inter.img_freqs_sin")), 1e-6) << c;
    EXPECT_LT(max_abs(pick(txt.cos), f.at(c + ".inter.txt_freqs_cos")), 1e-6) << c;
    EXPECT_LT(max_abs(pick(txt.sin), f.at(c + ".inter.txt_freqs_sin")), 1e-6) << c;
  }
}

TEST(QwenImageTransformer, ZeroCondAndLayeredConfigsMatchDiffusers) {
  torch::NoGradGuard no_grad;
  auto zc = m::load_qwen_image_transformer(kTiny + "/transformer_zero_cond");
  EXPECT_TRUE(zc->options().zero_cond_t);
  expect_case(zc, kTiny + "/forward_zero_cond.safetensors", "zc_edit", 2e-5);
  auto layered = m::load_qwen_image_transformer(kTiny + "/transformer_layered");
  EXPECT_TRUE(layered->options().use_additional_t_cond && layered->options().use_layer3d_rope);
  for (const char* k : {"layered", "layered_t1"}) {
    expect_case(layered, kTiny + "/forward_layered.safetensors", k, 2e-5);
  }
  // Layered's condition image (the last) sits at frame -1 of the RoPE.
  const auto& f = file(kTiny + "/forward_layered.safetensors");
  const auto [img, txt] =
      m::qwen_image_rope(grids_of(f.at("layered.img_shapes"))[0], 6, {4, 6, 6}, true);
  EXPECT_LT(max_abs(img.cos.index({torch::indexing::Slice(),
                                   torch::indexing::Slice(0, torch::indexing::None, 2)}),
                    f.at("layered.inter.img_freqs_cos")),
            1e-6);
}

// bf16 rounds differently in LibTorch's and PyTorch's kernels, so: as close to float32 on average
// as Diffusers' bf16 is, and within a bf16 step on average of it.
void expect_bf16(const torch::Tensor& got, const torch::Tensor& want_bf16,
                 const torch::Tensor& want_f32, const torch::Tensor& keep,
                 const std::string& what) {
  const auto mean_abs = [&](const torch::Tensor& a, const torch::Tensor& b) {
    return (a.to(torch::kFloat64) - b.to(torch::kFloat64))
        .abs()
        .masked_select(keep)
        .mean()
        .item<double>();
  };
  const double ours = mean_abs(got, want_f32), theirs = mean_abs(want_bf16, want_f32);
  const double apart = mean_abs(got, want_bf16);
  std::cout << what << " bf16: ours vs float32 " << ours << ", reference bf16 vs float32 " << theirs
            << ", ours vs reference bf16 " << apart << "\n";
  EXPECT_LT(ours, 1.5 * theirs) << what;
  EXPECT_LT(apart, 0.01) << what;
}

TEST(QwenImageTransformer, Bf16IsWithinItsPrecisionOfDiffusersBf16) {
  torch::NoGradGuard no_grad;
  auto model = m::load_qwen_image_transformer(kTiny + "/transformer", torch::kBFloat16);
  const auto& f = file(kTiny + "/forward.safetensors");
  const auto out = run_case(model, f, "a", torch::kBFloat16);
  expect_bf16(out, f.at("a_bf16.out"), f.at("a.out"), torch::ones_like(out).to(torch::kBool),
              "transformer");
}

TEST(QwenImageTransformer, MaskedTextTokensDoNotChangeTheOutput) {
  auto model = m::load_qwen_image_transformer(kTiny + "/transformer");
  const auto& f = file(kTiny + "/forward.safetensors");
  // Sample 1 of case a has its last 3 text tokens masked: changing them changes nothing.
  torch::Tensor txt = f.at("a.encoder_hidden_states").clone();
  txt[1].narrow(0, 4, 3).normal_();
  torch::NoGradGuard no_grad;
  const auto out =
      model->forward(f.at("a.hidden_states"), txt, f.at("a.encoder_hidden_states_mask"),
                     f.at("a.timestep"), grids_of(f.at("a.img_shapes")));
  EXPECT_LT(max_abs(out[1], f.at("a.out")[1]), 2e-5);
}

TEST(QwenImageTransformer, GradientCheckpointingGivesTheSameGradients) {
  const auto& f = file(kTiny + "/forward.safetensors");
  auto grads = [&](bool ckpt) {
    auto model = m::load_qwen_image_transformer(kTiny + "/transformer");
    model->train();
    model->set_gradient_checkpointing(ckpt);
    const auto out = run_case(model, f, "a");
    out.pow(2).mean().backward();
    // The last block's text-stream output feeds nothing, so its text MLP gets no gradient.
    std::vector<torch::Tensor> g;
    for (const auto& p : model->parameters()) {
      g.push_back(p.grad().defined() ? p.grad().clone() : torch::zeros_like(p));
    }
    return g;
  };
  const auto plain = grads(false), ckpt = grads(true);
  ASSERT_EQ(plain.size(), ckpt.size());
  double worst = 0;
  for (size_t i = 0; i < plain.size(); ++i) worst = std::max(worst, max_abs(plain[i], ckpt[i]));
  EXPECT_LT(worst, 1e-6);
  EXPECT_GT(plain.front().abs().max().item<double>(), 0);
}

TEST(QwenImageTransformer, BadInputsAndConfigsAreRefusedWithTheirReason) {
  auto model = m::load_qwen_image_transformer(kTiny + "/transformer");
  const auto& f = file(kTiny + "/forward.safetensors");
  torch::NoGradGuard no_grad;
  const auto msg = error_of([&] {
    model->forward(f.at("a.hidden_states"), f.at("a.encoder_hidden_states"), {}, f.at("a.timestep"),
                   {{{1, 4, 5}}, {{1, 4, 5}}});
  });
  EXPECT_NE(msg.find("covers 20 tokens but hidden_states has 24"), std::string::npos) << msg;
  const auto tc = error_of([&] {
    model->forward(f.at("a.hidden_states"), f.at("a.encoder_hidden_states"), {}, f.at("a.timestep"),
                   grids_of(f.at("a.img_shapes")), torch::zeros({2}, torch::kInt64));
  });
  EXPECT_NE(tc.find("does not set use_additional_t_cond"), std::string::npos) << tc;
  const auto dir = temp_dir("qwen_image_bad_config");
  write_text(dir + "/config.json", R"({"attention_head_dim": 16, "axes_dims_rope": [4, 6, 8]})");
  const auto cfg = error_of([&] { m::QwenImageTransformerOptions::load(dir + "/config.json"); });
  EXPECT_NE(cfg.find("axes_dims_rope"), std::string::npos) << cfg;
  EXPECT_NE(cfg.find("sum to attention_head_dim 16"), std::string::npos) << cfg;
  write_text(dir + "/config.json", R"({"guidance_embeds": true})");
  const auto ge = error_of([&] { m::QwenImageTransformerOptions::load(dir + "/config.json"); });
  EXPECT_NE(ge.find("guidance_embeds"), std::string::npos) << ge;
}

// ------------------------------------------------------------------ VAE

// The tiny decoder amplifies float32 rounding (its last conv is wide on purpose, so that the clamp
// bites): Diffusers' float32 output is within 3e-5 of the same maths in float64, and ours within
// 2e-4. So the semantics are checked against our float64 run (tight), float32 against Diffusers
// loosely.
void expect_decode(m::AutoencoderKLQwenImage& vae32, m::AutoencoderKLQwenImage& vae64,
                   const torch::Tensor& z, const torch::Tensor& want, const std::string& what) {
  const auto d32 = vae32->decode(z);
  const auto d64 = vae64->decode(z.to(torch::kFloat64));
  ASSERT_EQ(d32.sizes(), want.sizes()) << what;
  const double semantic = max_abs(want.to(torch::kFloat64), d64);
  const double f32 = max_abs(d32, want);
  std::cout << what << " decode: Diffusers vs our float64 " << semantic
            << ", our float32 vs Diffusers " << f32 << "\n";
  EXPECT_LT(semantic, 6e-5) << what;
  EXPECT_LT(f32, 3e-4) << what;
}

TEST(QwenImageVae, EncodeAndDecodeMatchDiffusersForImagesBatchesAndVideo) {
  torch::NoGradGuard no_grad;
  auto vae = m::load_autoencoder_kl_qwen_image(kTiny + "/vae");
  auto vae64 = m::load_autoencoder_kl_qwen_image(kTiny + "/vae", torch::kFloat64);
  const auto& f = file(kTiny + "/vae_cases.safetensors");
  for (const char* k : {"image", "batch", "video"}) {
    const std::string c = k;
    const auto post = vae->encode(f.at(c + ".x"));
    ASSERT_EQ(post.mean.sizes(), f.at(c + ".mean").sizes()) << c;
    const double dm = max_abs(post.mean, f.at(c + ".mean"));
    const double ds = max_abs(post.std, f.at(c + ".std"));
    std::cout << c << ": encode mean " << dm << ", std " << ds << "\n";
    EXPECT_LT(dm, 2e-5) << c;
    EXPECT_LT(ds, 2e-5) << c;
    expect_decode(vae, vae64, f.at(c + ".mean"), f.at(c + ".sample"), c);
  }
  // Some decoded values really are clamped.
  EXPECT_GT(f.at("image.decoder_raw").abs().max().item<double>(), 1.0);
  EXPECT_LT(max_abs(vae->normalize_latents(f.at("image.mean")), f.at("image.latents_normalised")),
            1e-6);
  EXPECT_LT(max_abs(vae->denormalize_latents(f.at("image.latents_normalised")), f.at("image.mean")),
            1e-5);
}

TEST(QwenImageVae, TiledEncodeAndDecodeMatchDiffusers) {
  torch::NoGradGuard no_grad;
  auto vae = m::load_autoencoder_kl_qwen_image(kTiny + "/vae");
  auto vae64 = m::load_autoencoder_kl_qwen_image(kTiny + "/vae", torch::kFloat64);
  const auto& f = file(kTiny + "/vae_cases.safetensors");
  vae->enable_tiling({32, 32, 24, 24});
  vae64->enable_tiling({32, 32, 24, 24});
  const auto post = vae->encode(f.at("tiled_encode.x"));
  const double de = max_abs(post.mean, f.at("tiled_encode.mean"));
  std::cout << "tiled encode " << de << "\n";
  EXPECT_LT(de, 2e-5);
  expect_decode(vae, vae64, f.at("tiled_decode.z"), f.at("tiled_decode.sample"), "tiled");
  // Tiling changes the result (the fixture's untiled mean differs), so the tiles really blend.
  EXPECT_GT(max_abs(f.at("tiled_encode.mean"), f.at("tiled_encode.mean_untiled")), 1e-4);
}

TEST(QwenImageVae, BadConfigsAndShapesAreRefused) {
  const auto dir = temp_dir("qwen_image_vae_bad");
  write_text(dir + "/config.json", R"({"dim_mult": [1, 2, 4, 4], "temperal_downsample": [false]})");
  const auto msg = error_of([&] { m::AutoencoderKLQwenImageConfig::load(dir + "/config.json"); });
  EXPECT_NE(msg.find("temperal_downsample"), std::string::npos) << msg;
  write_text(dir + "/config.json", R"({"z_dim": 4})");
  const auto stats = error_of([&] { m::AutoencoderKLQwenImageConfig::load(dir + "/config.json"); });
  EXPECT_NE(stats.find("latents_mean"), std::string::npos) << stats;
  auto vae = m::load_autoencoder_kl_qwen_image(kTiny + "/vae");
  const auto shape = error_of([&] { vae->encode(torch::zeros({1, 3, 32, 32})); });
  EXPECT_NE(shape.find("[B, 3, frames, H, W]"), std::string::npos) << shape;
}

// ------------------------------------------------------------------ text encoder

TEST(QwenImageTextEncoder, Qwen25VlLanguageModelMatchesTheTranscription) {
  torch::NoGradGuard no_grad;
  auto model = m::load_qwen3_model(kQwenDir + "/text_encoder");
  const auto& o = model->options();
  EXPECT_EQ(o.architecture(), "Qwen2_5_VLForConditionalGeneration");
  EXPECT_FALSE(o.qk_norm());
  EXPECT_TRUE(o.attention_bias());
  EXPECT_FALSE(o.o_proj_bias());
  EXPECT_EQ(o.mrope_section(), (std::vector<int64_t>{2, 3, 3}));
  const auto& f = file(kQwenDir + "/text_encoder_expected.safetensors");
  // Right padding: every hidden state at every position (pads included).
  const auto r = model->forward(f.at("input_ids"), f.at("attention_mask"));
  ASSERT_EQ(r.hidden_states.size(), 4u);
  for (size_t i = 0; i < 4; ++i) {
    const double d = max_abs(r.hidden_states[i], f.at("hidden_states." + std::to_string(i)));
    std::cout << "hidden_states." << i << " max abs diff " << d << "\n";
    EXPECT_LT(d, 2e-5) << i;
  }
  // Left padding: positions count real tokens only, so real tokens equal the right-padded ones.
  const auto left = model->forward(f.at("input_ids_left"), f.at("attention_mask_left"));
  const auto keep = f.at("attention_mask_left").to(torch::kBool);
  EXPECT_LT(
      max_abs(left.hidden_states.back().index({keep}), f.at("hidden_states_left.3").index({keep})),
      2e-5);
  const auto nopad = model->forward(f.at("input_ids_nopad"));
  EXPECT_LT(max_abs(nopad.hidden_states.back(), f.at("hidden_states_nopad.3")), 2e-5);
  // Multimodal positions (an image's 3-D grid, its tokens left as text embeddings).
  const auto mr = model->forward(f.at("mrope.input_ids"), f.at("mrope.attention_mask"), -1,
                                 f.at("mrope.position_ids"));
  EXPECT_LT(max_abs(mr.hidden_states.back(), f.at("mrope.hidden_states.3")), 2e-5);
}

TEST(QwenImageTextEncoder, Bf16IsWithinItsPrecision) {
  torch::NoGradGuard no_grad;
  auto model = m::load_qwen3_model(kQwenDir + "/text_encoder", torch::kBFloat16);
  const auto& f = file(kQwenDir + "/text_encoder_expected.safetensors");
  const auto r = model->forward(f.at("input_ids"), f.at("attention_mask"));
  const auto keep =
      f.at("attention_mask").to(torch::kBool).unsqueeze(-1).expand_as(f.at("hidden_states.3"));
  expect_bf16(r.hidden_states.back(), f.at("hidden_states_bf16.3"), f.at("hidden_states.3"), keep,
              "text encoder");
}

TEST(QwenImageTextEncoder, RecentTransformersKeyLayoutLoadsToo) {
  // Transformers >= 4.52 saves the language model under model.language_model. and the vision
  // tower under model.visual.: the same weights, renamed.
  const auto dir = temp_dir("qwen25vl_new_layout");
  fs::copy_file(kQwenDir + "/text_encoder/config.json", dir + "/config.json");
  difftrain::io::TensorMap renamed;
  for (const auto& shard :
       {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    for (const auto& [k, v] :
         difftrain::io::load_safetensors(kQwenDir + "/text_encoder/" + shard).tensors) {
      std::string key = k;
      if (key.rfind("visual.", 0) == 0)
        key = "model." + key;
      else if (key.rfind("model.", 0) == 0)
        key = "model.language_model." + key.substr(6);
      renamed[key] = v;
    }
  }
  difftrain::io::save_safetensors(dir + "/model.safetensors", renamed);
  torch::NoGradGuard no_grad;
  auto model = m::load_qwen3_model(dir);
  const auto& f = file(kQwenDir + "/text_encoder_expected.safetensors");
  const auto r = model->forward(f.at("input_ids_nopad"));
  EXPECT_LT(max_abs(r.hidden_states.back(), f.at("hidden_states_nopad.3")), 2e-5);
}

}  // namespace qwen_image_models_test
