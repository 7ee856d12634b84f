// diffusion::TextEncoderStack: one CLIP (SD-1.x/2.x) and two (SDXL) behind one component,
// checked against the encoders' own forwards and Diffusers' encode_prompt rules.

#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "sdxl_fixture.h"
#include "source_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>

namespace difftrain {
namespace {

using diffusion::TextEncoderStack;
using test::error_of;
using test::max_abs;
using Layout = TextEncoderStack::Layout;

const std::string kStackSd = std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd";
const std::vector<std::string> kStackPrompts = {"a photo of a cat", "an astronaut riding a horse"};

TextEncoderStack sd_stack() {
  return diffusion::load_text_encoders(diffusion::resolve_stable_diffusion_folder(kStackSd));
}

TextEncoderStack sdxl_stack() {
  return diffusion::load_text_encoders(diffusion::resolve_stable_diffusion_folder(test::kTinySdxl));
}

TEST(TextEncoderStack, OneClipIsTheLastHiddenStateAfterClipSkip) {
  auto text = sd_stack();
  ASSERT_EQ(text.layout(), Layout::kClip);
  ASSERT_EQ(text.size(), 1u);
  EXPECT_EQ(text.components(), (std::vector<std::string>{"text_encoder", "tokenizer"}));
  const auto& cfg = text[0].model->config();
  EXPECT_EQ(text.embed_dim(), cfg.hidden_size);
  EXPECT_EQ(text.pooled_dim(), 0);
  EXPECT_EQ(text.max_clip_skip(), cfg.num_hidden_layers - 1);

  const auto ids = text[0].tokenizer.encode_batch(kStackPrompts);
  torch::NoGradGuard no_grad;
  for (int64_t skip = 0; skip <= text.max_clip_skip(); ++skip) {
    const auto e = text.encode(kStackPrompts, skip);
    EXPECT_FALSE(e.pooled.defined());
    EXPECT_EQ(max_abs(e.embeds, text[0].model->forward(ids, skip).last_hidden_state), 0.0) << skip;
  }
  EXPECT_NE(
      error_of([&] { text.encode(kStackPrompts, text.max_clip_skip() + 1); }).find("clip_skip"),
      std::string::npos);
}

TEST(TextEncoderStack, TwoClipsConcatenateAndPoolFromTheSecond) {
  auto text = sdxl_stack();
  ASSERT_EQ(text.layout(), Layout::kDualClip);
  ASSERT_EQ(text.size(), 2u);
  EXPECT_EQ(text.components(), (std::vector<std::string>{"text_encoder", "tokenizer",
                                                         "text_encoder_2", "tokenizer_2"}));
  EXPECT_EQ(text.embed_dim(),
            text[0].model->config().hidden_size + text[1].model->config().hidden_size);
  EXPECT_EQ(text.pooled_dim(), text[1].model->config().projection_dim);
  const auto e = text.encode(kStackPrompts);
  EXPECT_EQ(e.embeds.size(-1), text.embed_dim());
  EXPECT_EQ(e.pooled.sizes(), (c10::IntArrayRef{2, text.pooled_dim()}));
  // The second encoder needs its projection.
  auto without = text.encoders();
  without[1].model = models::ClipTextModel(text[0].model->config());
  EXPECT_NE(error_of([&] {
              TextEncoderStack(Layout::kDualClip, without);
            }).find("CLIPTextModelWithProjection"),
            std::string::npos);
  EXPECT_NE(error_of([&] { TextEncoderStack(Layout::kClip, text.encoders()); }).find("takes 1"),
            std::string::npos);
}

TEST(TextEncoderStack, TokenizeGivesEveryEncodersIdsUnderItsBatchKey) {
  auto text = sdxl_stack();
  const auto one = text.tokenize(kStackPrompts[1]);
  ASSERT_EQ(one.size(), 2u);
  const auto batch = text.tokenize(kStackPrompts);
  for (size_t i = 0; i < 2; ++i) {
    const auto key = TextEncoderStack::ids_key(i);
    EXPECT_EQ(key, i == 0 ? "input_ids" : "input_ids_2");
    EXPECT_TRUE(torch::equal(one.at(key), batch[i][1])) << key;
  }
  // encode_ids from the same ids is encode().
  const auto a = text.encode(kStackPrompts, 1);
  torch::NoGradGuard no_grad;
  const auto b = text.encode_ids(batch, 1);
  EXPECT_EQ(max_abs(a.embeds, b.embeds), 0.0);
  EXPECT_EQ(max_abs(a.pooled, b.pooled), 0.0);
  EXPECT_NE(error_of([&] { text.encode_ids({batch[0]}, 0); }).find("the stack has 2"),
            std::string::npos);
}

TEST(TextEncoderStack, EncodeIdsFollowsTheCallersGradModeAndEncodeNeverRecords) {
  auto text = sd_stack();
  const auto ids = text.tokenize(kStackPrompts);
  EXPECT_TRUE(text.encode_ids(ids).embeds.requires_grad());
  EXPECT_FALSE(text.encode(kStackPrompts).embeds.requires_grad());
  text.freeze();
  for (auto* m : text.modules()) {
    EXPECT_FALSE(m->is_training());
    for (const auto& p : m->parameters()) EXPECT_FALSE(p.requires_grad());
  }
  text.to(torch::kCPU, torch::kBFloat16);
  EXPECT_EQ(text.encode(kStackPrompts).embeds.scalar_type(), torch::kBFloat16);
}

TEST(TextEncoderStack, KohyaClipSkipIsCheckedPerLayout) {
  auto sd = sd_stack();
  const int64_t layers = sd[0].model->config().num_hidden_layers;
  EXPECT_EQ(sd.clip_skip_from_kohya(1), 0);
  EXPECT_EQ(sd.clip_skip_from_kohya(layers), layers - 1);
  EXPECT_NE(error_of([&] { sd.clip_skip_from_kohya(layers + 1); }).find("more than"),
            std::string::npos);
  EXPECT_NE(error_of([&] { sd.clip_skip_from_kohya(0); }).find("1 is the last layer"),
            std::string::npos);
  // SDXL's embedding is the penultimate layer already: one layer fewer.
  auto xl = sdxl_stack();
  const int64_t xl_layers =
      std::min(xl[0].model->config().num_hidden_layers, xl[1].model->config().num_hidden_layers);
  EXPECT_EQ(xl.clip_skip_from_kohya(xl_layers - 1), xl_layers - 2);
  EXPECT_NE(error_of([&] { xl.clip_skip_from_kohya(xl_layers); }).find("too large for SDXL"),
            std::string::npos);
}

}  // namespace
}  // namespace difftrain
