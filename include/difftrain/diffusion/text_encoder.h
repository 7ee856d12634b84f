#pragma once
// One text encoder as a pipeline component: a tokenizer and the model that encodes its ids, and
// the two pipeline components they came from (`text_encoder`, `tokenizer`, ...). A family
// composes one or more of them into a TextEncoderStack (text_encoders.h) with a
// PromptComposition (prompt_composition.h) that says how their outputs make the prompt
// embeddings. CLIP (clip_text_encoder.h), T5 (t5_text_encoder.h) and the Qwen3 decoder LLM with
// its chat template (qwen3_text_encoder.h) are built in; another encoder (UMT5, Qwen2.5-VL) is
// one more subclass, with nothing else to edit.

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::diffusion {

/// Where one encoder's files are, and the pipeline components they stand for.
struct TextEncoderFiles {
  std::string component;            ///< "text_encoder", "text_encoder_2", ...
  std::string tokenizer_component;  ///< "tokenizer", "tokenizer_2", ...
  std::string model_dir;            ///< "" when built in memory
  std::string tokenizer_dir;        ///< "" when built in memory
};

/// Tokenized prompts. input_ids: [N, L] int64 (or [L] for one prompt); attention_mask: the same
/// shape, 1 for real tokens, undefined for encoders that read every position (CLIP, FLUX.1-style
/// T5 without a mask).
struct Tokens {
  torch::Tensor input_ids;
  torch::Tensor attention_mask;
};

/// What a composition asks of an encoder.
struct EncodeRequest {
  /// Layers skipped from the end before the final norm (Diffusers' clip_skip on
  /// last_hidden_state); 0 = the last layer.
  int64_t skip_layers = 0;
  /// Whether to return every layer's output (Transformers' output_hidden_states).
  bool hidden_states = false;
};

/// An encoder's outputs (Transformers' BaseModelOutput(WithPooling)), on the encoder's device.
struct TextEncoding {
  torch::Tensor last_hidden_state;  ///< [N, L, hidden_size()]
  /// [N, pooled_size()] (CLIPTextModel's pooler_output, CLIPTextModelWithProjection's
  /// text_embeds); undefined when the encoder has none.
  torch::Tensor pooled;
  /// With EncodeRequest::hidden_states: num_layers() + 1 entries, the embeddings' output then each
  /// layer's (not final-normed), as Transformers' hidden_states.
  std::vector<torch::Tensor> hidden_states;
  torch::Tensor attention_mask;  ///< the tokens' mask, when they had one
};

class TextEncoder {
 public:
  explicit TextEncoder(TextEncoderFiles files) : files_(std::move(files)) {}
  virtual ~TextEncoder() = default;

  const TextEncoderFiles& files() const { return files_; }
  const std::string& component() const { return files_.component; }
  const std::string& tokenizer_component() const { return files_.tokenizer_component; }
  const std::string& model_dir() const { return files_.model_dir; }
  const std::string& tokenizer_dir() const { return files_.tokenizer_dir; }

  /// The Transformers class it reimplements ("CLIPTextModel", "T5EncoderModel", ...).
  virtual std::string class_name() const = 0;
  /// The model as a module (freezing, casting, LoRA); nullptr once released (tokenizer_only()).
  virtual torch::nn::Module* module() const = 0;
  /// A copy sharing the model (settings such as the sequence length are the copy's own).
  virtual std::shared_ptr<TextEncoder> clone() const = 0;
  /// A copy with the tokenizer only: what tokenizing needs and how a run that cached every
  /// embedding frees the model. Encoding it throws.
  virtual std::shared_ptr<TextEncoder> tokenizer_only() const = 0;

  /// The width of the per-token hidden states.
  virtual int64_t hidden_size() const = 0;
  /// The width of the pooled output; 0 when the encoder has none.
  virtual int64_t pooled_size() const { return 0; }
  /// The number of layers (hidden_states has one more entry).
  virtual int64_t num_layers() const = 0;

  /// The ids (and mask) of several prompts, padded and cut as the pipeline's tokenizer call does.
  virtual Tokens tokenize(const std::vector<std::string>& prompts) const = 0;
  /// One prompt's: [L] (the row tokenize({prompt}) gives).
  Tokens tokenize(const std::string& prompt) const;

  /// How many of a prompt's tokens fit (what the tokenizer keeps of the text itself).
  virtual int64_t kept_tokens() const = 0;
  /// The prompt's tokens before cutting (the text's own, without special tokens).
  virtual int64_t prompt_tokens(const std::string& prompt) const = 0;
  /// The rule that sets kept_tokens(), for messages ("model_max_length 77 with bos and eos").
  virtual std::string length_rule() const = 0;
  /// For encoders whose prompt length is the pipeline's choice (FluxPipeline's
  /// max_sequence_length for its T5): sets it and returns true; false for the others.
  virtual bool set_sequence_length(int64_t /*tokens*/) { return false; }
  /// What besides the encoder's files changes its embeddings (a chosen sequence length), for
  /// cache keys; "" when nothing does.
  virtual std::string cache_key() const { return ""; }

  /// Encodes token ids made by tokenize() (any device; moved to the model's), with grad as the
  /// caller's mode is. Throws difftrain::Error once released.
  virtual TextEncoding encode(const Tokens& tokens, const EncodeRequest& request) const = 0;

 protected:
  /// Throws difftrain::Error naming the component when the model was released.
  void check_loaded() const;

 private:
  TextEncoderFiles files_;
};

}  // namespace difftrain::diffusion
