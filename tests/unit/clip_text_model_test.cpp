// Transformers' CLIPTextModel: parity with the tiny SD fixture, clip skip and the gelu variants
// against an independent float64 transcription, exact key names, strict loading, config errors.

#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>

namespace {

using difftrain::io::TensorMap;
using difftrain::models::ClipTextConfig;
using difftrain::models::ClipTextModel;
using difftrain::test::error_of;
using difftrain::test::max_abs;
using difftrain::test::read_json;
using difftrain::test::temp_dir;
using difftrain::test::write_text;
using nlohmann::json;
namespace fs = std::filesystem;

using difftrain::test::kTinySdGolden;
const std::string kTextEncoder = kTinySdGolden + "text_encoder";

torch::Tensor act_reference(const std::string& name, const torch::Tensor& x) {
  if (name == "quick_gelu") return x * torch::sigmoid(1.702 * x);
  if (name == "gelu") return 0.5 * x * (1 + torch::erf(x / std::sqrt(2.0)));
  return 0.5 * x * (1 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * x.pow(3))));
}

// An independent transcription of CLIPTextTransformer from the state dict: plain ops, an additive
// causal mask, the scale applied to the scores. Returns final_layer_norm(output of `layers`).
torch::Tensor reference_hidden(const TensorMap& w, const ClipTextConfig& c,
                               const torch::Tensor& ids, int64_t layers) {
  auto W = [&](const std::string& k) { return w.at("text_model." + k); };
  const int64_t B = ids.size(0), S = ids.size(1), D = c.hidden_size;
  const int64_t H = c.num_attention_heads, d = D / H;
  const double eps = c.layer_norm_eps;
  torch::Tensor h = W("embeddings.token_embedding.weight").index_select(0, ids.flatten());
  h = h.view({B, S, D}) + W("embeddings.position_embedding.weight").narrow(0, 0, S);
  const torch::Tensor mask =
      torch::full({S, S}, -INFINITY, h.options()).triu(1);  // additive, as Transformers'
  for (int64_t l = 0; l < layers; ++l) {
    const std::string p = "encoder.layers." + std::to_string(l) + ".";
    auto lin = [&](const torch::Tensor& x, const std::string& n) {
      return torch::linear(x, W(p + n + ".weight"), W(p + n + ".bias"));
    };
    auto heads = [&](const torch::Tensor& t) {
      return t.reshape({B, S, H, d}).permute({0, 2, 1, 3});
    };
    torch::Tensor x =
        torch::layer_norm(h, {D}, W(p + "layer_norm1.weight"), W(p + "layer_norm1.bias"), eps);
    torch::Tensor q = heads(lin(x, "self_attn.q_proj")), k = heads(lin(x, "self_attn.k_proj"));
    torch::Tensor v = heads(lin(x, "self_attn.v_proj"));
    torch::Tensor probs =
        (torch::matmul(q, k.transpose(2, 3)) / std::sqrt(double(d)) + mask).softmax(-1);
    torch::Tensor a = torch::matmul(probs, v).permute({0, 2, 1, 3}).reshape({B, S, D});
    h = h + lin(a, "self_attn.out_proj");
    x = torch::layer_norm(h, {D}, W(p + "layer_norm2.weight"), W(p + "layer_norm2.bias"), eps);
    h = h + lin(act_reference(c.hidden_act, lin(x, "mlp.fc1")), "mlp.fc2");
  }
  return torch::layer_norm(h, {D}, W("final_layer_norm.weight"), W("final_layer_norm.bias"), eps);
}

TensorMap to_double(const TensorMap& in, bool requires_grad = false) {
  TensorMap out;
  for (const auto& [k, v] : in) {
    out[k] = v.detach().to(torch::kFloat64).clone().set_requires_grad(requires_grad);
  }
  return out;
}

ClipTextConfig tiny_config(const std::string& act) {
  ClipTextConfig c;
  c.vocab_size = 50;
  c.hidden_size = 16;
  c.intermediate_size = 40;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 2;
  c.max_position_embeddings = 12;
  c.hidden_act = act;
  c.eos_token_id = 49;
  return c;
}

// Random weights everywhere, LayerNorms included, so no path is an identity.
void randomize(ClipTextModel& model, uint64_t seed) {
  torch::manual_seed(seed);
  torch::NoGradGuard no_grad;
  for (auto& p : model->named_parameters()) {
    const bool norm_weight =
        p.key().find("norm") != std::string::npos && p.key().find(".weight") != std::string::npos;
    p.value().copy_(norm_weight ? 1 + 0.3 * torch::randn_like(p.value())
                                : 0.5 * torch::randn_like(p.value()));
  }
}

