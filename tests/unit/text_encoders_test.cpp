// diffusion::TextEncoderStack: one CLIP (SD-1.x/2.x) and two (SDXL) composed behind one
// component, checked against the encoders' own forwards and Diffusers' encode_prompt rules; an
// encoder and a composition written outside the library (a masked toy encoder) plug in.

#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/core/error.h"
#include "difftrain/data/collate.h"
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "sdxl_fixture.h"
#include "source_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>

namespace difftrain {
namespace {

using diffusion::ClipTextEncoder;
using diffusion::TextEncoderStack;
using test::error_of;
using test::max_abs;

const std::string kStackSd = std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd";
const std::vector<std::string> kStackPrompts = {"a photo of a cat", "an astronaut riding a horse"};

TextEncoderStack sd_stack() {
  return families::stable_diffusion::load_text_encoders(
      families::stable_diffusion::resolve_stable_diffusion_folder(kStackSd));
}

TextEncoderStack sdxl_stack() {
  return families::stable_diffusion::load_text_encoders(
      families::stable_diffusion::resolve_stable_diffusion_folder(test::kTinySdxl));
}

TEST(TextEncoderStack, OneClipIsTheLastHiddenStateAfterClipSkip) {
  auto text = sd_stack();
  EXPECT_EQ(text.composition()->name(), "last hidden state");
  ASSERT_EQ(text.size(), 1u);
  EXPECT_EQ(text.components(), (std::vector<std::string>{"text_encoder", "tokenizer"}));
  const auto& clip = text.as<ClipTextEncoder>(0);
  const auto& cfg = clip.model()->config();
  EXPECT_EQ(text.embed_dim(), cfg.hidden_size);
  EXPECT_EQ(text.pooled_dim(), 0);
  EXPECT_EQ(text.max_clip_skip(), cfg.num_hidden_layers - 1);

  const auto ids = clip.tokenizer().encode_batch(kStackPrompts);
  torch::NoGradGuard no_grad;
  for (int64_t skip = 0; skip <= text.max_clip_skip(); ++skip) {
    const auto e = text.encode(kStackPrompts, skip);
    EXPECT_FALSE(e.pooled.defined());
    EXPECT_EQ(max_abs(e.embeds, clip.model().ptr()->forward(ids, skip).last_hidden_state), 0.0)
        << skip;
  }
  EXPECT_NE(error_of([&] { text.as<diffusion::T5TextEncoder>(0); }).find("is a CLIPTextModel"),
            std::string::npos);
  EXPECT_NE(
      error_of([&] { text.encode(kStackPrompts, text.max_clip_skip() + 1); }).find("clip_skip"),
      std::string::npos);
}

TEST(TextEncoderStack, TwoClipsConcatenateAndPoolFromTheSecond) {
  auto text = sdxl_stack();
  EXPECT_EQ(text.composition()->name(), "concatenated hidden states");
  ASSERT_EQ(text.size(), 2u);
  EXPECT_EQ(text.components(), (std::vector<std::string>{"text_encoder", "tokenizer",
                                                         "text_encoder_2", "tokenizer_2"}));
  const auto& clip = text.as<ClipTextEncoder>(0);
  const auto& clip_2 = text.as<ClipTextEncoder>(1);
  EXPECT_EQ(clip_2.class_name(), "CLIPTextModelWithProjection");
  EXPECT_EQ(text.embed_dim(),
            clip.model()->config().hidden_size + clip_2.model()->config().hidden_size);
  EXPECT_EQ(text.pooled_dim(), clip_2.model()->config().projection_dim);
  const auto e = text.encode(kStackPrompts);
  EXPECT_EQ(e.embeds.size(-1), text.embed_dim());
  EXPECT_EQ(e.pooled.sizes(), (c10::IntArrayRef{2, text.pooled_dim()}));
  // The last encoder needs its projection.
  auto without = text.encoders();
  without[1] = std::make_shared<ClipTextEncoder>(clip_2.files(), clip_2.tokenizer(),
                                                 models::ClipTextModel(clip.model()->config()));
  EXPECT_NE(error_of([&] {
              TextEncoderStack(diffusion::concatenated_hidden_states("SDXL"), without);
            }).find("SDXL's last text encoder is a CLIPTextModelWithProjection"),
            std::string::npos);
  EXPECT_NE(error_of([&] {
              TextEncoderStack(diffusion::last_hidden_state(), text.encoders());
            }).find("takes 1 text encoder, got 2"),
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
    EXPECT_TRUE(torch::equal(one.at(key), batch[i].input_ids[1])) << key;
    EXPECT_FALSE(batch[i].attention_mask.defined());  // CLIP reads every position
  }
  EXPECT_EQ(one.count(TextEncoderStack::mask_key(0)), 0u);
  // encode_ids from the same ids is encode().
  const auto a = text.encode(kStackPrompts, 1);
  torch::NoGradGuard no_grad;
  const auto b = text.encode_tokens(batch, 1);
  EXPECT_EQ(max_abs(a.embeds, b.embeds), 0.0);
  EXPECT_EQ(max_abs(a.pooled, b.pooled), 0.0);
  EXPECT_NE(error_of([&] { text.encode_ids({batch[0].input_ids}, 0); }).find("the stack has 2"),
            std::string::npos);
}

TEST(TextEncoderStack, EncodeIdsFollowsTheCallersGradModeAndEncodeNeverRecords) {
  auto text = sd_stack();
  const auto ids = text.tokenize(kStackPrompts);
  EXPECT_TRUE(text.encode_tokens(ids).embeds.requires_grad());
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
  const int64_t layers = sd[0].num_layers();
  EXPECT_EQ(sd.clip_skip_from_kohya(1), 0);
  EXPECT_EQ(sd.clip_skip_from_kohya(layers), layers - 1);
  EXPECT_NE(error_of([&] { sd.clip_skip_from_kohya(layers + 1); }).find("more than"),
            std::string::npos);
  EXPECT_NE(error_of([&] { sd.clip_skip_from_kohya(0); }).find("1 is the last layer"),
            std::string::npos);
  // SDXL's embedding is the penultimate layer already: one layer fewer.
  auto xl = sdxl_stack();
  const int64_t xl_layers = std::min(xl[0].num_layers(), xl[1].num_layers());
  EXPECT_EQ(xl.clip_skip_from_kohya(xl_layers - 1), xl_layers - 2);
  EXPECT_NE(error_of([&] { xl.clip_skip_from_kohya(xl_layers); }).find("too large for SDXL"),
            std::string::npos);
}

// An encoder written outside the library: bytes as tokens, padded to 8 with a mask, an embedding
// as its model; and a composition of its own (the masked mean as the pooled embedding, the
// penultimate hidden state per token, as decoder-LLM pipelines take hidden_states[-2]).
class ByteEncoder final : public diffusion::TextEncoder {
 public:
  ByteEncoder() : TextEncoder({"text_encoder", "tokenizer", "", ""}) {
    torch::manual_seed(3);
    model_ = std::make_shared<torch::nn::EmbeddingImpl>(256, 4);
  }
  std::string class_name() const override { return "ByteEncoder"; }
  torch::nn::Module* module() const override { return model_.get(); }
  std::shared_ptr<diffusion::TextEncoder> clone() const override {
    return std::make_shared<ByteEncoder>(*this);
  }
  std::shared_ptr<diffusion::TextEncoder> tokenizer_only() const override {
    auto out = std::make_shared<ByteEncoder>(*this);
    out->model_ = nullptr;
    return out;
  }
  int64_t hidden_size() const override { return 4; }
  int64_t num_layers() const override { return 1; }
  diffusion::Tokens tokenize(const std::vector<std::string>& prompts) const override {
    auto ids = torch::zeros({static_cast<int64_t>(prompts.size()), length_}, torch::kInt64);
    auto mask = torch::zeros_like(ids);
    for (size_t i = 0; i < prompts.size(); ++i) {
      for (int64_t j = 0; j < std::min<int64_t>(length_, prompts[i].size()); ++j) {
        ids[i][j] = static_cast<int64_t>(static_cast<unsigned char>(prompts[i][j]));
        mask[i][j] = 1;
      }
    }
    return {ids, mask};
  }
  using TextEncoder::tokenize;
  int64_t kept_tokens() const override { return length_; }
  int64_t prompt_tokens(const std::string& p) const override { return p.size(); }
  std::string length_rule() const override { return std::to_string(length_) + " bytes"; }
  bool set_sequence_length(int64_t n) override {
    length_ = n;
    return true;
  }
  std::string cache_key() const override { return "bytes " + std::to_string(length_); }
  diffusion::TextEncoding encode(const diffusion::Tokens& t,
                                 const diffusion::EncodeRequest& r) const override {
    check_loaded();
    diffusion::TextEncoding out;
    const auto h0 = model_->forward(t.input_ids);
    const auto h1 = h0 * 2;
    out.last_hidden_state = h1;
    if (r.hidden_states) out.hidden_states = {h0, h1};
    out.attention_mask = t.attention_mask;
    return out;
  }

