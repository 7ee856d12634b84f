// Transformers' Qwen3Model (qwen3_model.h), as modeling_qwen3.py computes it with eager attention:
// the same casts in bf16 (RMSNorm statistics, RoPE angles and softmax in float32, cast back).

#include "difftrain/models/text_encoders/qwen3_model.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/weight_index.h"
#include "difftrain/models/pretrained.h"

#include <torch/torch.h>

#include <filesystem>
#include <limits>

namespace difftrain::models {

namespace fs = std::filesystem;

namespace {

Linear qwen3_linear(int64_t in, int64_t out, bool bias) {
  return Linear(torch::nn::LinearOptions(in, out).bias(bias));
}

// x: [..., D] -> the halves swapped with the first negated (Transformers' rotate_half).
torch::Tensor rotate_half(const torch::Tensor& x) {
  const int64_t half = x.size(-1) / 2;
  return torch::cat({-x.narrow(-1, half, half), x.narrow(-1, 0, half)}, -1);
}

}  // namespace

Qwen3Options Qwen3Options::load(const std::string& path) {
  const nlohmann::json top = detail::parse_json_file(path, "a Transformers Qwen3 config.json");
  if (!top.is_object()) throw Error(path + ": expected a JSON object (a Qwen3 config.json)");
  const std::string model_type = top.value("model_type", std::string("qwen3"));
  const bool vl = model_type == "qwen2_5_vl" || model_type == "qwen2_vl";
  const bool qwen2 = vl || model_type == "qwen2";
  // Recent Transformers nest a VL model's language fields under text_config (and may keep a
  // copy at the top level): those win.
  nlohmann::json j = top;
  if (vl && top.contains("text_config") && top.at("text_config").is_object()) {
    for (const auto& [key, value] : top.at("text_config").items()) j[key] = value;
  }
  const detail::JsonFields r(j, path);
  Qwen3Options o;
  if (qwen2) {
    o.architecture(vl ? (model_type == "qwen2_vl" ? "Qwen2VLForConditionalGeneration"
                                                  : "Qwen2_5_VLForConditionalGeneration")
                      : "Qwen2Model");
    o.attention_bias(true);
    o.o_proj_bias(false);
    o.qk_norm(false);
    o.positions_from_mask(vl);
  }
  o.vocab_size(r.integer_at_least("vocab_size", o.vocab_size(), 1));
  o.hidden_size(r.integer_at_least("hidden_size", o.hidden_size(), 1));
  o.intermediate_size(r.integer_at_least("intermediate_size", o.intermediate_size(), 1));
  o.num_hidden_layers(r.integer_at_least("num_hidden_layers", o.num_hidden_layers(), 1));
  o.num_attention_heads(r.integer_at_least("num_attention_heads", o.num_attention_heads(), 1));
  o.num_key_value_heads(r.integer_at_least("num_key_value_heads", o.num_attention_heads(), 1));
  // Qwen2's heads are always hidden_size / heads wide (its config has no head_dim).
  o.head_dim(qwen2 ? o.hidden_size() / o.num_attention_heads()
                   : r.integer_at_least("head_dim", o.hidden_size() / o.num_attention_heads(), 2));
  if (qwen2 && o.hidden_size() % o.num_attention_heads() != 0) {
    r.fail("num_attention_heads",
           "must divide hidden_size (" + std::to_string(o.hidden_size()) + ")");
  }
  o.rms_norm_eps(r.number("rms_norm_eps", 1e-6));
  o.rope_theta(r.number("rope_theta", 10000.0));
  if (!qwen2) {
    o.attention_bias(r.boolean("attention_bias", false));
    o.o_proj_bias(o.attention_bias());
  }
  if (o.num_attention_heads() % o.num_key_value_heads() != 0) {
    r.fail("num_key_value_heads", "(" + std::to_string(o.num_key_value_heads()) +
                                      ") must divide num_attention_heads (" +
                                      std::to_string(o.num_attention_heads()) + ")");
  }
  if (o.head_dim() % 2 != 0) r.fail("head_dim", "must be even (RoPE rotates pairs)");
  if (!(o.rms_norm_eps() > 0)) r.fail("rms_norm_eps", "must be > 0");
  if (!(o.rope_theta() > 0)) r.fail("rope_theta", "must be > 0");
  r.choice("hidden_act", "silu", {"silu"});
  if (r.has("rope_scaling")) {
    const nlohmann::json s = r.at("rope_scaling");
    const std::string type =
        s.is_object() ? s.value("rope_type", s.value("type", std::string("default"))) : "?";
    // Qwen2.5-VL says "default" (or "mrope") with an mrope_section: plain angles per section.
    if (type != "default" && !(vl && type == "mrope")) {
      r.fail("rope_scaling",
             "is " + s.dump() +
                 "; only the default RoPE is supported (with Qwen2.5-VL's mrope_section)");
    }
    if (s.is_object() && s.contains("mrope_section")) {
      std::vector<int64_t> sections;
      int64_t sum = 0;
      for (const auto& e : s.at("mrope_section")) {
        if (!e.is_number_integer() || e.get<int64_t>() < 1) {
          r.fail("rope_scaling", "mrope_section must be positive integers, got " + s.dump());
        }
        sections.push_back(e.get<int64_t>());
        sum += sections.back();
      }
      if (sections.size() != 3 || sum != o.head_dim() / 2) {
        r.fail("rope_scaling", "mrope_section must be 3 sizes summing to head_dim / 2 = " +
                                   std::to_string(o.head_dim() / 2) + ", got " + s.dump());
      }
      o.mrope_section(sections);
    }
  }
  if (r.boolean("use_sliding_window", false)) {
    r.fail("use_sliding_window", "is true; sliding-window attention is not supported");
  }
  return o;
}

Qwen3RMSNormImpl::Qwen3RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor Qwen3RMSNormImpl::forward(const torch::Tensor& x) {
  const auto h = x.to(torch::kFloat32);
  const auto normed = h * torch::rsqrt(h.pow(2).mean(-1, true) + eps_);
  return weight * normed.to(x.scalar_type());
}

Qwen3DecoderLayerImpl::Qwen3DecoderLayerImpl(const Qwen3Options& o) : options_(o) {
  const int64_t d = o.hidden_size();
  const int64_t hd = o.head_dim();
  auto attn = register_module("self_attn", std::make_shared<torch::nn::Module>());
  q_proj_ = attn->register_module(
      "q_proj", qwen3_linear(d, o.num_attention_heads() * hd, o.attention_bias()));
  k_proj_ = attn->register_module(
      "k_proj", qwen3_linear(d, o.num_key_value_heads() * hd, o.attention_bias()));
  v_proj_ = attn->register_module(
      "v_proj", qwen3_linear(d, o.num_key_value_heads() * hd, o.attention_bias()));
  o_proj_ = attn->register_module("o_proj",
                                  qwen3_linear(o.num_attention_heads() * hd, d, o.o_proj_bias()));
  if (o.qk_norm()) {
    q_norm_ = attn->register_module("q_norm", Qwen3RMSNorm(hd, o.rms_norm_eps()));
    k_norm_ = attn->register_module("k_norm", Qwen3RMSNorm(hd, o.rms_norm_eps()));
  }
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>());
  gate_proj_ = mlp->register_module("gate_proj", qwen3_linear(d, o.intermediate_size(), false));
  up_proj_ = mlp->register_module("up_proj", qwen3_linear(d, o.intermediate_size(), false));
  down_proj_ = mlp->register_module("down_proj", qwen3_linear(o.intermediate_size(), d, false));
  input_layernorm_ = register_module("input_layernorm", Qwen3RMSNorm(d, o.rms_norm_eps()));
  post_attention_layernorm_ =
      register_module("post_attention_layernorm", Qwen3RMSNorm(d, o.rms_norm_eps()));
}

