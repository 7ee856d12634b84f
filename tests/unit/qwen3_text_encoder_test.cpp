// Qwen3TextEncoder: Z-Image's text encoder as a pipeline component, on the tokenizer fixture and
// the tiny Qwen3 (tests/golden/z_image): prompts wrapped in the chat template and padded as
// ZImagePipeline._encode_prompt does (ids equal the reference), hidden_states[-2] equal the
// model's own, the cut at max_sequence_length, release after caching, refusals.
#include "difftrain/diffusion/qwen3_text_encoder.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace {

using difftrain::diffusion::EncodeRequest;
using difftrain::diffusion::Qwen3PromptFormat;
using difftrain::diffusion::Qwen3TextEncoder;
using difftrain::diffusion::TextEncoderFiles;
using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::temp_dir;
using difftrain::test::write_text;
namespace fs = std::filesystem;

const std::string kZImageGolden = kGoldenDir + "z_image/";

TextEncoderFiles qwen3_files(const std::string& tokenizer_dir = kZImageGolden + "tokenizer") {
  return {"text_encoder", "tokenizer", kZImageGolden + "qwen3/text_encoder", tokenizer_dir};
}

nlohmann::json pipeline_prompts() {
  std::ifstream in(kZImageGolden + "chat_template/expected.json");
  return nlohmann::json::parse(in).at("pipeline_prompts");
}

TEST(Qwen3TextEncoder, PromptsAreWrappedPaddedAndEncodedAsZImagePipelineDoes) {
  torch::NoGradGuard no_grad;
  Qwen3PromptFormat format;
  format.sequence_length = 48;
  const auto enc = Qwen3TextEncoder::load(qwen3_files(), "", torch::kFloat32, format);
  EXPECT_EQ(enc->class_name(), "Qwen3Model");
  EXPECT_EQ(enc->hidden_size(), 48);
  const auto cases = pipeline_prompts();
  std::vector<std::string> prompts;
  for (const auto& c : cases) prompts.push_back(c.at("prompt"));
  const auto tokens = enc->tokenize(prompts);
  ASSERT_EQ(tokens.input_ids.sizes(),
            (std::vector<int64_t>{static_cast<int64_t>(prompts.size()), 48}));
  const int64_t pad = enc->tokenizer().pad_id();
  for (size_t i = 0; i < prompts.size(); ++i) {
    auto want = cases[i].at("ids").get<std::vector<int64_t>>();
    ASSERT_LE(want.size(), 48u) << prompts[i];
    EXPECT_EQ(enc->prompt_tokens(prompts[i]), static_cast<int64_t>(want.size()));
    const auto n = static_cast<int64_t>(want.size());
    want.resize(48, pad);
    const auto row = tokens.input_ids[static_cast<int64_t>(i)];
    EXPECT_EQ(std::vector<int64_t>(row.data_ptr<int64_t>(), row.data_ptr<int64_t>() + 48), want);
    EXPECT_EQ(tokens.attention_mask[static_cast<int64_t>(i)].sum().item<int64_t>(), n);
  }
  // hidden_states[-2] (skip_layers 1): the model's own, and the whole list agrees with it.
  EncodeRequest penultimate;
  penultimate.skip_layers = 1;
  const auto e = enc->encode(tokens, penultimate);
  auto model = difftrain::models::load_qwen3_model(kZImageGolden + "qwen3/text_encoder");
  const auto want = model->hidden_state(tokens.input_ids, tokens.attention_mask, -2);
  EXPECT_TRUE(e.last_hidden_state.equal(want));
  EXPECT_TRUE(e.attention_mask.equal(tokens.attention_mask));
  EncodeRequest all;
  all.hidden_states = true;
  const auto every = enc->encode(tokens, all);
  ASSERT_EQ(every.hidden_states.size(), 4u);
  EXPECT_TRUE(every.hidden_states[2].equal(want));
  EXPECT_TRUE(every.last_hidden_state.equal(every.hidden_states[3]));
  // One prompt as [L].
  const auto one = enc->tokenize(prompts[0]);
  EXPECT_EQ(one.input_ids.dim(), 1);
  // (a batch of one need not round like a row of six: BLAS blocks them differently)
  EXPECT_LT(difftrain::test::max_abs(enc->encode(one, penultimate).last_hidden_state, want[0]),
            1e-5);
}

TEST(Qwen3TextEncoder, LengthCacheKeyReleaseAndRefusals) {
  Qwen3PromptFormat format;
  format.sequence_length = 8;
  const auto enc = Qwen3TextEncoder::load(qwen3_files(), "", torch::kFloat32, format);
  EXPECT_EQ(enc->kept_tokens(), 8);
  EXPECT_GT(enc->prompt_tokens("a cat"), 8);  // the template alone takes more
  EXPECT_HAS(enc->length_rule(), "--max_sequence_length 8 with the chat template's tokens");
  const auto key = enc->cache_key();
  auto other = std::dynamic_pointer_cast<Qwen3TextEncoder>(enc->clone());
  ASSERT_TRUE(other->set_sequence_length(16));
  EXPECT_NE(other->cache_key(), key);
  EXPECT_EQ(enc->kept_tokens(), 8);           // the copy's length is its own
  EXPECT_EQ(other->module(), enc->module());  // the model is shared
  EXPECT_HAS(error_of([&] { other->set_sequence_length(0); }), "at least 1");
  Qwen3PromptFormat no_thinking = format;
  no_thinking.template_kwargs = {{"enable_thinking", false}};
  const auto plain = Qwen3TextEncoder::load(qwen3_files(), "", torch::kFloat32, no_thinking);
  EXPECT_NE(plain->cache_key(), key);
  EXPECT_HAS(plain->render("a cat"), "<think>\n\n</think>\n\n");

  const auto released = enc->tokenizer_only();
  EXPECT_EQ(released->module(), nullptr);
  EXPECT_TRUE(released->tokenize(std::string("a cat"))
                  .input_ids.equal(enc->tokenize(std::string("a cat")).input_ids));
  EXPECT_HAS(error_of([&] { released->encode(released->tokenize(std::string("a cat")), {}); }),
             "text_encoder");
  EncodeRequest too_many;
  too_many.skip_layers = 3;
  EXPECT_HAS(error_of([&] { enc->encode(enc->tokenize(std::string("a")), too_many); }),
             "skip_layers 3 is out of [0, 2]");

  // A tokenizer folder without a chat template is refused when the format needs one.
  const auto dir = temp_dir("qwen3_te_no_template");
  for (const auto& entry : fs::directory_iterator(kZImageGolden + "tokenizer")) {
    fs::copy_file(entry.path(), fs::path(dir) / entry.path().filename());
  }
  nlohmann::json config;
  {
    std::ifstream in(dir + "/tokenizer_config.json");
    config = nlohmann::json::parse(in);
  }
  config.erase("chat_template");
  write_text(dir + "/tokenizer_config.json", config.dump(2));
  EXPECT_HAS(error_of([&] { Qwen3TextEncoder::load(qwen3_files(dir), ""); }),
             "has no chat template");
  Qwen3PromptFormat raw;
  raw.chat_template = false;
  raw.sequence_length = 4;
  const auto bare = Qwen3TextEncoder::load(qwen3_files(dir), "", torch::kFloat32, raw);
  EXPECT_EQ(bare->render("a cat"), "a cat");
}

}  // namespace
