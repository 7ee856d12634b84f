// T5EncoderModel (t5_encoder.h), with Transformers' modeling_t5.py semantics in eval mode.
#include "difftrain/models/text_encoders/t5_encoder.h"

#include "../json_fields.h"
#include "difftrain/core/error.h"
#include "difftrain/io/weight_index.h"
#include "difftrain/models/pretrained.h"

#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <limits>

namespace difftrain::models {
namespace fs = std::filesystem;

namespace {

torch::Tensor t5_activation(const torch::Tensor& x, const std::string& name) {
  if (name == "gelu_new") {
    // 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
    return 0.5 * x *
           (1.0 + torch::tanh(std::sqrt(2.0 / M_PI) * (x + 0.044715 * torch::pow(x, 3.0))));
  }
  if (name == "gelu") return torch::gelu(x);
  if (name == "silu") return torch::silu(x);
  return torch::relu(x);
}

Linear t5_linear(int64_t in, int64_t out) {
  return Linear(torch::nn::LinearOptions(in, out).bias(false));
}

}  // namespace

bool T5EncoderOptions::gated() const { return feed_forward_proj().rfind("gated-", 0) == 0; }

std::string T5EncoderOptions::activation() const {
  const std::string& f = feed_forward_proj();
  if (f == "gated-gelu") return "gelu_new";  // Transformers' special case for T5 v1.1
  return gated() ? f.substr(6) : f;
}

T5EncoderOptions T5EncoderOptions::load(const std::string& path) {
  const nlohmann::json j = detail::parse_json_file(path, "a Transformers T5 config.json");
  if (!j.is_object()) throw Error(path + ": expected a JSON object (a T5 config.json)");
  const detail::JsonFields r(j, path);
  T5EncoderOptions o;
  o.vocab_size(r.integer_at_least("vocab_size", o.vocab_size(), 1));
  o.d_model(r.integer_at_least("d_model", o.d_model(), 1));
  o.d_kv(r.integer_at_least("d_kv", o.d_kv(), 1));
  o.d_ff(r.integer_at_least("d_ff", o.d_ff(), 1));
  o.num_layers(r.integer_at_least("num_layers", o.num_layers(), 1));
  o.num_heads(r.integer_at_least("num_heads", o.num_heads(), 1));
  o.relative_attention_num_buckets(r.integer_at_least("relative_attention_num_buckets", 32, 2));
  o.relative_attention_max_distance(r.integer_at_least("relative_attention_max_distance", 128, 1));
  o.layer_norm_epsilon(r.number("layer_norm_epsilon", 1e-6));
  o.feed_forward_proj(r.string("feed_forward_proj", "relu"));
  o.per_layer_position_bias(r.string("model_type", "t5") == "umt5");
  if (o.relative_attention_num_buckets() % 2 != 0) {
    r.fail("relative_attention_num_buckets", "must be even (half per direction)");
  }
  if (!(o.layer_norm_epsilon() > 0)) r.fail("layer_norm_epsilon", "must be > 0");
  const std::string act = o.activation();
  const std::string& f = o.feed_forward_proj();
  if (act != "gelu_new" && act != "gelu" && act != "relu" && act != "silu") {
    r.fail("feed_forward_proj", "is \"" + f +
                                    "\"; supported: \"gated-gelu\", \"relu\", \"gelu\", "
                                    "\"gated-silu\", \"silu\", \"gated-relu\", \"gelu_new\"");
  }
  return o;
}

T5LayerNormImpl::T5LayerNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor T5LayerNormImpl::forward(const torch::Tensor& x) {
  const torch::Tensor variance = x.to(torch::kFloat32).pow(2).mean(-1, /*keepdim=*/true);
  torch::Tensor h = x * torch::rsqrt(variance + eps_);
  if (weight.scalar_type() == torch::kHalf || weight.scalar_type() == torch::kBFloat16) {
    h = h.to(weight.scalar_type());
  }
  return weight * h;
}

torch::Tensor t5_relative_position_bucket(const torch::Tensor& relative_position,
                                          int64_t num_buckets, int64_t max_distance) {
  const int64_t half = num_buckets / 2;
  torch::Tensor ret = (relative_position > 0).to(torch::kInt64) * half;
  const torch::Tensor n = relative_position.abs();
  const int64_t max_exact = half / 2;
  const torch::Tensor is_small = n < max_exact;
  // float32 log, truncated toward zero, as Transformers computes it.
  torch::Tensor large =
      max_exact + (torch::log(n.to(torch::kFloat32) / static_cast<double>(max_exact)) /
                   std::log(static_cast<double>(max_distance) / static_cast<double>(max_exact)) *
                   static_cast<double>(half - max_exact))
                      .to(torch::kInt64);
  large = torch::min(large, torch::full_like(large, half - 1));
  return ret + torch::where(is_small, n, large);
}

T5AttentionImpl::T5AttentionImpl(const T5EncoderOptions& o, bool has_relative_attention_bias)
    : options_(o) {
  const int64_t inner = o.num_heads() * o.d_kv();
  q = register_module("q", t5_linear(o.d_model(), inner));
  k = register_module("k", t5_linear(o.d_model(), inner));
  v = register_module("v", t5_linear(o.d_model(), inner));
  out = register_module("o", t5_linear(inner, o.d_model()));
  if (has_relative_attention_bias) {
    relative_attention_bias =
        register_module("relative_attention_bias",
                        torch::nn::Embedding(o.relative_attention_num_buckets(), o.num_heads()));
  }
}

torch::Tensor T5AttentionImpl::compute_bias(int64_t q_len, int64_t k_len) {
  const auto device = relative_attention_bias->weight.device();
  const auto opts = torch::TensorOptions().dtype(torch::kInt64).device(device);
  const torch::Tensor rel =
      torch::arange(k_len, opts).unsqueeze(0) - torch::arange(q_len, opts).unsqueeze(1);
  const torch::Tensor buckets = t5_relative_position_bucket(
      rel, options_.relative_attention_num_buckets(), options_.relative_attention_max_distance());
  return relative_attention_bias->forward(buckets).permute({2, 0, 1}).unsqueeze(0);
}

torch::Tensor T5AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& position_bias) {
  const int64_t B = x.size(0), S = x.size(1), H = options_.num_heads(), d = options_.d_kv();
  auto heads = [&](const torch::Tensor& t) { return t.view({B, S, H, d}).transpose(1, 2); };
  const torch::Tensor qh = heads(q->forward(x)), kh = heads(k->forward(x)),
                      vh = heads(v->forward(x));
  // No 1/sqrt(d_kv): T5 folds it into the initialisation. Softmax in float32.
  torch::Tensor scores =
      torch::matmul(qh, kh.transpose(-1, -2)) + position_bias.to(qh.scalar_type());
  const torch::Tensor attn =
      torch::softmax(scores.to(torch::kFloat32), -1).to(scores.scalar_type());
  const torch::Tensor mixed = torch::matmul(attn, vh).transpose(1, 2).reshape({B, S, H * d});
  return out->forward(mixed);
}

