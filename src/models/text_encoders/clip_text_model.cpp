#include "difftrain/models/text_encoders/clip_text_model.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/pretrained.h"

#include <torch/autograd.h>

#include <cmath>
#include <filesystem>
#include <limits>

namespace difftrain::models {

namespace fs = std::filesystem;

namespace {

const std::vector<std::string> kHiddenActs = {"quick_gelu", "gelu", "gelu_new"};

torch::Tensor clip_activation(const std::string& name, const torch::Tensor& x) {
  if (name == "quick_gelu") return x * torch::sigmoid(1.702 * x);
  if (name == "gelu") return models::gelu(x);
  return models::gelu(x, /*tanh_approximation=*/true);  // gelu_new: Transformers' NewGELUActivation
}

torch::nn::LayerNorm layer_norm(const ClipTextConfig& c) {
  return torch::nn::LayerNorm(
      torch::nn::LayerNormOptions({c.hidden_size}).eps(c.layer_norm_eps).elementwise_affine(true));
}

}  // namespace

// ------------------------------------------------------------------ config

ClipTextConfig read_clip_text_config(const std::string& path) {
  return parse_clip_text_config(io::read_file(path), path);
}

ClipTextConfig parse_clip_text_config(const std::string& json_text, const std::string& path) {
  const nlohmann::json root =
      detail::parse_json_text(json_text, path, "a Transformers CLIPTextModel config.json");
  if (!root.is_object()) throw Error(path + ": a CLIPTextModel config must be a JSON object");
  detail::JsonFields top(root, path);
  const std::string model_type = top.string("model_type", "clip_text_model");
  // A CLIPModel's config nests the text tower's fields under text_config.
  const bool nested = model_type == "clip" || (top.has("text_config") && !top.has("hidden_size"));
  if (model_type != "clip_text_model" && model_type != "clip") {
    top.fail("model_type", "is \"" + model_type +
                               "\"; supported: clip_text_model, clip (is this the text_encoder "
                               "folder?)");
  }
  if (nested && (!top.has("text_config") || !root.at("text_config").is_object())) {
    top.fail("text_config", "must be an object holding the text tower's fields");
  }
  const nlohmann::json& j = nested ? root.at("text_config") : root;
  const std::string source = nested ? path + " (text_config)" : path;
  detail::JsonFields r(j, source);

  ClipTextConfig c;
  c.source = path;
  c.vocab_size = r.integer_at_least("vocab_size", c.vocab_size, 1);
  c.hidden_size = r.integer_at_least("hidden_size", c.hidden_size, 1);
  c.intermediate_size = r.integer_at_least("intermediate_size", c.intermediate_size, 1);
  c.num_hidden_layers = r.integer_at_least("num_hidden_layers", c.num_hidden_layers, 1);
  c.num_attention_heads = r.integer_at_least("num_attention_heads", c.num_attention_heads, 1);
  c.max_position_embeddings =
      r.integer_at_least("max_position_embeddings", c.max_position_embeddings, 1);
  c.hidden_act = r.choice("hidden_act", c.hidden_act, kHiddenActs);
  c.layer_norm_eps = r.number("layer_norm_eps", c.layer_norm_eps);
  if (!(c.layer_norm_eps > 0)) r.fail("layer_norm_eps", "must be positive");
  c.bos_token_id = r.integer("bos_token_id", c.bos_token_id);
  c.eos_token_id = r.integer("eos_token_id", c.eos_token_id);
  c.pad_token_id = r.integer("pad_token_id", c.pad_token_id);
  bool with_projection = false;
  if (root.contains("architectures") && root["architectures"].is_array()) {
    for (const auto& a : root["architectures"]) {
      with_projection = with_projection ||
                        (a.is_string() && a.get<std::string>() == "CLIPTextModelWithProjection");
    }
  }
  c.with_projection = with_projection;
  c.projection_dim = r.integer_at_least("projection_dim", c.projection_dim, 1);
  if (c.hidden_size % c.num_attention_heads != 0) {
    r.fail("hidden_size", "(" + std::to_string(c.hidden_size) +
                              ") must be divisible by num_attention_heads (" +
                              std::to_string(c.num_attention_heads) + ")");
  }
  return c;
}

// ------------------------------------------------------------------ encoder layer

ClipEncoderLayerImpl::ClipEncoderLayerImpl(const ClipTextConfig& config, bool causal)
    : config_(config), causal_(causal) {
  TORCH_CHECK(config.hidden_size % config.num_attention_heads == 0,
              "CLIPEncoderLayer: hidden_size ", config.hidden_size,
              " is not a multiple of num_attention_heads ", config.num_attention_heads);
  const int64_t w = config.hidden_size;
  auto self_attn =
      register_module("self_attn", std::make_shared<torch::nn::Module>("CLIPAttention"));
  k_proj_ = self_attn->register_module("k_proj", Linear(w, w));
  v_proj_ = self_attn->register_module("v_proj", Linear(w, w));
  q_proj_ = self_attn->register_module("q_proj", Linear(w, w));
  out_proj_ = self_attn->register_module("out_proj", Linear(w, w));
  layer_norm1_ = register_module("layer_norm1", layer_norm(config));
  auto mlp = register_module("mlp", std::make_shared<torch::nn::Module>("CLIPMLP"));
  fc1_ = mlp->register_module("fc1", Linear(w, config.intermediate_size));
  fc2_ = mlp->register_module("fc2", Linear(config.intermediate_size, w));
  layer_norm2_ = register_module("layer_norm2", layer_norm(config));
}

torch::Tensor ClipEncoderLayerImpl::forward_impl(const torch::Tensor& h) {
  // h: [B, S, W]
  TORCH_CHECK(h.dim() == 3 && h.size(2) == config_.hidden_size, "CLIPEncoderLayer expects [B, S, ",
              config_.hidden_size, "], got ", h.sizes());
  const int64_t B = h.size(0), S = h.size(1), W = h.size(2);
  const int64_t heads = config_.num_attention_heads, d = W / heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));

  torch::Tensor x = layer_norm1_(h);
  // [B, S, W] -> [B, heads, S, d]
  auto split = [&](const torch::Tensor& t) { return t.view({B, S, heads, d}).transpose(1, 2); };
  torch::Tensor q = split(q_proj_(x) * scale), k = split(k_proj_(x)), v = split(v_proj_(x));
  torch::Tensor scores = torch::matmul(q, k.transpose(-1, -2));  // [B, heads, S, S]
  // Causal: query i sees keys j <= i. Key 0 is always visible, so -inf never fills a whole row.
  if (causal_) {
    const torch::Tensor future =
        torch::ones({S, S}, torch::TensorOptions().dtype(torch::kBool).device(h.device())).triu(1);
    scores = scores.masked_fill(future, -std::numeric_limits<double>::infinity());
  }
  const auto dtype = scores.scalar_type();
  const bool reduced = dtype == torch::kFloat16 || dtype == torch::kBFloat16;
  torch::Tensor probs = (reduced ? scores.to(torch::kFloat32) : scores).softmax(-1).to(dtype);
  torch::Tensor attn = torch::matmul(probs, v).transpose(1, 2).reshape({B, S, W});
  torch::Tensor out = h + out_proj_(attn);

  x = fc2_(clip_activation(config_.hidden_act, fc1_(layer_norm2_(out))));
  return out + x;
}