torch::Tensor Qwen3DecoderLayerImpl::forward(const torch::Tensor& h, const torch::Tensor& cos,
                                             const torch::Tensor& sin, const torch::Tensor& mask) {
  const int64_t B = h.size(0);
  const int64_t S = h.size(1);
  const int64_t H = options_.num_attention_heads();
  const int64_t KV = options_.num_key_value_heads();
  const int64_t hd = options_.head_dim();
  const auto x = input_layernorm_(h);
  // [B, S, heads, hd] -> per-head RMS norm -> [B, heads, S, hd] -> RoPE.
  auto q = q_proj_(x).view({B, S, H, hd});
  auto k = k_proj_(x).view({B, S, KV, hd});
  if (options_.qk_norm()) {
    q = q_norm_(q);
    k = k_norm_(k);
  }
  q = q.transpose(1, 2);
  k = k.transpose(1, 2);
  auto v = v_proj_(x).view({B, S, KV, hd}).transpose(1, 2);
  q = q * cos + rotate_half(q) * sin;
  k = k * cos + rotate_half(k) * sin;
  if (KV != H) {  // each key/value head serves H / KV consecutive query heads (repeat_kv)
    k = k.repeat_interleave(H / KV, 1);
    v = v.repeat_interleave(H / KV, 1);
  }
  auto scores = torch::matmul(q, k.transpose(2, 3)) * std::pow(static_cast<double>(hd), -0.5);
  scores = scores + mask;
  const auto probs = torch::softmax(scores, -1, torch::kFloat32).to(q.scalar_type());
  const auto attn = torch::matmul(probs, v).transpose(1, 2).reshape({B, S, H * hd});
  const auto h1 = h + o_proj_(attn);
  const auto y = post_attention_layernorm_(h1);
  return h1 + down_proj_(torch::silu(gate_proj_(y)) * up_proj_(y));
}

