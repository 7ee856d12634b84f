#pragma once
// Transformers' `Qwen3Model` (the decoder LLM that Z-Image and FLUX.2 klein use as their text
// encoder): token embeddings, `num_hidden_layers` pre-norm decoder layers (grouped-query
// self-attention with RMS-normed q and k per head, rotary position embeddings, a causal mask
// combined with the padding mask; a SwiGLU MLP) and a final RMS norm. Parameter names are
// Transformers' keys (`embed_tokens.weight`, `layers.{i}.self_attn.q_proj.weight`, ...).

#include "difftrain/io/safetensors.h"
#include "difftrain/models/linear.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/pimpl.h>

#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::models {

/// The fields of a Qwen3 config.json (Transformers' Qwen3Config; absent fields take its
/// defaults, head_dim defaults to hidden_size / num_attention_heads).
struct Qwen3Options {
  TORCH_ARG(int64_t, vocab_size) = 151936;
  TORCH_ARG(int64_t, hidden_size) = 4096;
  TORCH_ARG(int64_t, intermediate_size) = 22016;
  TORCH_ARG(int64_t, num_hidden_layers) = 32;
  TORCH_ARG(int64_t, num_attention_heads) = 32;
  /// Key/value heads (GQA): divides num_attention_heads.
  TORCH_ARG(int64_t, num_key_value_heads) = 32;
  /// Width of one head; heads · head_dim may differ from hidden_size.
  TORCH_ARG(int64_t, head_dim) = 128;
  TORCH_ARG(double, rms_norm_eps) = 1e-6;
  TORCH_ARG(double, rope_theta) = 10000.0;
  /// Bias on q, k, v and o projections.
  TORCH_ARG(bool, attention_bias) = false;
  /// Qwen2-architecture models (Qwen2.5-VL's language model): q/k/v biases but none on o_proj,
  /// no per-head q/k norms, and position ids counted over the real tokens
  /// (cumsum(attention_mask) - 1, as Qwen2.5-VL's get_rope_index for text).
  TORCH_ARG(bool, o_proj_bias) = false;
  TORCH_ARG(bool, qk_norm) = true;
  TORCH_ARG(bool, positions_from_mask) = false;
  /// Multimodal RoPE sections (Qwen2.5-VL's rope_scaling.mrope_section, in frequency pairs):
  /// empty for plain RoPE; with text alone every section sees the same position.
  TORCH_ARG(std::vector<int64_t>, mrope_section) = {};
  /// The checkpoint's class, for messages ("Qwen3Model", "Qwen2_5_VLForConditionalGeneration").
  TORCH_ARG(std::string, architecture) = "Qwen3Model";

 public:
  /// Reads a Transformers Qwen3 config.json; errors name the file and the field (non-positive
  /// sizes, heads not divisible by key/value heads, an odd head_dim, a hidden_act other than
  /// silu, a rope_scaling other than the default, sliding-window attention).
  /// Reads a Qwen3 config.json, or a Qwen2 / Qwen2.5-VL one (model_type "qwen2", "qwen2_5_vl",
  /// "qwen2_vl": the text fields at the top level or under text_config).
  static Qwen3Options load(const std::string& path);
};

/// Qwen3's RMS norm: weight · (x · rsqrt(mean(x², -1) + eps)) with the statistics in float32 and
/// the normalised x cast back to x's dtype before the weight (Transformers' Qwen3RMSNorm).
class Qwen3RMSNormImpl : public torch::nn::Module {
 public:
  Qwen3RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(Qwen3RMSNorm);

/// One decoder layer: `self_attn` (q_proj, k_proj, v_proj, o_proj, q_norm, k_norm), `mlp`
/// (gate_proj, up_proj, down_proj), `input_layernorm`, `post_attention_layernorm`.
class Qwen3DecoderLayerImpl : public torch::nn::Module {
 public:
  explicit Qwen3DecoderLayerImpl(const Qwen3Options& o);
  /// h: [B, S, hidden]; cos, sin: [S, head_dim] in h's dtype; mask: [B, 1, S, S] additive (0 or
  /// the dtype's lowest) -> [B, S, hidden].
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& cos, const torch::Tensor& sin,
                        const torch::Tensor& mask);