 private:
  std::shared_ptr<torch::nn::EmbeddingImpl> model_;
  int64_t length_ = 8;
};

class PenultimateMasked final : public diffusion::PromptComposition {
 public:
  std::string name() const override { return "penultimate, masked"; }
  void check(const diffusion::TextEncoders& e) const override {
    if (e.size() != 1) throw Error("penultimate, masked takes 1 encoder");
  }
  int64_t embed_dim(const diffusion::TextEncoders& e) const override { return e[0]->hidden_size(); }
  int64_t pooled_dim(const diffusion::TextEncoders& e) const override {
    return e[0]->hidden_size();
  }
  diffusion::PromptEmbeds compose(const diffusion::TextEncoders& e,
                                  const std::vector<diffusion::Tokens>& tokens,
                                  int64_t) const override {
    const auto r = e[0]->encode(tokens[0], {0, true});
    diffusion::PromptEmbeds out;
    const auto mask = r.attention_mask.unsqueeze(-1).to(torch::kFloat32);
    out.embeds = r.hidden_states[r.hidden_states.size() - 2] * mask;
    out.pooled = out.embeds.sum(1) / mask.sum(1);
    out.attention_mask = r.attention_mask;
    return out;
  }
};

TEST(TextEncoderStack, AnEncoderAndACompositionOfOneselfPlugIn) {
  TextEncoderStack text(std::make_shared<PenultimateMasked>(), {std::make_shared<ByteEncoder>()});
  EXPECT_EQ(text.embed_dim(), 4);
  EXPECT_EQ(text.pooled_dim(), 4);
  EXPECT_EQ(text.max_clip_skip(), 0);
  // A caption's tokens carry the mask under its own key; a collated batch gives them back.
  const auto one = text.tokenize(std::string("cat"));
  ASSERT_EQ(one.count("attention_mask"), 1u);
  EXPECT_EQ(one.at("attention_mask").sum().item<int64_t>(), 3);
  data::Batch batch;
  for (const auto& [key, value] : one) batch["class_" + key] = value.unsqueeze(0);
  const auto tokens = text.tokens_of(batch, "class_");
  ASSERT_EQ(tokens.size(), 1u);
  EXPECT_TRUE(tokens[0].attention_mask.equal(one.at("attention_mask").unsqueeze(0)));
  EXPECT_NE(error_of([&] { text.tokens_of(batch); }).find("no input_ids"), std::string::npos);

  // encode() is the composition of the encoder's outputs: the masked positions are zero, the
  // pooled row is the mean of the real ones (float64 recomputation from the embedding).
  const auto e = text.encode({"cat", "a dog"});
  const auto weight = text[0].module()->parameters()[0];
  const auto want = weight.index_select(0, torch::tensor({99, 97, 116})).to(torch::kFloat64);
  EXPECT_LT(max_abs(e.embeds[0].narrow(0, 0, 3), want), 1e-6);
  EXPECT_EQ(e.embeds[0].narrow(0, 3, 5).abs().sum().item<double>(), 0.0);
  EXPECT_LT(max_abs(e.pooled[0], want.mean(0)), 1e-6);
  EXPECT_TRUE(e.attention_mask.equal(
      text.tokenize(std::vector<std::string>{"cat", "a dog"})[0].attention_mask));

  // The sequence length is each copy's own; the cut is reported with the encoder's rule.
  TextEncoderStack copy = text;
  copy.set_max_sequence_length(2);
  EXPECT_EQ(copy[0].cache_key(), "bytes 2");
  EXPECT_EQ(text[0].cache_key(), "bytes 8");
  const auto report = copy.truncation_report({"cat", "a"});
  ASSERT_EQ(report.size(), 1u);
  EXPECT_NE(report[0].find("1 of 2 prompt(s) are longer than text_encoder's 2 tokens (2 bytes)"),
            std::string::npos)
      << report[0];

  // Released, it tokenizes the same and refuses to encode.
  const auto released = text.tokenizers_only();
  EXPECT_FALSE(released.has_models());
  EXPECT_TRUE(released.tokenize(std::string("cat")).at("input_ids").equal(one.at("input_ids")));
  EXPECT_NE(error_of([&] { released.encode({"cat"}); }).find("released"), std::string::npos);
  EXPECT_NE(error_of([&] {
              text.encode({"cat"}, 0, {"x", "y"});
            }).find("this pipeline has 1"),
            std::string::npos);
}

}  // namespace
}  // namespace difftrain