Qwen3ModelImpl::Qwen3ModelImpl(const Qwen3Options& options) : options_(options) {
  embed_tokens_ = register_module(
      "embed_tokens", torch::nn::Embedding(options.vocab_size(), options.hidden_size()));
  auto list = register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.num_hidden_layers(); ++i) {
    layers_.push_back(Qwen3DecoderLayer(options));
    list->push_back(layers_.back());
  }
  norm_ = register_module("norm", Qwen3RMSNorm(options.hidden_size(), options.rms_norm_eps()));
}

Qwen3Output Qwen3ModelImpl::forward(const torch::Tensor& input_ids,
                                    const torch::Tensor& attention_mask, int64_t stop,
                                    const torch::Tensor& position_ids,
                                    const torch::Tensor& inputs_embeds) {
  const auto& shape_of = inputs_embeds.defined() ? inputs_embeds : input_ids;
  TORCH_CHECK(inputs_embeds.defined() ? inputs_embeds.dim() == 3 : input_ids.dim() == 2,
              "Qwen3Model: input_ids must be [B, S] (inputs_embeds [B, S, hidden]), got ",
              shape_of.sizes());
  const int64_t L = options_.num_hidden_layers();
  if (stop < 0) stop += L + 1;
  TORCH_CHECK(stop >= 0 && stop <= L, "Qwen3Model: hidden state ", stop, " is out of [0, ", L, "]");
  const int64_t B = shape_of.size(0);
  const int64_t S = shape_of.size(1);
  Qwen3Output out;
  auto h = inputs_embeds.defined() ? inputs_embeds : embed_tokens_(input_ids);
  out.hidden_states.push_back(h);
  if (stop == 0) return out;
  const auto dtype = h.scalar_type();
  const auto device = h.device();

  // RoPE angles in float32 (inv_freq stays float32 as from_pretrained leaves it), then cast.
  // Positions: [3, B, S] per multimodal axis (text alone: the same on each).
  const int64_t hd = options_.head_dim();
  const auto inv_freq =
      1.0 / torch::pow(options_.rope_theta(),
                       torch::arange(0, hd, 2, torch::kFloat32) / static_cast<double>(hd));
  torch::Tensor pos;
  if (position_ids.defined()) {
    TORCH_CHECK(position_ids.dim() == 3 && position_ids.size(0) == 3 && position_ids.size(1) == B &&
                    position_ids.size(2) == S,
                "Qwen3Model: position_ids must be [3, ", B, ", ", S, "], got ",
                position_ids.sizes());
    pos = position_ids.to(torch::kFloat32).cpu();
  } else if (options_.positions_from_mask() && attention_mask.defined()) {
    const auto m = attention_mask.to(torch::kInt64).cpu();
    pos = (m.cumsum(-1) - 1)
              .masked_fill(m == 0, 1)
              .to(torch::kFloat32)
              .unsqueeze(0)
              .expand({3, B, S});
  } else {
    pos = torch::arange(S, torch::kFloat32).view({1, 1, S}).expand({3, B, S});
  }
  // [3, B, S, hd/2] -> cat(freqs, freqs) [3, B, S, hd]
  auto freqs = pos.unsqueeze(-1) * inv_freq.view({1, 1, 1, -1});
  auto emb = torch::cat({freqs, freqs}, -1);
  torch::Tensor angle;
  const auto& sections = options_.mrope_section();
  if (sections.empty()) {
    angle = emb[0];
  } else {  // sections doubled (the two halves of emb), each taken from axis i % 3
    std::vector<torch::Tensor> parts;
    int64_t at = 0;
    for (size_t i = 0; i < 2 * sections.size(); ++i) {
      const int64_t n = sections[i % sections.size()];
      parts.push_back(emb[static_cast<int64_t>(i % 3)].narrow(-1, at, n));
      at += n;
    }
    angle = torch::cat(parts, -1);
  }
  const auto cos = angle.cos().to(dtype).unsqueeze(1).to(device);  // [B, 1, S, hd]
  const auto sin = angle.sin().to(dtype).unsqueeze(1).to(device);

  // Causal and padding masks, additive with the dtype's lowest value (Transformers' eager path).
  const double lowest = dtype == torch::kBFloat16  ? -3.3895313892515355e38
                        : dtype == torch::kFloat16 ? -65504.0
                        : dtype == torch::kFloat64 ? std::numeric_limits<double>::lowest()
                                                   : std::numeric_limits<float>::lowest();
  auto allowed = torch::ones({S, S}, torch::TensorOptions(torch::kBool).device(device))
                     .tril()
                     .view({1, 1, S, S});
  if (attention_mask.defined()) {
    TORCH_CHECK(
        attention_mask.dim() == 2 && attention_mask.size(0) == B && attention_mask.size(1) == S,
        "Qwen3Model: attention_mask must be [", B, ", ", S, "], got ", attention_mask.sizes());
    allowed = allowed & attention_mask.to(device).to(torch::kBool).view({B, 1, 1, S});
  }
  const auto mask = torch::zeros(allowed.sizes(), torch::TensorOptions(dtype).device(device))
                        .masked_fill(allowed.logical_not(), lowest);

  for (int64_t i = 0; i < stop; ++i) {
    h = layers_[static_cast<size_t>(i)]->forward(h, cos, sin, mask);
    out.hidden_states.push_back(i + 1 == L ? norm_(h) : h);
  }
  return out;
}

