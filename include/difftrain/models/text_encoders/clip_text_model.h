#pragma once
// Transformers' `CLIPTextModel` (the text tower of CLIP), the text encoder of Stable Diffusion
// 1.x/2.x, built from `text_encoder/config.json` with Transformers' state-dict key names
// (`text_model.embeddings.token_embedding.weight`, `text_model.encoder.layers.0.self_attn.q_proj
// .weight`, ...), so `model.safetensors` loads by name with no conversion.

#include "difftrain/core/forward_hooks.h"
#include "difftrain/models/linear.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/embedding.h>
#include <torch/nn/modules/normalization.h>

#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::models {

/// The fields of Transformers' `CLIPTextConfig` a forward needs (other fields are ignored).
struct ClipTextConfig {
  int64_t vocab_size = 49408;
  int64_t hidden_size = 512;
  int64_t intermediate_size = 2048;
  int64_t num_hidden_layers = 12;
  int64_t num_attention_heads = 8;
  int64_t max_position_embeddings = 77;
  /// "quick_gelu" (x * sigmoid(1.702 x), SD 1.x), "gelu" (exact erf, SD 2.x) or "gelu_new"
  /// (tanh approximation).
  std::string hidden_act = "quick_gelu";
  double layer_norm_eps = 1e-5;
  int64_t bos_token_id = 49406;
  int64_t eos_token_id = 49407;
  int64_t pad_token_id = 1;
  /// CLIPTextModelWithProjection (SDXL's text_encoder_2): a bias-free Linear `text_projection`
  /// hidden_size -> projection_dim applied to the pooled output. False = a plain CLIPTextModel.
  bool with_projection = false;
  int64_t projection_dim = 512;
  /// The file the config was read from ("" when built in code), for error messages.
  std::string source;
};

/// Reads a Transformers `config.json` of a CLIPTextModel (or a CLIPModel's `text_config`).
/// with_projection is set when `architectures` names CLIPTextModelWithProjection.
/// Throws difftrain::Error (one line, naming the file and field) for a missing file, invalid
/// JSON, a field of the wrong type, non-positive sizes, hidden_size not divisible by
/// num_attention_heads, or an unsupported hidden_act (listing the supported ones).
ClipTextConfig read_clip_text_config(const std::string& path);

/// read_clip_text_config() of config.json text already in memory; `source` names it in errors.
ClipTextConfig parse_clip_text_config(const std::string& json_text, const std::string& source);

/// One pre-LN encoder layer (`CLIPEncoderLayer`): h += self_attn(layer_norm1(h)) with a causal
/// mask, then h += mlp(layer_norm2(h)). Children: self_attn.{q_proj,k_proj,v_proj,out_proj},
/// layer_norm1, mlp.{fc1,fc2}, layer_norm2 (the projections are models::Linear, so LoRA adapters
/// attach to them).
class ClipEncoderLayerImpl : public torch::nn::Module, public core::HookableModule {
 public:
  /// `causal`: the text tower's mask; the vision tower (clip_vision_model.h) attends everywhere.
  explicit ClipEncoderLayerImpl(const ClipTextConfig& config, bool causal = true);
  /// h: [B, S, W] -> [B, S, W]; self-attention (causal: key j > query i masked), no padding mask.
  torch::Tensor forward(const torch::Tensor& h);
  std::string hook_class_name() const override { return "CLIPEncoderLayer"; }

 private:
  torch::Tensor forward_impl(const torch::Tensor& h);
  ClipTextConfig config_;
  bool causal_ = true;
  torch::nn::LayerNorm layer_norm1_{nullptr}, layer_norm2_{nullptr};
  Linear q_proj_{nullptr}, k_proj_{nullptr}, v_proj_{nullptr}, out_proj_{nullptr};
  Linear fc1_{nullptr}, fc2_{nullptr};
};
TORCH_MODULE(ClipEncoderLayer);

/// What ClipTextModel::forward returns (Transformers' BaseModelOutputWithPooling).
struct ClipTextOutput {
  /// [B, S, W]: final_layer_norm of the last layer's output, or, with skip > 0, of the output of
  /// layer num_hidden_layers - skip (Diffusers' `clip_skip` = skip).
  torch::Tensor last_hidden_state;
  /// [B, W]: final_layer_norm of the last layer's output at each row's first eos_token_id
  /// (Transformers' rule; for legacy configs with eos_token_id == 2, the position of the largest
  /// id, as Transformers does).
  torch::Tensor pooler_output;
  /// [B, projection_dim]: text_projection(pooler_output), only for a model with projection
  /// (CLIPTextModelWithProjection's `text_embeds`; SDXL's pooled prompt embedding).
  torch::Tensor text_embeds;
  /// Only with output_hidden_states: Transformers' `hidden_states`, num_hidden_layers + 1 entries
  /// (the embeddings, then each layer's output, none final-layer-normed). SDXL's prompt embedding
  /// is hidden_states[-(clip_skip + 2)].
  std::vector<torch::Tensor> hidden_states;
};

/// Transformers' `CLIPTextModel`, or `CLIPTextModelWithProjection` when config.with_projection
/// (then a top-level `text_projection.weight` [projection_dim, hidden_size]). Children are
/// registered under `text_model` so parameter names equal the Transformers keys; the unused
/// `text_model.embeddings.position_ids` buffer of older checkpoints is not a parameter
/// (load_clip_text_model ignores it).
class ClipTextModelImpl : public torch::nn::Module {
 public:
  explicit ClipTextModelImpl(const ClipTextConfig& config);
  /// input_ids: [B, S] int64 with S <= max_position_embeddings; skip in [0, num_hidden_layers).
  ClipTextOutput forward(const torch::Tensor& input_ids, int64_t skip = 0,
                         bool output_hidden_states = false);
  /// Whether the model has `text_projection` (CLIPTextModelWithProjection).
  bool has_projection() const { return !text_projection_.is_empty(); }
  const ClipTextConfig& config() const { return config_; }
  /// The encoder layers in order (for LoRA targeting, hooks and tests).
  const std::vector<ClipEncoderLayer>& layers() const { return layers_; }

 private:
  ClipTextConfig config_;
  torch::nn::Embedding token_embedding_{nullptr}, position_embedding_{nullptr};
  std::vector<ClipEncoderLayer> layers_;
  torch::nn::LayerNorm final_layer_norm_{nullptr};
  Linear text_projection_{nullptr};
};
TORCH_MODULE(ClipTextModel);

/// Builds the model from `dir`/config.json and loads `dir`/model.safetensors (or
/// model.<variant>.safetensors) strictly by name (models::load_weights), float32 on the CPU.
/// A `text_model.embeddings.position_ids` entry in the file is ignored. A folder with only
/// pytorch_model.bin gets an error that says how to convert it. Transformers:
/// `CLIPTextModel.from_pretrained(dir)`.
/// `with_projection` builds CLIPTextModelWithProjection whatever config.json's architectures say
/// (a pipeline's model_index.json names the class).
ClipTextModel load_clip_text_model(const std::string& dir, const std::string& variant = "",
                                   bool with_projection = false);

}  // namespace difftrain::models