TEST(ClipTextModel, MatchesTransformersFixture) {
  ClipTextModel model = difftrain::models::load_clip_text_model(kTextEncoder);
  model->eval();
  auto io = difftrain::io::load_safetensors(kTextEncoder + "/io.safetensors").tensors;
  torch::NoGradGuard no_grad;
  auto out = model->forward(io.at("input_ids"));
  ASSERT_EQ(out.last_hidden_state.sizes(), io.at("last_hidden_state").sizes());
  ASSERT_EQ(out.pooler_output.sizes(), io.at("pooler_output").sizes());
  const double d_last = max_abs(out.last_hidden_state, io.at("last_hidden_state"));
  const double d_pool = max_abs(out.pooler_output, io.at("pooler_output"));
  std::printf(
      "CLIPTextModel max |last_hidden_state - ref| = %.3g, |pooler_output - ref| = %.3g"
      " (tol 1e-4)\n",
      d_last, d_pool);
  EXPECT_LT(d_last, 1e-4);
  EXPECT_LT(d_pool, 1e-4);
  // The output depends on the ids: another prompt gives something else.
  auto other = model->forward(io.at("input_ids").flip(0));
  EXPECT_GT(max_abs(other.last_hidden_state, io.at("last_hidden_state")), 1e-2);
}

TEST(ClipTextModel, KeysAreExactlyTransformersKeys) {
  ClipTextModel model(difftrain::models::read_clip_text_config(kTextEncoder + "/config.json"));
  auto file = difftrain::io::load_safetensors(kTextEncoder + "/model.safetensors").tensors;
  auto own = difftrain::models::named_tensors(*model);
  std::vector<std::string> a, b;
  for (const auto& [k, v] : own) a.push_back(k);
  for (const auto& [k, v] : file) b.push_back(k);
  EXPECT_EQ(a, b);
  EXPECT_EQ(a.size(), 36u);
  for (const auto& [k, v] : file) {
    ASSERT_TRUE(own.count(k)) << k;
    EXPECT_EQ(own.at(k).sizes(), v.sizes()) << k;
  }
  EXPECT_EQ(model->layers().size(), 2u);
  EXPECT_EQ(model->layers()[0]->hook_class_name(), "CLIPEncoderLayer");
  EXPECT_TRUE(difftrain::core::is_hookable(*model->layers()[0]));
}

// Diffusers' clip_skip: final_layer_norm(hidden_states[-(skip + 1)]); the pooled output stays the
// full model's.
TEST(ClipTextModel, SkipMatchesFloat64Reference) {
  ClipTextModel model = difftrain::models::load_clip_text_model(kTextEncoder);
  const ClipTextConfig& c = model->config();
  auto io = difftrain::io::load_safetensors(kTextEncoder + "/io.safetensors").tensors;
  const torch::Tensor ids = io.at("input_ids");
  const TensorMap w64 = to_double(difftrain::models::named_tensors(*model));
  torch::NoGradGuard no_grad;
  auto full = model->forward(ids, 0);
  auto skipped = model->forward(ids, 1);
  const torch::Tensor ref0 = reference_hidden(w64, c, ids, c.num_hidden_layers);
  const torch::Tensor ref1 = reference_hidden(w64, c, ids, c.num_hidden_layers - 1);
  const double d0 = max_abs(full.last_hidden_state, ref0);
  const double d1 = max_abs(skipped.last_hidden_state, ref1);
  std::printf(
      "CLIP vs float64 transcription: skip 0 max diff %.3g, skip 1 max diff %.3g (tol "
      "1e-4)\n",
      d0, d1);
  EXPECT_LT(d0, 1e-4);
  EXPECT_LT(d1, 1e-4);
  EXPECT_GT(max_abs(skipped.last_hidden_state, full.last_hidden_state), 1e-2);
  EXPECT_TRUE(torch::equal(skipped.pooler_output, full.pooler_output));

  // The same as a model one layer shorter holding the same weights.
  ClipTextConfig shorter = c;
  shorter.num_hidden_layers = c.num_hidden_layers - 1;
  ClipTextModel cut(shorter);
  TensorMap w = difftrain::models::named_tensors(*model);
  const std::string last = "text_model.encoder.layers." + std::to_string(shorter.num_hidden_layers);
  for (auto it = w.begin(); it != w.end();) it = it->first.rfind(last, 0) == 0 ? w.erase(it) : ++it;
  difftrain::models::load_weights(*cut, w, "cut");
  const double d_cut = max_abs(cut->forward(ids).last_hidden_state, skipped.last_hidden_state);
  std::printf("CLIP skip 1 vs a %lld-layer model: max diff %.3g\n",
              static_cast<long long>(shorter.num_hidden_layers), d_cut);
  EXPECT_LT(d_cut, 1e-6);

  EXPECT_THROW(model->forward(ids, c.num_hidden_layers), c10::Error);
  EXPECT_THROW(model->forward(ids, -1), c10::Error);
}

