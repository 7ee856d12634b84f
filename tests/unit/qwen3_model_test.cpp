// Qwen3Model against tests/golden/z_image/qwen3 (a plain-torch transcription of Transformers'
// modeling_qwen3.py, checked against a float64 loop formulation and rasbt's standalone Qwen3;
// make_qwen3.py): every hidden state of a right-padded batch (GQA, head_dim · heads != hidden,
// odd lengths) and of an unpadded sequence, the prompt embeddings ZImagePipeline takes, bf16;
// a sharded folder, a Qwen3ForCausalLM checkpoint, and refused configs.
#include "difftrain/models/text_encoders/qwen3_model.h"

#include "difftrain/io/safetensors.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>

namespace {

using difftrain::models::load_qwen3_model;
using difftrain::models::qwen3_prompt_embeds;
using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::max_abs;
using difftrain::test::temp_dir;
using difftrain::test::write_text;
namespace fs = std::filesystem;

const std::string kQwen3Dir = kGoldenDir + "z_image/qwen3";

const difftrain::io::TensorMap& qwen3_expected() {
  static const auto file =
      difftrain::io::load_safetensors(kQwen3Dir + "/expected.safetensors").tensors;
  return file;
}

TEST(Qwen3Model, EveryHiddenStateOfAPaddedBatchMatchesTheReference) {
  torch::NoGradGuard no_grad;
  auto model = load_qwen3_model(kQwen3Dir + "/text_encoder");
  ASSERT_EQ(model->options().num_key_value_heads(), 2);
  ASSERT_NE(model->options().head_dim() * model->options().num_attention_heads(),
            model->options().hidden_size());
  const auto& e = qwen3_expected();
  const auto ids = e.at("input_ids");
  const auto mask = e.at("attention_mask");
  const auto out = model->forward(ids, mask);
  ASSERT_EQ(out.hidden_states.size(), 4u);
  for (size_t k = 0; k < out.hidden_states.size(); ++k) {
    const auto want = e.at("hidden_states." + std::to_string(k));
    const double diff = max_abs(out.hidden_states[k], want);
    EXPECT_LT(diff, 2e-5) << "hidden_states." << k << " (tolerance 2e-5)";
    std::cout << "hidden_states." << k << " max abs diff " << diff << "\n";
  }
  // hidden_state(-2) runs one layer less and gives the same tensor.
  EXPECT_TRUE(model->hidden_state(ids, mask, -2).equal(out.hidden_states[2]));
  const auto embeds = qwen3_prompt_embeds(model, ids, mask);
  ASSERT_EQ(embeds.size(), 3u);
  for (size_t i = 0; i < embeds.size(); ++i) {
    const auto want = e.at("prompt_embeds." + std::to_string(i));
    ASSERT_EQ(embeds[i].sizes(), want.sizes()) << i;
    EXPECT_LT(max_abs(embeds[i], want), 2e-5) << "prompt_embeds." << i;
  }
  // Without a mask (nothing padded): the causal mask alone.
  const auto nopad = model->forward(e.at("input_ids_nopad"));
  for (size_t k = 0; k < nopad.hidden_states.size(); ++k) {
    EXPECT_LT(max_abs(nopad.hidden_states[k], e.at("hidden_states_nopad." + std::to_string(k))),
              2e-5)
        << "hidden_states_nopad." << k;
  }
}

TEST(Qwen3Model, Bf16FollowsTransformersCasts) {
  torch::NoGradGuard no_grad;
  auto model = load_qwen3_model(kQwen3Dir + "/text_encoder", torch::kBFloat16);
  const auto& e = qwen3_expected();
  const auto got = model->hidden_state(e.at("input_ids"), e.at("attention_mask"), -2);
  ASSERT_EQ(got.scalar_type(), torch::kBFloat16);
  const auto want = e.at("hidden_states_bf16.2");
  const auto ref32 = e.at("hidden_states.2");
  // Only the real positions: ZImagePipeline drops the padded ones.
  const auto keep = e.at("attention_mask").to(torch::kBool).unsqueeze(-1).expand_as(ref32);
  auto mean_abs = [&](const torch::Tensor& a, const torch::Tensor& b) {
    return (a.to(torch::kFloat64) - b.to(torch::kFloat64))
        .abs()
        .masked_select(keep)
        .mean()
        .item<double>();
  };
  const double diff = mean_abs(got, want);
  const double vs_float32 = mean_abs(want, ref32);
  const double ours_vs_float32 = mean_abs(got, ref32);
  std::cout << "bf16 mean abs diff " << diff << ", max " << max_abs(got, want)
            << "; bf16 reference vs float32: " << vs_float32 << ", ours vs float32 "
            << ours_vs_float32 << "\n";
  // bf16 rounds differently in LibTorch's and PyTorch's kernels (about one bf16 ulp here), so:
  // as close to float32 as the reference is, and within a bf16 ulp on average of it.
  EXPECT_LT(ours_vs_float32, 1.5 * vs_float32);
  EXPECT_LT(diff, 0.01);
}

TEST(Qwen3Model, ACausalLmCheckpointLoadsAndBadConfigsAreRefused) {
  torch::NoGradGuard no_grad;
  const auto dir = temp_dir("qwen3_causal_lm");
  fs::copy_file(kQwen3Dir + "/text_encoder/config.json", dir + "/config.json");
  difftrain::io::TensorMap weights;
  for (const char* shard :
       {"model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"}) {
    for (auto& [name, t] :
         difftrain::io::load_safetensors(kQwen3Dir + "/text_encoder/" + shard).tensors) {
      weights["model." + name] = t;
    }
  }
  weights["lm_head.weight"] = weights.at("model.embed_tokens.weight").clone();
  difftrain::io::save_safetensors(dir + "/model.safetensors", weights);
  auto model = load_qwen3_model(dir);
  const auto& e = qwen3_expected();
  EXPECT_LT(max_abs(model->hidden_state(e.at("input_ids"), e.at("attention_mask"), -2),
                    e.at("hidden_states.2")),
            2e-5);

  std::ifstream in(kQwen3Dir + "/text_encoder/config.json");
  const auto config = nlohmann::json::parse(in);
  auto refused = [&](const std::string& key, const nlohmann::json& value) {
    auto c = config;
    c[key] = value;
    write_text(dir + "/config.json", c.dump(2));
    return error_of([&] { load_qwen3_model(dir); });
  };
  EXPECT_HAS(refused("num_key_value_heads", 4), "\"num_key_value_heads\" (4) must divide");
  EXPECT_HAS(refused("rope_scaling", {{"rope_type", "yarn"}, {"factor", 4.0}}),
             "only the default RoPE is supported");
  EXPECT_HAS(refused("hidden_act", "gelu"), dir + "/config.json");
  EXPECT_HAS(refused("hidden_size", 0), "hidden_size");
  // A missing weight: the strict load names it.
  write_text(dir + "/config.json", config.dump(2));
  weights.erase("model.norm.weight");
  difftrain::io::save_safetensors(dir + "/model.safetensors", weights);
  EXPECT_HAS(error_of([&] { load_qwen3_model(dir); }), "norm.weight");
  EXPECT_HAS(error_of([&] { load_qwen3_model(dir + "/nope"); }), "no such folder");
}

}  // namespace
