// The T5 side of FLUX.1 against the fixtures (tests/golden/flux/tiny_flux): the SentencePiece
// tokenizer with T5Tokenizer's conventions (every case of tokenizer_cases.json, ids exact) and
// T5EncoderModel (text_encoder_2/io.safetensors: outputs, every hidden state, the position bias,
// the bucket table), sharded and tied-embedding files, bf16, and bad input.

#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/t5_encoder.h"
#include "difftrain/models/t5_tokenizer.h"
#include "source_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cstdio>
#include <filesystem>

namespace difftrain {
namespace {

namespace fs = std::filesystem;
using test::error_of;
using test::max_abs;

const std::string kT5Fixture =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";

std::vector<int64_t> t5_ids_of(const nlohmann::json& j) { return j.get<std::vector<int64_t>>(); }

TEST(T5Tokenizer, EveryFixtureCaseGivesTheReferenceIds) {
  const auto tok = models::T5Tokenizer::load(kT5Fixture + "/tokenizer_2");
  EXPECT_EQ(tok.vocab_size(), 1100);
  EXPECT_EQ(tok.pad_id(), 0);
  EXPECT_EQ(tok.eos_id(), 1);
  const auto cases = test::read_json(kT5Fixture + "/tokenizer_cases.json");
  int checked = 0;
  for (const char* group : {"cases", "t5_only_cases"}) {
    for (const auto& c : cases.at(group)) {
      const std::string prompt = c.at("prompt");
      SCOPED_TRACE(prompt);
      const auto want = t5_ids_of(c.at("t5_input_ids"));
      bool truncated = false;
      EXPECT_EQ(tok.encode(prompt, static_cast<int64_t>(want.size()), &truncated), want);
      EXPECT_EQ(tok.piece_ids(prompt), t5_ids_of(c.at("t5_sp_ids")));
      EXPECT_EQ(tok.pieces(prompt), c.at("t5_pieces").get<std::vector<std::string>>());
      if (c.contains("t5_truncated")) {
        EXPECT_EQ(truncated, c.at("t5_truncated").get<bool>());
      }
      ++checked;
    }
  }
  EXPECT_EQ(checked, 13);
  // A batch is [N, max_length]; "" is </s> then padding.
  const torch::Tensor batch = tok({"a photo of a cat", ""}, 8);
  EXPECT_EQ(batch.sizes(), (std::vector<int64_t>{2, 8}));
  EXPECT_EQ(batch[1][0].item<int64_t>(), 1);
  EXPECT_EQ(batch[1][1].item<int64_t>(), 0);
}

TEST(T5Tokenizer, MissingOrCorruptModelFilesAreNamed) {
  const std::string dir = test::temp_dir("t5_tok_bad");
  std::string msg = error_of([&] { models::T5Tokenizer::load(dir); });
  EXPECT_NE(msg.find("spiece.model"), std::string::npos) << msg;
  test::write_text(dir + "/spiece.model", "not a sentencepiece model");
  msg = error_of([&] { models::T5Tokenizer::load(dir); });
  EXPECT_NE(msg.find("not a SentencePiece model"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  const auto tok = models::T5Tokenizer::load(kT5Fixture + "/tokenizer_2");
  EXPECT_NE(error_of([&] { tok.encode("a cat", 0); }).find("max_length"), std::string::npos);
}

TEST(T5Encoder, OutputsHiddenStatesAndPositionBiasMatchTransformers) {
  const auto io = io::load_safetensors(kT5Fixture + "/text_encoder_2/io.safetensors").tensors;
  auto t5 = models::load_t5_encoder(kT5Fixture + "/text_encoder_2");
  t5->eval();
  torch::NoGradGuard no_grad;
  const auto out = t5->forward_all(io.at("input_ids"));
  const double last = max_abs(out.last_hidden_state, io.at("last_hidden_state"));
  const double block = max_abs(out.last_block_output, io.at("last_block_output"));
  const double bias = max_abs(out.position_bias[0], io.at("position_bias"));
  ASSERT_EQ(static_cast<int64_t>(out.hidden_states.size()), io.at("hidden_states").size(0));
  double states = 0;
  for (size_t i = 0; i < out.hidden_states.size(); ++i) {
    states = std::max(
        states, max_abs(out.hidden_states[i], io.at("hidden_states")[static_cast<int64_t>(i)]));
  }
  const double long_last =
      max_abs(t5->forward(io.at("long_input_ids")), io.at("long_last_hidden_state"));
  std::printf("T5 last %.3g block %.3g hidden %.3g bias %.3g long %.3g (limit 1e-4)\n", last, block,
              states, bias, long_last);
  EXPECT_LE(last, 1e-4);
  EXPECT_LE(block, 1e-4);
  EXPECT_LE(states, 1e-4);
  EXPECT_LE(bias, 1e-4);
  EXPECT_LE(long_last, 1e-4);
  // The bucket table, -300..300, exact.
  const torch::Tensor buckets = models::t5_relative_position_bucket(
      io.at("bucket_relative_position").to(torch::kInt64), 32, 128);
  EXPECT_TRUE(torch::equal(buckets, io.at("bucket").to(torch::kInt64)));
}

TEST(T5Encoder, TiedEmbeddingCopiesShardsAndBf16LoadTheSameModel) {
  const auto io = io::load_safetensors(kT5Fixture + "/text_encoder_2/io.safetensors").tensors;
  torch::NoGradGuard no_grad;
  auto reference = models::load_t5_encoder(kT5Fixture + "/text_encoder_2");
  reference->eval();
  const torch::Tensor want = reference->forward(io.at("input_ids"));
  auto weights = io::load_safetensors(kT5Fixture + "/text_encoder_2/model.safetensors").tensors;
  // With encoder.embed_tokens.weight (a copy of shared.weight, as other tools write it).
  const std::string tied = test::temp_dir("t5_tied");
  fs::copy_file(kT5Fixture + "/text_encoder_2/config.json", tied + "/config.json");
  auto with_copy = weights;
  with_copy["encoder.embed_tokens.weight"] = weights.at("shared.weight");
  io::save_safetensors(tied + "/model.safetensors", with_copy);
  auto a = models::load_t5_encoder(tied);
  a->eval();
  EXPECT_EQ(max_abs(a->forward(io.at("input_ids")), want), 0.0);
  // Two shards and model.safetensors.index.json.
  const std::string sharded = test::temp_dir("t5_sharded");
  fs::copy_file(kT5Fixture + "/text_encoder_2/config.json", sharded + "/config.json");
  io::TensorMap s1, s2;
  nlohmann::json map = nlohmann::json::object();
  int k = 0;
  for (const auto& [name, t] : weights) {
    const bool first = k++ % 2 == 0;
    (first ? s1 : s2)[name] = t;
    map[name] = first ? "model-00001-of-00002.safetensors" : "model-00002-of-00002.safetensors";
  }
  io::save_safetensors(sharded + "/model-00001-of-00002.safetensors", s1);
  io::save_safetensors(sharded + "/model-00002-of-00002.safetensors", s2);
  test::write_text(sharded + "/model.safetensors.index.json",
                   nlohmann::json{{"metadata", {{"total_size", 0}}}, {"weight_map", map}}.dump());
  auto b = models::load_t5_encoder(sharded);
  b->eval();
  EXPECT_EQ(max_abs(b->forward(io.at("input_ids")), want), 0.0);
  // bf16 weights: norms in float32, close to the float32 model.
  auto c = models::load_t5_encoder(kT5Fixture + "/text_encoder_2", torch::kBFloat16);
  c->eval();
  for (const auto& p : c->parameters()) EXPECT_EQ(p.scalar_type(), torch::kBFloat16);
  const torch::Tensor got = c->forward(io.at("input_ids"));
  const double rel = ((got.to(torch::kFloat32) - want).norm() / want.norm()).item<double>();
  std::printf("T5 bf16 relative L2 error %.3g (limit 0.05)\n", rel);
  EXPECT_LE(rel, 0.05);
}

TEST(T5Encoder, BadConfigAndWeightsNameTheFile) {
  const std::string dir = test::temp_dir("t5_bad");
  std::string msg = error_of([&] { models::load_t5_encoder(dir); });
  EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
  auto config = test::read_json(kT5Fixture + "/text_encoder_2/config.json");
  config["num_heads"] = 0;
  test::write_text(dir + "/config.json", config.dump());
  msg = error_of([&] { models::load_t5_encoder(dir); });
  EXPECT_NE(msg.find("num_heads"), std::string::npos) << msg;
  config["num_heads"] = 4;
  config["feed_forward_proj"] = "gated-swish";
  test::write_text(dir + "/config.json", config.dump());
  msg = error_of([&] { models::load_t5_encoder(dir); });
  EXPECT_NE(msg.find("feed_forward_proj"), std::string::npos) << msg;
  config["feed_forward_proj"] = "gated-gelu";
  config["d_model"] = 48;  // the weights are 32 wide
  test::write_text(dir + "/config.json", config.dump());
  fs::copy_file(kT5Fixture + "/text_encoder_2/model.safetensors", dir + "/model.safetensors");
  msg = error_of([&] { models::load_t5_encoder(dir); });
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
  fs::remove(dir + "/model.safetensors");
  msg = error_of([&] { models::load_t5_encoder(dir); });
  EXPECT_NE(msg.find("model.safetensors"), std::string::npos) << msg;
}

}  // namespace
}  // namespace difftrain