torch::Tensor Qwen3ModelImpl::hidden_state(const torch::Tensor& input_ids,
                                           const torch::Tensor& attention_mask, int64_t index) {
  return forward(input_ids, attention_mask, index).hidden_states.back();
}

Qwen3Model load_qwen3_model(const std::string& dir, torch::Dtype dtype, const std::string& variant,
                            io::TensorMap* visual) {
  const std::string what =
      "a Transformers Qwen3Model or Qwen2.5-VL folder (config.json + model.safetensors or its "
      "shards), e.g. a pipeline's text_encoder/";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(dir + ": no such folder; expected " + what);
  const fs::path config = fs::path(dir) / "config.json";
  if (!fs::is_regular_file(config, ec)) throw Error(dir + ": no config.json; expected " + what);
  Qwen3Model model(Qwen3Options::load(config.string()));
  model->to(dtype);
  const io::WeightFiles files = io::find_weight_files(dir, "model", variant);
  io::TensorMap loaded = io::load_weight_files(files, dtype);
  // A Qwen3ForCausalLM checkpoint: the model under "model.", and an lm_head the encoder lacks.
  // Qwen2.5-VL's: the language model under "model." (or "model.language_model." as recent
  // Transformers save it) beside the vision tower ("visual." / "model.visual."), not read here.
  io::TensorMap weights;
  const auto starts = [](const std::string& n, const char* p) { return n.rfind(p, 0) == 0; };
  for (auto& [name, tensor] : loaded) {
    if (name == "lm_head.weight") continue;
    if (starts(name, "visual.") || starts(name, "model.visual.")) {
      if (visual != nullptr) {
        (*visual)[name.substr(starts(name, "visual.") ? 7 : 13)] = std::move(tensor);
      }
      continue;
    }
    const std::string key = starts(name, "model.language_model.") ? name.substr(21)
                            : starts(name, "model.")              ? name.substr(6)
                                                                  : name;
    weights[key] = std::move(tensor);
  }
  load_weights(*model, weights, files.index.empty() ? files.files.at(0) : files.index);
  return model;
}

std::vector<torch::Tensor> qwen3_prompt_embeds(Qwen3Model& model, const torch::Tensor& input_ids,
                                               const torch::Tensor& attention_mask) {
  const auto hidden = model->hidden_state(input_ids, attention_mask, -2);
  std::vector<torch::Tensor> out;
  const auto keep = attention_mask.to(torch::kBool);
  for (int64_t i = 0; i < hidden.size(0); ++i) out.push_back(hidden[i].index({keep[i]}));
  return out;
}

}  // namespace difftrain::models