T5BlockImpl::T5BlockImpl(const T5EncoderOptions& o, bool has_relative_attention_bias)
    : options_(o) {
  auto layers = register_module("layer", torch::nn::ModuleList());
  auto self_attention = std::make_shared<torch::nn::Module>();
  attention = T5Attention(o, has_relative_attention_bias);
  self_attention->register_module("SelfAttention", attention);
  norm0_ = self_attention->register_module("layer_norm",
                                           T5LayerNorm(o.d_model(), o.layer_norm_epsilon()));
  layers->push_back(self_attention);
  auto ff = std::make_shared<torch::nn::Module>();
  auto dense = std::make_shared<torch::nn::Module>();
  if (o.gated()) {
    wi_0_ = dense->register_module("wi_0", t5_linear(o.d_model(), o.d_ff()));
    wi_1_ = dense->register_module("wi_1", t5_linear(o.d_model(), o.d_ff()));
  } else {
    wi_ = dense->register_module("wi", t5_linear(o.d_model(), o.d_ff()));
  }
  wo_ = dense->register_module("wo", t5_linear(o.d_ff(), o.d_model()));
  ff->register_module("DenseReluDense", dense);
  norm1_ = ff->register_module("layer_norm", T5LayerNorm(o.d_model(), o.layer_norm_epsilon()));
  layers->push_back(ff);
}

torch::Tensor T5BlockImpl::forward(const torch::Tensor& h_in, const torch::Tensor& position_bias) {
  torch::Tensor h = h_in + attention->forward(norm0_->forward(h_in), position_bias);
  const torch::Tensor x = norm1_->forward(h);
  const std::string act = options_.activation();
  torch::Tensor inner = options_.gated() ? t5_activation(wi_0_->forward(x), act) * wi_1_->forward(x)
                                         : t5_activation(wi_->forward(x), act);
  // Transformers runs wo in its weight's dtype.
  inner = inner.to(wo_->weight_dtype());
  h = h + wo_->forward(inner);
  if (h.scalar_type() == torch::kHalf) {
    // Transformers' fp16 guard against inf.
    const double clamp = 65504.0 - 1000.0;
    h = torch::clamp(h, -clamp, clamp);
  }
  return h;
}