torch::Tensor ClipEncoderLayerImpl::forward(const torch::Tensor& h) {
  core::ForwardScope scope(*this);
  return scope.output(forward_impl(h));
}

// ------------------------------------------------------------------ text model

ClipTextModelImpl::ClipTextModelImpl(const ClipTextConfig& config) : config_(config) {
  auto text_model =
      register_module("text_model", std::make_shared<torch::nn::Module>("CLIPTextTransformer"));
  auto embeddings = text_model->register_module(
      "embeddings", std::make_shared<torch::nn::Module>("CLIPTextEmbeddings"));
  token_embedding_ = embeddings->register_module(
      "token_embedding", torch::nn::Embedding(config.vocab_size, config.hidden_size));
  position_embedding_ = embeddings->register_module(
      "position_embedding",
      torch::nn::Embedding(config.max_position_embeddings, config.hidden_size));
  auto encoder =
      text_model->register_module("encoder", std::make_shared<torch::nn::Module>("CLIPEncoder"));
  auto layers = encoder->register_module("layers", torch::nn::ModuleList());
  for (int64_t i = 0; i < config.num_hidden_layers; ++i) {
    layers_.push_back(ClipEncoderLayer(config));
    layers->push_back(layers_.back());
  }
  final_layer_norm_ = text_model->register_module("final_layer_norm", layer_norm(config));
  if (config.with_projection) {
    text_projection_ = register_module(
        "text_projection",
        Linear(torch::nn::LinearOptions(config.hidden_size, config.projection_dim).bias(false)));
  }
}

