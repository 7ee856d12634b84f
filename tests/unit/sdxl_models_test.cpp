// SDXL's parts against the Diffusers 0.31 / Transformers reference (tests/golden/sdxl, copied
// from ../shared/fixtures/sdxl): both tokenizers, CLIPTextModel and CLIPTextModelWithProjection,
// the UNet with "text_time" added conditioning, and the VAE. Tolerances are the README's.

#include "difftrain/io/safetensors.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/models/tokenizers/clip_tokenizer.h"
#include "difftrain/models/unets/unet.h"
#include "sdxl_fixture.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

namespace difftrain {
namespace {

using test::max_abs;

using difftrain::test::kTinySdxl;

TEST(SdxlModels, TokenizersMatchTransformers) {
  const auto cases = test::read_json(kTinySdxl + "/tokenizer_cases.json");
  const auto tok = models::ClipTokenizer::from_folder(kTinySdxl + "/tokenizer");
  const auto tok2 = models::ClipTokenizer::from_folder(kTinySdxl + "/tokenizer_2");
  EXPECT_EQ(tok.pad_id(), 49407);
  EXPECT_EQ(tok2.pad_id(), 0);
  ASSERT_GE(cases["cases"].size(), 8u);
  for (const auto& c : cases["cases"]) {
    const std::string prompt = c["prompt"].get<std::string>();
    EXPECT_EQ(tok.encode(prompt).input_ids, c["input_ids"].get<std::vector<int64_t>>()) << prompt;
    EXPECT_EQ(tok2.encode(prompt).input_ids, c["input_ids_2"].get<std::vector<int64_t>>())
        << prompt;
  }
}

// hidden_states[-2] (no final layer norm), last_hidden_state, pooler_output and, for
// text_encoder_2, text_embeds = text_projection(pooler_output).
void expect_text_encoder_matches(const std::string& dir, bool with_projection) {
  auto io = io::load_safetensors(dir + "/io.safetensors").tensors;
  auto te = models::load_clip_text_model(dir);
  EXPECT_EQ(te->has_projection(), with_projection);
  te->eval();
  torch::NoGradGuard no_grad;
  auto out = te->forward(io.at("input_ids"), 0, /*output_hidden_states=*/true);
  ASSERT_EQ(out.hidden_states.size(), static_cast<size_t>(te->config().num_hidden_layers + 1));
  const auto& penultimate = out.hidden_states[out.hidden_states.size() - 2];
  EXPECT_LE(max_abs(penultimate, io.at("penultimate_hidden_state")), 1e-4) << dir;
  EXPECT_LE(max_abs(out.last_hidden_state, io.at("last_hidden_state")), 1e-4) << dir;
  EXPECT_LE(max_abs(out.pooler_output, io.at("pooler_output")), 1e-4) << dir;
  if (with_projection) {
    ASSERT_TRUE(out.text_embeds.defined());
    EXPECT_EQ(out.text_embeds.sizes(), io.at("text_embeds").sizes());
    EXPECT_LE(max_abs(out.text_embeds, io.at("text_embeds")), 1e-4) << dir;
  } else {
    EXPECT_FALSE(out.text_embeds.defined());
  }
  // Without output_hidden_states nothing is kept.
  EXPECT_TRUE(te->forward(io.at("input_ids")).hidden_states.empty());
}

TEST(SdxlModels, TextEncoderMatchesTransformers) {
  expect_text_encoder_matches(kTinySdxl + "/text_encoder", false);
}

TEST(SdxlModels, TextEncoderWithProjectionMatchesTransformers) {
  expect_text_encoder_matches(kTinySdxl + "/text_encoder_2", true);
}

TEST(SdxlModels, ProjectionCanBeForcedByThePipelineClass) {
  // A text_encoder_2/config.json without `architectures` still loads as WithProjection when the
  // pipeline says so; a plain CLIPTextModel with projection asked for misses the weight.
  auto te = models::load_clip_text_model(kTinySdxl + "/text_encoder_2", "", true);
  EXPECT_TRUE(te->has_projection());
  const std::string msg =
      test::error_of([&] { models::load_clip_text_model(kTinySdxl + "/text_encoder", "", true); });
  EXPECT_NE(msg.find("text_projection.weight"), std::string::npos) << msg;
}

TEST(SdxlModels, UNetWithTextTimeConditioningMatchesDiffusers) {
  auto io = io::load_safetensors(kTinySdxl + "/unet/io.safetensors").tensors;
  auto unet = models::load_unet(kTinySdxl + "/unet");
  EXPECT_TRUE(unet->needs_added_conditioning());
  unet->eval();
  torch::NoGradGuard no_grad;
  models::UNetConditioning cond;
  cond.encoder_hidden_states = io.at("encoder_hidden_states");
  cond.text_embeds = io.at("text_embeds");
  cond.time_ids = io.at("time_ids");
  auto out = unet->forward(io.at("sample"), io.at("timestep"), cond);
  EXPECT_LE(max_abs(out, io.at("out")), 1e-4);
  // The added conditioning matters: other time ids move the output.
  cond.time_ids = io.at("time_ids").flip(0);
  EXPECT_GT(max_abs(unet->forward(io.at("sample"), io.at("timestep"), cond), io.at("out")), 1e-3);

  // Missing or mis-sized added conditioning is a clear error.
  cond.time_ids = torch::Tensor();
  auto msg = test::error_of([&] { unet->forward(io.at("sample"), io.at("timestep"), cond); });
  EXPECT_NE(msg.find("time_ids"), std::string::npos) << msg;
  cond.time_ids = io.at("time_ids").narrow(1, 0, 4);
  EXPECT_THROW(unet->forward(io.at("sample"), io.at("timestep"), cond), std::exception);
}

TEST(SdxlModels, UNetConfigChecksTextTimeFields) {
  auto j = test::read_json(kTinySdxl + "/unet/config.json");
  auto c = models::UNetConfig::from_json(j, "config.json");
  EXPECT_EQ(c.addition_embed_type.value_or(""), "text_time");
  EXPECT_EQ(c.addition_time_embed_dim.value_or(0), 8);
  EXPECT_EQ(c.transformer_layers_per_block.at(1).front(), 2);
  auto bad = j;
  bad["addition_embed_type"] = "image";
  auto msg = test::error_of([&] { models::UNetConfig::from_json(bad, "config.json"); });
  EXPECT_NE(msg.find("addition_embed_type"), std::string::npos) << msg;
  bad = j;
  bad.erase("projection_class_embeddings_input_dim");
  msg = test::error_of([&] { models::UNetConfig::from_json(bad, "config.json"); });
  EXPECT_NE(msg.find("projection_class_embeddings_input_dim"), std::string::npos) << msg;
  // The config writes back what it read.
  EXPECT_EQ(c.to_json()["addition_embed_type"], "text_time");
}

TEST(SdxlModels, VaeDecodeMatchesDiffusers) {
  auto io = io::load_safetensors(kTinySdxl + "/vae/io.safetensors").tensors;
  auto vae = models::load_autoencoder_kl(kTinySdxl + "/vae");
  EXPECT_NEAR(vae->config().scaling_factor, 0.13025, 1e-12);
  EXPECT_TRUE(vae->config().force_upcast);
  vae->eval();
  torch::NoGradGuard no_grad;
  EXPECT_LE(max_abs(vae->decode(io.at("latent")), io.at("decoded")), 1e-4);
}

}  // namespace
}  // namespace difftrain