T5EncoderModelImpl::T5EncoderModelImpl(const T5EncoderOptions& options) : options_(options) {
  shared_ =
      register_module("shared", torch::nn::Embedding(options.vocab_size(), options.d_model()));
  auto encoder = register_module("encoder", std::make_shared<torch::nn::Module>());
  auto list = encoder->register_module("block", torch::nn::ModuleList());
  for (int64_t i = 0; i < options.num_layers(); ++i) {
    blocks_.push_back(T5Block(options, i == 0 || options.per_layer_position_bias()));
    list->push_back(blocks_.back());
  }
  final_norm_ = encoder->register_module(
      "final_layer_norm", T5LayerNorm(options.d_model(), options.layer_norm_epsilon()));
}

T5EncoderOutput T5EncoderModelImpl::forward_all(const torch::Tensor& input_ids,
                                                const torch::Tensor& attention_mask) {
  TORCH_CHECK(input_ids.dim() == 2, "T5EncoderModel: input_ids must be [B, S], got ",
              input_ids.sizes());
  const int64_t max_id = input_ids.numel() > 0 ? input_ids.max().item<int64_t>() : 0;
  if (max_id >= options_.vocab_size() ||
      (input_ids.numel() > 0 && input_ids.min().item<int64_t>() < 0)) {
    throw Error("T5EncoderModel: a token id is outside [0, " +
                std::to_string(options_.vocab_size()) +
                "); the tokenizer does not belong to this encoder");
  }
  const int64_t S = input_ids.size(1);
  T5EncoderOutput out;
  torch::Tensor h = shared_->forward(input_ids);
  // Transformers' extended mask: (1 - mask) * finfo(dtype).min, [B, 1, 1, S].
  torch::Tensor mask;
  if (attention_mask.defined()) {
    TORCH_CHECK(attention_mask.dim() == 2 && attention_mask.size(0) == input_ids.size(0) &&
                    attention_mask.size(1) == S,
                "T5EncoderModel: attention_mask must be [", input_ids.size(0), ", ", S, "], got ",
                attention_mask.sizes());
    const auto dtype = h.scalar_type();
    const double lowest = dtype == torch::kBFloat16 ? -3.3895313892515355e38
                          : dtype == torch::kHalf   ? -65504.0
                          : dtype == torch::kDouble ? std::numeric_limits<double>::lowest()
                                                    : std::numeric_limits<float>::lowest();
    mask = ((1.0 - attention_mask.to(h.device(), dtype)) * lowest).view({-1, 1, 1, S});
  }
  out.position_bias = blocks_.at(0)->attention->compute_bias(S, S);
  for (size_t i = 0; i < blocks_.size(); ++i) {
    out.hidden_states.push_back(h);
    torch::Tensor bias = out.position_bias;
    if (options_.per_layer_position_bias()) {
      bias = i == 0 ? out.position_bias : blocks_[i]->attention->compute_bias(S, S);
      out.position_biases.push_back(bias);
    }
    if (mask.defined()) bias = bias.to(mask.scalar_type()) + mask;
    h = blocks_[i]->forward(h, bias);
  }
  out.last_block_output = h;
  out.last_hidden_state = final_norm_->forward(h);
  out.hidden_states.push_back(out.last_hidden_state);
  return out;
}

torch::Tensor T5EncoderModelImpl::forward(const torch::Tensor& input_ids,
                                          const torch::Tensor& attention_mask) {
  return forward_all(input_ids, attention_mask).last_hidden_state;
}

T5EncoderModel load_t5_encoder(const std::string& dir, torch::Dtype dtype,
                               const std::string& variant) {
  const std::string what =
      "a Transformers T5EncoderModel folder (config.json + model.safetensors), e.g. a "
      "FluxPipeline's text_encoder_2/";
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) throw Error(dir + ": no such folder; expected " + what);
  const fs::path config = fs::path(dir) / "config.json";
  if (!fs::is_regular_file(config, ec)) throw Error(dir + ": no config.json; expected " + what);
  T5EncoderModel model(T5EncoderOptions::load(config.string()));
  model->to(dtype);
  const io::WeightFiles files = io::find_weight_files(dir, "model", variant);
  io::TensorMap weights = io::load_weight_files(files, dtype);
  // Transformers ties encoder.embed_tokens to shared and writes it once; other tools write both.
  weights.erase("encoder.embed_tokens.weight");
  load_weights(*model, weights, files.index.empty() ? files.files.at(0) : files.index);
  return model;
}

}  // namespace difftrain::models