ClipTextOutput ClipTextModelImpl::forward(const torch::Tensor& input_ids, int64_t skip,
                                          bool output_hidden_states) {
  // input_ids: [B, S] int64 -> last_hidden_state [B, S, W], pooler_output [B, W]
  TORCH_CHECK(input_ids.dim() == 2, "CLIPTextModel: input_ids must be [B, S], got ",
              input_ids.sizes());
  TORCH_CHECK(input_ids.scalar_type() == torch::kLong || input_ids.scalar_type() == torch::kInt,
              "CLIPTextModel: input_ids must be int64, got ", input_ids.scalar_type());
  const int64_t B = input_ids.size(0), S = input_ids.size(1);
  TORCH_CHECK(S >= 1 && S <= config_.max_position_embeddings, "CLIPTextModel: sequence length ", S,
              " is not in [1, ", config_.max_position_embeddings,
              "] (max_position_embeddings); tokenize with truncation");
  TORCH_CHECK(skip >= 0 && skip < config_.num_hidden_layers, "CLIPTextModel: skip ", skip,
              " is not in [0, ", config_.num_hidden_layers,
              ") (num_hidden_layers); Diffusers' clip_skip = skip, kohya's clip_skip N = skip N-1");
  if (input_ids.numel() > 0) {
    const int64_t lo = input_ids.min().item<int64_t>(), hi = input_ids.max().item<int64_t>();
    TORCH_CHECK(lo >= 0 && hi < config_.vocab_size, "CLIPTextModel: token ids must be in [0, ",
                config_.vocab_size, ") (vocab_size), got [", lo, ", ", hi, "]");
  }
  const torch::Tensor ids = input_ids.to(torch::kLong);
  const torch::Tensor positions =
      torch::arange(S, torch::TensorOptions().dtype(torch::kLong).device(ids.device()));
  torch::Tensor h = token_embedding_(ids) + position_embedding_(positions).unsqueeze(0);

  const size_t keep = static_cast<size_t>(config_.num_hidden_layers - skip);
  torch::Tensor kept;  // the output of layer `keep` (1-based) when skip > 0
  ClipTextOutput out;
  if (output_hidden_states) out.hidden_states.push_back(h);
  for (size_t i = 0; i < layers_.size(); ++i) {
    h = layers_[i](h);
    if (i + 1 == keep) kept = h;
    if (output_hidden_states) out.hidden_states.push_back(h);
  }
  torch::Tensor last = final_layer_norm_(h);
  out.last_hidden_state = skip > 0 ? final_layer_norm_(kept) : last;

  // Transformers pools at the first eos_token_id of each row; legacy configs (eos_token_id 2)
  // pool at the largest id, which is CLIP's end-of-text token.
  torch::Tensor index = config_.eos_token_id == 2
                            ? ids.argmax(-1)
                            : ids.eq(config_.eos_token_id).to(torch::kInt).argmax(-1);
  const torch::Tensor rows =
      torch::arange(B, torch::TensorOptions().dtype(torch::kLong).device(ids.device()));
  out.pooler_output = last.index({rows, index});
  if (!text_projection_.is_empty()) out.text_embeds = text_projection_(out.pooler_output);
  return out;
}

// ------------------------------------------------------------------ loading

ClipTextModel load_clip_text_model(const std::string& dir, const std::string& variant,
                                   bool with_projection) {
  if (!fs::is_directory(dir)) {
    throw Error(dir +
                ": not a folder; expected a Transformers CLIPTextModel folder (config.json + "
                "model.safetensors), e.g. a pipeline's text_encoder/");
  }
  const std::string file =
      variant.empty() ? "model.safetensors" : "model." + variant + ".safetensors";
  const fs::path path = fs::path(dir) / file;
  if (!fs::exists(path)) {
    if (fs::exists(fs::path(dir) / "model.safetensors.index.json")) {
      throw Error(dir +
                  ": sharded weights (model.safetensors.index.json) are not supported yet; "
                  "save the text encoder unsharded");
    }
    if (fs::exists(fs::path(dir) / "pytorch_model.bin")) {
      throw Error(dir +
                  ": only pickle weights (pytorch_model.bin) found; difftrain reads "
                  "safetensors only — in Python run `CLIPTextModel.from_pretrained(dir)"
                  ".save_pretrained(dir, safe_serialization=True)`");
    }
    throw Error(path.string() +
                ": no such file; expected a Transformers CLIPTextModel folder with "
                "config.json and " +
                file);
  }
  ClipTextConfig config = read_clip_text_config((fs::path(dir) / "config.json").string());
  config.with_projection = config.with_projection || with_projection;
  ClipTextModel model(config);
  io::TensorMap tensors = io::load_safetensors(path.string()).tensors;
  // Older checkpoints save the (unused) position_ids buffer.
  tensors.erase("text_model.embeddings.position_ids");
  bool prefixed = false, bare = false;
  for (const auto& [name, t] : tensors) {
    prefixed = prefixed || name.rfind("text_model.", 0) == 0;
    bare = bare || name.rfind("embeddings.", 0) == 0 || name.rfind("encoder.", 0) == 0;
  }
  if (!prefixed && bare) {
    throw Error(path.string() +
                ": the keys lack the \"text_model.\" prefix (a CLIPTextTransformer "
                "state dict, e.g. \"embeddings.token_embedding.weight\"); save the "
                "weights from a CLIPTextModel (its keys start with text_model.)");
  }
  load_weights(*model, tensors, path.string());
  return model;
}

}  // namespace difftrain::models
