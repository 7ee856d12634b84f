#pragma once
// Transformers' `T5EncoderModel` (T5 v1.1 as FLUX.1's text_encoder_2 ships it; also the original
// T5's relu FFN): an embedding, `num_layers` pre-norm blocks of self-attention with a relative
// position bias (one table, in block 0, added in every layer; no 1/sqrt(d_kv) scaling) and a
// (gated) feed-forward, RMS norms without mean or bias, and a final norm. No attention mask:
// FluxPipeline passes none, so padding takes part. Parameter names are Transformers' keys.

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/pimpl.h>

#include "difftrain/models/linear.h"

#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::models {

/// The fields of a T5 config.json (Transformers' T5Config; absent fields take its defaults).
struct T5EncoderOptions {
  TORCH_ARG(int64_t, vocab_size) = 32128;
  TORCH_ARG(int64_t, d_model) = 512;
  /// Width of one head; H·d_kv may differ from d_model.
  TORCH_ARG(int64_t, d_kv) = 64;
  TORCH_ARG(int64_t, d_ff) = 2048;
  TORCH_ARG(int64_t, num_layers) = 6;
  TORCH_ARG(int64_t, num_heads) = 8;
  TORCH_ARG(int64_t, relative_attention_num_buckets) = 32;
  TORCH_ARG(int64_t, relative_attention_max_distance) = 128;
  TORCH_ARG(double, layer_norm_epsilon) = 1e-6;
  /// "gated-gelu" (T5 v1.1: gelu_new, gated), "relu", "gated-silu", "gelu", ... as
  /// Transformers splits it: "gated-" makes the FFN gated (wi_0, wi_1), the rest names the
  /// activation ("gated-gelu" means gelu_new).
  TORCH_ARG(std::string, feed_forward_proj) = "relu";
  /// UMT5 (model_type "umt5", Wan's text encoder): every block has its own
  /// relative_attention_bias table and computes its own bias (T5: block 0's, shared).
  TORCH_ARG(bool, per_layer_position_bias) = false;

 public:
  /// Whether the FFN is gated (wi_0 · wi_1) rather than one wi.
  bool gated() const;
  /// The activation: "gelu_new", "gelu", "relu" or "silu".
  std::string activation() const;
  /// Reads a Transformers T5 config.json; errors name the file and the field (non-positive
  /// sizes, an odd bucket count, an unknown feed_forward_proj).
  static T5EncoderOptions load(const std::string& path);
};

/// T5's RMS norm: x · rsqrt(mean(x², -1) + eps) (the mean in float32) times `weight`, cast to
/// the weight's dtype when that is float16 / bfloat16 (Transformers' T5LayerNorm).
class T5LayerNormImpl : public torch::nn::Module {
 public:
  T5LayerNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(T5LayerNorm);

/// T5Attention of the encoder: q, k, v [H·d_kv, d_model], o [d_model, H·d_kv], and in block 0
/// (UMT5: in every block) `relative_attention_bias` [num_buckets, H].
class T5AttentionImpl : public torch::nn::Module {
 public:
  T5AttentionImpl(const T5EncoderOptions& o, bool has_relative_attention_bias);
  /// x: [B, S, d_model], position_bias: [1, H, S, S] -> [B, S, d_model].
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& position_bias);
  /// The bias of every (query, key) pair: [1, H, q_len, k_len] (blocks with a table only).
  torch::Tensor compute_bias(int64_t q_len, int64_t k_len);

  Linear q{nullptr}, k{nullptr}, v{nullptr}, out{nullptr};
  torch::nn::Embedding relative_attention_bias{nullptr};

 private:
  T5EncoderOptions options_;
};
TORCH_MODULE(T5Attention);

/// Transformers' `_relative_position_bucket` (bidirectional): for key - query offsets
/// `relative_position` (int64), buckets in [0, num_buckets): half per sign, exact below
/// num_buckets / 4, logarithmic (float32 log, truncated) up to max_distance.
torch::Tensor t5_relative_position_bucket(const torch::Tensor& relative_position,
                                          int64_t num_buckets, int64_t max_distance);

/// What a forward computed, for tests and Transformers' output_hidden_states.
struct T5EncoderOutput {
  torch::Tensor last_hidden_state;  ///< [B, S, d_model], after the final norm
  /// The embeddings, each block's output but the last, then last_hidden_state (num_layers + 1).
  std::vector<torch::Tensor> hidden_states;
  torch::Tensor last_block_output;  ///< the last block's output, before the final norm
  torch::Tensor position_bias;      ///< [1, H, S, S] (UMT5: block 0's)
  /// UMT5: each block's bias [1, H, S, S] (without the mask); T5: empty.
  std::vector<torch::Tensor> position_biases;
};

/// One encoder block: layer.0 (SelfAttention + layer_norm), layer.1 (DenseReluDense + layer_norm).
class T5BlockImpl : public torch::nn::Module {
 public:
  T5BlockImpl(const T5EncoderOptions& o, bool has_relative_attention_bias);
  torch::Tensor forward(const torch::Tensor& h, const torch::Tensor& position_bias);
  T5Attention attention{nullptr};

 private:
  T5EncoderOptions options_;
  T5LayerNorm norm0_{nullptr}, norm1_{nullptr};
  Linear wi_{nullptr}, wi_0_{nullptr}, wi_1_{nullptr}, wo_{nullptr};
};
TORCH_MODULE(T5Block);

/// Transformers' `T5EncoderModel`: `shared`, `encoder.block.{i}`, `encoder.final_layer_norm`.
class T5EncoderModelImpl : public torch::nn::Module {
 public:
  explicit T5EncoderModelImpl(const T5EncoderOptions& options);
  /// input_ids: [B, S] int64 -> last_hidden_state [B, S, d_model]. attention_mask [B, S] (1 a
  /// real token; undefined: none, as FluxPipeline calls T5): (1 - mask) x the dtype's lowest
  /// added to every block's position bias, as Transformers' extended attention mask (WanPipeline
  /// passes it to UMT5).
  torch::Tensor forward(const torch::Tensor& input_ids, const torch::Tensor& attention_mask = {});
  /// forward() with every intermediate (T5EncoderOutput).
  T5EncoderOutput forward_all(const torch::Tensor& input_ids,
                              const torch::Tensor& attention_mask = {});
  const T5EncoderOptions& options() const { return options_; }

 private:
  T5EncoderOptions options_;
  torch::nn::Embedding shared_{nullptr};
  std::vector<T5Block> blocks_;
  T5LayerNorm final_norm_{nullptr};
};
TORCH_MODULE(T5EncoderModel);

/// Builds the encoder from `dir`/config.json and loads `dir`'s model[.variant].safetensors (or
/// its shards by model.safetensors.index.json, io/weight_index.h) strictly by name, in `dtype`
/// on the CPU. `encoder.embed_tokens.weight` (Transformers' tied copy of `shared.weight`, which
/// some tools write) is accepted and dropped. Transformers: `T5EncoderModel.from_pretrained(dir,
/// torch_dtype=dtype)`. Throws difftrain::Error naming the file for a missing or bad config or
/// weights.
T5EncoderModel load_t5_encoder(const std::string& dir, torch::Dtype dtype = torch::kFloat32,
                               const std::string& variant = "");

}  // namespace difftrain::models