// quick_gelu, gelu (exact) and gelu_new: outputs and every parameter's gradient against autograd
// through the float64 transcription (erf/tanh written out, so no LibTorch gelu kernel is involved).
TEST(ClipTextModel, ActivationsMatchFloat64ForwardAndGradients) {
  for (const std::string act : {"quick_gelu", "gelu", "gelu_new"}) {
    ClipTextConfig c = tiny_config(act);
    ClipTextModel model(c);
    randomize(model, 3);
    torch::manual_seed(4);
    // Row 0 has its eos at 5 and more after it (the first one pools); row 1 has none (position 0).
    torch::Tensor ids = torch::randint(0, 48, {2, 9}, torch::kLong);
    ids.index_put_({0, 5}, 49);
    ids.index_put_({0, 7}, 49);
    const torch::Tensor r1 = torch::randn({2, 9, c.hidden_size}, torch::kFloat64);
    const torch::Tensor r2 = torch::randn({2, c.hidden_size}, torch::kFloat64);

    auto out = model->forward(ids);
    torch::Tensor loss = (out.last_hidden_state * r1.to(torch::kFloat32)).sum() +
                         (out.pooler_output * r2.to(torch::kFloat32)).sum();
    loss.backward();

    TensorMap w64 = to_double(difftrain::models::named_tensors(*model), /*requires_grad=*/true);
    torch::Tensor ref = reference_hidden(w64, c, ids, c.num_hidden_layers);
    torch::Tensor pooled = torch::stack({ref[0][5], ref[1][0]});
    torch::Tensor ref_loss = (ref * r1).sum() + (pooled * r2).sum();
    std::vector<torch::Tensor> leaves;
    std::vector<std::string> names;
    for (const auto& [k, v] : w64) {
      names.push_back(k);
      leaves.push_back(v);
    }
    auto grads = torch::autograd::grad({ref_loss}, leaves, {}, false, false, /*allow_unused=*/true);

    const double d_out = max_abs(out.last_hidden_state, ref.detach());
    const double d_pool = max_abs(out.pooler_output, pooled.detach());
    double worst = 0;
    std::string worst_name;
    auto own = difftrain::models::named_tensors(*model);
    for (size_t i = 0; i < names.size(); ++i) {
      const torch::Tensor& g = own.at(names[i]).grad();
      ASSERT_TRUE(g.defined()) << act << " " << names[i];
      ASSERT_TRUE(torch::isfinite(g).all().item<bool>()) << act << " " << names[i];
      const double scale = std::max(1.0, grads[i].abs().max().item<double>());
      const double d = max_abs(g, grads[i]) / scale;
      if (d > worst) {
        worst = d;
        worst_name = names[i];
      }
    }
    std::printf(
        "CLIP %s vs float64: output %.3g, pooled %.3g, worst gradient %.3g (%s) (tol 1e-4,"
        " gradients relative to max(1, max|g|))\n",
        act.c_str(), d_out, d_pool, worst, worst_name.c_str());
    EXPECT_LT(d_out, 1e-4) << act;
    EXPECT_LT(d_pool, 1e-4) << act;
    EXPECT_LT(worst, 1e-4) << act;
  }
}

// Transformers' legacy rule: configs with eos_token_id 2 pool at the largest id.
TEST(ClipTextModel, LegacyEosTokenIdPoolsAtTheLargestId) {
  ClipTextConfig c = tiny_config("quick_gelu");
  c.eos_token_id = 2;
  ClipTextModel model(c);
  randomize(model, 5);
  torch::Tensor ids = torch::tensor({{1, 2, 40, 3, 2, 2}, {7, 45, 2, 9, 30, 2}}, torch::kLong);
  torch::NoGradGuard no_grad;
  auto out = model->forward(ids);
  EXPECT_TRUE(torch::equal(out.pooler_output[0], out.last_hidden_state[0][2]));
  EXPECT_TRUE(torch::equal(out.pooler_output[1], out.last_hidden_state[1][1]));
}