 private:
  Qwen3Options options_;
  Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, o_proj_{nullptr};
  Qwen3RMSNorm q_norm_{nullptr}, k_norm_{nullptr};
  Linear gate_proj_{nullptr}, up_proj_{nullptr}, down_proj_{nullptr};
  Qwen3RMSNorm input_layernorm_{nullptr}, post_attention_layernorm_{nullptr};
};
TORCH_MODULE(Qwen3DecoderLayer);

/// What a forward computed (Transformers' output_hidden_states).
struct Qwen3Output {
  /// The embeddings, each layer's output but the last, then the final norm of the last layer's
  /// output (num_hidden_layers + 1 entries, [B, S, hidden]); those after `stop` are absent.
  std::vector<torch::Tensor> hidden_states;
};

/// Transformers' `Qwen3Model`: `embed_tokens`, `layers.{i}`, `norm`.
class Qwen3ModelImpl : public torch::nn::Module {
 public:
  explicit Qwen3ModelImpl(const Qwen3Options& options);
  /// input_ids: [B, S] int64, attention_mask: [B, S] (1 real, 0 padding; undefined: all real) ->
  /// hidden_states[0 .. stop] (stop < 0 counts from the end as Python does: -2 is what
  /// ZImagePipeline takes, and the last layer is then not run). Position ids are 0..S-1 in every
  /// row, whatever the padding (Transformers without position_ids).
  /// position_ids: [3, B, S] multimodal positions (Qwen2.5-VL with images) or undefined (text:
  /// arange, or the mask's running count when positions_from_mask).
  Qwen3Output forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask = {},
                      int64_t stop = -1, const torch::Tensor& position_ids = {},
                      const torch::Tensor& inputs_embeds = {});
  /// hidden_states[index] of forward() (index < 0 from the end).
  torch::Tensor hidden_state(const torch::Tensor& input_ids, const torch::Tensor& attention_mask,
                             int64_t index);
  const Qwen3Options& options() const { return options_; }
  /// The token embedding (a multimodal model replaces some rows' embeddings before forward()).
  torch::nn::Embedding& embed_tokens() { return embed_tokens_; }

 private:
  Qwen3Options options_;
  torch::nn::Embedding embed_tokens_{nullptr};
  std::vector<Qwen3DecoderLayer> layers_;
  Qwen3RMSNorm norm_{nullptr};
};
TORCH_MODULE(Qwen3Model);

/// Builds the model from `dir`/config.json and loads `dir`'s model[.variant].safetensors (or its
/// shards by model.safetensors.index.json) strictly by name, in `dtype` on the CPU, file by
/// file. A `Qwen3ForCausalLM` checkpoint loads too: its `model.` prefix is dropped and `lm_head`
/// ignored. Transformers: `Qwen3Model.from_pretrained(dir, torch_dtype=dtype)`. Throws
/// difftrain::Error naming the file for a missing or bad config or weights.
/// With `visual` given, a Qwen2.5-VL checkpoint's vision-tower tensors (`visual.*` or
/// `model.visual.*`) are put there, the prefix dropped (make_qwen2_5_vl_vision reads them).
Qwen3Model load_qwen3_model(const std::string& dir, torch::Dtype dtype = torch::kFloat32,
                            const std::string& variant = "", io::TensorMap* visual = nullptr);

/// The prompt embeddings ZImagePipeline._encode_prompt takes: hidden_states[-2] of the padded
/// batch, each row cut to its real tokens (attention_mask 1). input_ids, attention_mask: [B, S]
/// -> B tensors [L_i, hidden].
std::vector<torch::Tensor> qwen3_prompt_embeds(Qwen3Model& model, const torch::Tensor& input_ids,
                                               const torch::Tensor& attention_mask);

}  // namespace difftrain::models
