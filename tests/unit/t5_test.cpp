// The T5 side of FLUX.1 against the fixtures (tests/golden/flux/tiny_flux): the SentencePiece
// tokenizer with T5Tokenizer's conventions (every case of tokenizer_cases.json, ids exact) and
// T5EncoderModel (text_encoder_2/io.safetensors: outputs, every hidden state, the position bias,
// the bucket table), sharded and tied-embedding files, bf16, and bad input.

#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/text_encoders/t5_encoder.h"
#include "difftrain/models/tokenizers/t5_tokenizer.h"
#include "source_dir.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>
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

// ------------------------------------------------------------------ other sizes

// The bidirectional bucket in closed form, in double precision: half the buckets per sign,
// exact below a quarter, logarithmic up to max_distance.
int64_t t5_closed_form_bucket(int64_t rel, int64_t buckets, int64_t max_distance) {
  const int64_t half = buckets / 2, exact = half / 2;
  const int64_t base = rel > 0 ? half : 0, n = std::abs(rel);
  if (n < exact) return base + n;
  const double v = std::log(static_cast<double>(n) / exact) /
                   std::log(static_cast<double>(max_distance) / exact) * (half - exact);
  return base + std::min(half - 1, exact + static_cast<int64_t>(std::floor(v + 1e-9)));
}

// A float64 transcription of T5EncoderModel from its state dict, written independently of
// models/t5_encoder.cpp: per-head loops, the closed-form buckets, norms and activations from
// their definitions.
torch::Tensor t5_transcription(const io::TensorMap& w, const models::T5EncoderOptions& c,
                               const torch::Tensor& ids) {
  auto W = [&](const std::string& k) { return w.at(k); };
  const int64_t S = ids.size(1);
  auto rms = [&](const torch::Tensor& x, const torch::Tensor& g) {
    return g * x / torch::sqrt(x.pow(2).mean(-1, true) + c.layer_norm_epsilon());
  };
  auto act = [&](const torch::Tensor& x) {
    const std::string a = c.activation();
    if (a == "relu") return torch::clamp_min(x, 0);
    if (a == "gelu_new") {
      return 0.5 * x * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))));
    }
    if (a == "gelu") return 0.5 * x * (1 + torch::erf(x / std::sqrt(2.0)));
    return x / (1 + torch::exp(-x));
  };
  torch::Tensor bias = torch::zeros({c.num_heads(), S, S}, torch::kFloat64);
  const torch::Tensor table =
      W("encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight");
  for (int64_t i = 0; i < S; ++i) {
    for (int64_t j = 0; j < S; ++j) {
      const int64_t b = t5_closed_form_bucket(j - i, c.relative_attention_num_buckets(),
                                              c.relative_attention_max_distance());
      bias.index_put_({torch::indexing::Slice(), i, j}, table[b]);
    }
  }
  torch::Tensor h = W("shared.weight").index_select(0, ids.flatten()).view({ids.size(0), S, -1});
  for (int64_t l = 0; l < c.num_layers(); ++l) {
    const std::string p = "encoder.block." + std::to_string(l) + ".layer.";
    const torch::Tensor x = rms(h, W(p + "0.layer_norm.weight"));
    std::vector<torch::Tensor> heads;
    for (int64_t hd = 0; hd < c.num_heads(); ++hd) {
      auto rows = [&](const std::string& n) {
        return W(p + "0.SelfAttention." + n + ".weight").narrow(0, hd * c.d_kv(), c.d_kv());
      };
      const torch::Tensor q = x.matmul(rows("q").t()), k = x.matmul(rows("k").t());
      const torch::Tensor v = x.matmul(rows("v").t());
      const torch::Tensor sc = q.matmul(k.transpose(1, 2)) + bias[hd];  // no 1/sqrt(d) in T5
      const torch::Tensor e = torch::exp(sc - std::get<0>(sc.max(-1, true)));
      heads.push_back((e / e.sum(-1, true)).matmul(v));
    }
    h = h + torch::cat(heads, -1).matmul(W(p + "0.SelfAttention.o.weight").t());
    const torch::Tensor y = rms(h, W(p + "1.layer_norm.weight"));
    const std::string d = p + "1.DenseReluDense.";
    const torch::Tensor inner =
        c.gated() ? act(y.matmul(W(d + "wi_0.weight").t())) * y.matmul(W(d + "wi_1.weight").t())
                  : act(y.matmul(W(d + "wi.weight").t()));
    h = h + inner.matmul(W(d + "wo.weight").t());
  }
  return rms(h, W("encoder.final_layer_norm.weight"));
}

// Sizes the fixture does not have: gated-gelu, relu and gated-silu FFNs, odd head counts and
// widths, bucket tables of 8 to 64 with max distances of 20 to 300, sequences past them.
TEST(T5Encoder, OtherSizesMatchAFloat64Transcription) {
  torch::NoGradGuard no_grad;
  struct Size {
    std::string ff;
    int64_t d_model, d_kv, heads, d_ff, layers, vocab, buckets, distance, seq;
  };
  const std::vector<Size> sizes = {{"gated-gelu", 24, 10, 3, 40, 3, 77, 16, 20, 40},
                                   {"relu", 16, 4, 2, 24, 1, 50, 8, 64, 30},
                                   {"gated-silu", 20, 6, 5, 12, 2, 31, 64, 300, 50}};
  for (const auto& s : sizes) {
    SCOPED_TRACE(s.ff + " d_model " + std::to_string(s.d_model));
    const auto dir = test::temp_dir("t5_sizes");
    const nlohmann::json config = {{"d_model", s.d_model},
                                   {"d_kv", s.d_kv},
                                   {"num_heads", s.heads},
                                   {"d_ff", s.d_ff},
                                   {"num_layers", s.layers},
                                   {"vocab_size", s.vocab},
                                   {"relative_attention_num_buckets", s.buckets},
                                   {"relative_attention_max_distance", s.distance},
                                   {"layer_norm_epsilon", 1e-5},
                                   {"feed_forward_proj", s.ff}};
    test::write_text(dir + "/config.json", config.dump());
    const auto c = models::T5EncoderOptions::load(dir + "/config.json");
    torch::manual_seed(7);
    models::T5EncoderModel fresh(c);
    io::TensorMap weights, w64;
    for (const auto& p : fresh->named_parameters()) {
      weights[p.key()] = torch::randn(p.value().sizes()) * 0.5;
      w64[p.key()] = weights[p.key()].to(torch::kFloat64);
    }
    io::save_safetensors(dir + "/model.safetensors", weights);
    auto model = models::load_t5_encoder(dir);
    const torch::Tensor ids = torch::randint(s.vocab, {2, s.seq}, torch::kLong);
    const double d = max_abs(model->forward(ids), t5_transcription(w64, c, ids));
    std::cout << "  " << s.ff << " d_model " << s.d_model << " heads " << s.heads << "x" << s.d_kv
              << ": max abs diff vs float64 " << d << " (1e-4)\n";
    EXPECT_LE(d, 1e-4);
    const torch::Tensor rel = torch::arange(-s.distance - 40, s.distance + 40);
    const torch::Tensor got = models::t5_relative_position_bucket(rel, s.buckets, s.distance);
    for (int64_t i = 0; i < rel.size(0); ++i) {
      const int64_t r = rel[i].item<int64_t>();
      ASSERT_EQ(got[i].item<int64_t>(), t5_closed_form_bucket(r, s.buckets, s.distance)) << r;
    }
    fs::remove_all(dir);
  }
}

}  // namespace
}  // namespace difftrain