TEST(ClipTextModel, ReadsConfigsAndNamesBadFields) {
  const std::string dir = temp_dir("clip_config");
  const std::string path = dir + "/config.json";
  json base = read_json(kTextEncoder + "/config.json");
  auto error_with = [&](const std::string& key, const json& value) {
    json j = base;
    j[key] = value;
    write_text(path, j.dump());
    return error_of([&] { difftrain::models::read_clip_text_config(path); });
  };
  std::string msg = error_with("hidden_act", "relu");
  EXPECT_NE(msg.find(path + ": field \"hidden_act\" is \"relu\"; supported: quick_gelu, gelu, "
                            "gelu_new"),
            std::string::npos)
      << msg;
  msg = error_with("num_attention_heads", 5);
  EXPECT_NE(msg.find("field \"hidden_size\" (32) must be divisible by num_attention_heads (5)"),
            std::string::npos)
      << msg;
  msg = error_with("hidden_size", "32");
  EXPECT_NE(msg.find("field \"hidden_size\" must be an integer, got \"32\""), std::string::npos)
      << msg;
  msg = error_with("num_hidden_layers", 0);
  EXPECT_NE(msg.find("field \"num_hidden_layers\" must be >= 1"), std::string::npos) << msg;
  msg = error_with("model_type", "clip_vision_model");
  EXPECT_NE(msg.find("field \"model_type\" is \"clip_vision_model\""), std::string::npos) << msg;
  write_text(path, "{\"hidden_size\": 32,");
  msg = error_of([&] { difftrain::models::read_clip_text_config(path); });
  EXPECT_NE(msg.find(path + ": not valid JSON"), std::string::npos) << msg;
  msg = error_of([&] { difftrain::models::read_clip_text_config(dir + "/nope.json"); });
  EXPECT_NE(msg.find("nope.json"), std::string::npos) << msg;

  // A CLIPModel config: the text tower's fields under text_config.
  json clip = {{"model_type", "clip"}, {"text_config", base}, {"vision_config", json::object()}};
  write_text(path, clip.dump());
  ClipTextConfig c = difftrain::models::read_clip_text_config(path);
  EXPECT_EQ(c.hidden_size, 32);
  EXPECT_EQ(c.num_hidden_layers, 2);
  EXPECT_EQ(c.eos_token_id, 49407);
  fs::remove_all(dir);
}

TEST(ClipTextModel, LoadingIsStrictAndNamesTheProblem) {
  const std::string dir = temp_dir("clip_load");
  fs::copy_file(kTextEncoder + "/config.json", dir + "/config.json");
  const TensorMap good =
      difftrain::io::load_safetensors(kTextEncoder + "/model.safetensors").tensors;
  const std::string file = dir + "/model.safetensors";
  auto load = [&] { return difftrain::models::load_clip_text_model(dir); };

  TensorMap w = good;
  w.erase("text_model.encoder.layers.1.mlp.fc2.bias");
  difftrain::io::save_safetensors(file, w);
  std::string msg = error_of(load);
  EXPECT_NE(msg.find(file + ": the weights do not match the model's config; missing keys: "
                            "text_model.encoder.layers.1.mlp.fc2.bias"),
            std::string::npos)
      << msg;

  w = good;
  w["text_model.final_layer_norm.weight"] = torch::ones({31});
  difftrain::io::save_safetensors(file, w);
  msg = error_of(load);
  EXPECT_NE(msg.find("wrong shapes: text_model.final_layer_norm.weight (file [31], model [32])"),
            std::string::npos)
      << msg;

  // Keys without the text_model. prefix (a CLIPTextTransformer's state dict).
  TensorMap bare;
  for (const auto& [k, v] : good) bare[k.substr(std::string("text_model.").size())] = v;
  difftrain::io::save_safetensors(file, bare);
  msg = error_of(load);
  EXPECT_NE(msg.find("the keys lack the \"text_model.\" prefix"), std::string::npos) << msg;

  // Older checkpoints' position_ids buffer is ignored; half weights load into float32.
  w = good;
  w["text_model.embeddings.position_ids"] = torch::arange(77, torch::kLong).unsqueeze(0);
  for (auto& [k, v] : w) {
    if (v.is_floating_point()) v = v.to(torch::kFloat16);
  }
  difftrain::io::save_safetensors(dir + "/model.fp16.safetensors", w);
  fs::remove(file);
  ClipTextModel half = difftrain::models::load_clip_text_model(dir, "fp16");
  EXPECT_EQ(half->named_parameters()[0].value().scalar_type(), torch::kFloat32);
  msg = error_of(load);
  EXPECT_NE(msg.find(file + ": no such file"), std::string::npos) << msg;

  // Only pickle weights.
  fs::remove(dir + "/model.fp16.safetensors");
  write_text(dir + "/pytorch_model.bin", "not really a pickle");
  msg = error_of(load);
  EXPECT_NE(msg.find(dir + ": only pickle weights (pytorch_model.bin) found"), std::string::npos)
      << msg;
  EXPECT_NE(msg.find("save_pretrained(dir, safe_serialization=True)"), std::string::npos) << msg;

  msg = error_of([&] { difftrain::models::load_clip_text_model(dir + "/missing"); });
  EXPECT_NE(msg.find("not a folder"), std::string::npos) << msg;
  fs::remove_all(dir);
}

}  // namespace
