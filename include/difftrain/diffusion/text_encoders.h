#pragma once
// A pipeline's text encoders as one component: the tokenizers, the encoders and how their
// outputs make the prompt embeddings (Diffusers' encode_prompt, per pipeline). One CLIP (Stable
// Diffusion 1.x/2.x), two CLIPs (SDXL) and CLIP + T5 (FLUX.1) are layouts of the same
// class, so a family composes a TextEncoderStack instead of holding tokenizers and encoders
// itself: pipelines encode prompts with it, training tasks tokenize captions, encode batches and
// key their caches with it, and LoRA finds its encoders by component name.

#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/models/text_encoders/t5_encoder.h"
#include "difftrain/models/tokenizers/clip_tokenizer.h"
#include "difftrain/models/tokenizers/t5_tokenizer.h"

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::diffusion {

/// Prompt embeddings: per token [N, L, D] and, for layouts that have one, pooled [N, P].
struct PromptEmbeds {
  torch::Tensor embeds;
  torch::Tensor pooled;  ///< undefined for kClip
};

class TextEncoderStack {
 public:
  /// How the encoders' outputs make the prompt embeddings.
  enum class Layout {
    /// StableDiffusionPipeline: one CLIPTextModel; embeds = last_hidden_state after skipping
    /// `clip_skip` layers (through final_layer_norm). No pooled embedding.
    kClip,
    /// StableDiffusionXLPipeline: CLIPTextModel + CLIPTextModelWithProjection; embeds =
    /// cat(hidden_states[-(clip_skip + 2)] of each, -1) (before final_layer_norm); pooled = the
    /// second's text_embeds.
    kDualClip,
    /// FluxPipeline: CLIPTextModel + T5EncoderModel; embeds = T5's last_hidden_state of
    /// max_sequence_length() tokens (no attention mask), pooled = CLIP's pooler_output (77
    /// tokens). clip_skip does not apply.
    kClipT5,
  };

  /// One tokenizer and its encoder, and the pipeline components they came from: a CLIP (model,
  /// tokenizer) or a T5 (t5, t5_tokenizer; model stays null).
  struct Encoder {
    std::string component;            ///< "text_encoder", "text_encoder_2"
    std::string tokenizer_component;  ///< "tokenizer", "tokenizer_2"
    models::ClipTokenizer tokenizer;
    models::ClipTextModel model{nullptr};
    std::shared_ptr<models::T5Tokenizer> t5_tokenizer;
    models::T5EncoderModel t5{nullptr};
    /// The encoder as a module, whichever kind it is (null once released: tokenizers_only()).
    torch::nn::Module* module() const;
    /// Where they were read from ("" when built in memory).
    std::string model_dir, tokenizer_dir;
  };

  /// Where one encoder's files are (load()).
  struct Files {
    std::string component, tokenizer_component, model_dir, tokenizer_dir;
  };

  TextEncoderStack() = default;
  /// Throws difftrain::Error when the encoders do not fit the layout (kClip: one; kDualClip:
  /// two, the second with a text projection). Each tokenizer's model_max_length is capped at its
  /// encoder's max_position_embeddings.
  TextEncoderStack(Layout layout, std::vector<Encoder> encoders);

  /// Reads each encoder (safetensors `variant`, on the CPU in `dtype`; T5 is read file by file in
  /// that dtype, never whole in float32) and tokenizer; the second of kDualClip as
  /// CLIPTextModelWithProjection, the second of kClipT5 as T5EncoderModel with its SentencePiece
  /// tokenizer.
  static TextEncoderStack load(Layout layout, const std::vector<Files>& files,
                               const std::string& variant = "",
                               torch::Dtype dtype = torch::kFloat32);

  bool empty() const { return encoders_.empty(); }
  Layout layout() const { return layout_; }
  size_t size() const { return encoders_.size(); }
  const Encoder& operator[](size_t i) const { return encoders_.at(i); }
  Encoder& operator[](size_t i) { return encoders_.at(i); }
  const std::vector<Encoder>& encoders() const { return encoders_; }

  /// The encoders as modules, in order (for freezing, casting, LoRA); released ones left out.
  std::vector<torch::nn::Module*> modules() const;
  /// A copy with the tokenizers only, every encoder model dropped from the copy: what tokenizing
  /// needs, and how a training task that has cached every embedding frees the encoders
  /// (`text = text.tokenizers_only()`, once no other copy holds them). Encoding it throws.
  TextEncoderStack tokenizers_only() const;
  /// Whether every encoder's model is loaded (false after tokenizers_only()).
  bool has_models() const;
  /// The pipeline components this stack stands for: each encoder's and tokenizer's.
  std::vector<std::string> components() const;
  /// The width D of the per-token embeddings (what a denoiser's cross-attention takes).
  int64_t embed_dim() const;
  /// The width P of the pooled embedding; 0 when the layout has none.
  int64_t pooled_dim() const;

  /// The largest Diffusers clip_skip the encoders take (kClip: layers - 1; kDualClip: the
  /// shallower encoder's layers - 2, its embedding being the penultimate layer's already;
  /// kClipT5: 0).
  int64_t max_clip_skip() const;
  /// Diffusers' clip_skip from kohya's `--clip_skip` N (1 = the last layer): N - 1. Throws
  /// difftrain::Error for N < 1 or beyond max_clip_skip() + 1, naming the bound.
  int64_t clip_skip_from_kohya(int64_t kohya_clip_skip) const;

  /// The batch key of encoder i's token ids: "input_ids", "input_ids_2", ...
  static std::string ids_key(size_t i);
  /// `caption`'s token ids for every encoder ([model_max_length] int64), under ids_key(i).
  std::map<std::string, torch::Tensor> tokenize(const std::string& caption) const;
  /// The token ids of several prompts, one [N, model_max_length] per encoder.
  std::vector<torch::Tensor> tokenize(const std::vector<std::string>& prompts) const;

  /// What the tokenizers cut from `prompts` (Diffusers warns "The following part of your input
  /// was truncated ..."): one line per encoder that cuts any, naming how many of the prompts it
  /// cuts, the most tokens cut from one, and the first such prompt; empty when all fit. `what`
  /// names them ("prompt", "caption").
  std::vector<std::string> truncation_report(const std::vector<std::string>& prompts,
                                             const std::string& what = "prompt") const;
  /// encode() warns once (main rank) about the prompts it cuts, unless the caller already said
  /// it (a training run reports its captions before encoding them): this silences it.
  void set_truncation_reported() const { truncation_warned_ = true; }

  /// kClipT5: the T5 token count prompts are padded or cut to (FluxPipeline's
  /// max_sequence_length, default 512). Throws difftrain::Error for n < 1.
  void set_max_sequence_length(int64_t n);
  int64_t max_sequence_length() const { return max_sequence_length_; }

  /// Prompt embeddings of `prompts` on the first encoder's device, under no-grad. kClipT5 encodes
  /// `prompts_2` with T5 when given (FluxPipeline's prompt_2; one per prompt), else `prompts`.
  PromptEmbeds encode(const std::vector<std::string>& prompts, int64_t clip_skip = 0,
                      const std::vector<std::string>& prompts_2 = {}) const;
  /// The same from token ids already made (one [N, L] per encoder, in order, on any device),
  /// with grad as the caller's mode is (text-encoder training). Throws difftrain::Error for a
  /// clip_skip beyond max_clip_skip().
  PromptEmbeds encode_ids(const std::vector<torch::Tensor>& ids, int64_t clip_skip = 0) const;

  /// Every encoder to `device` (and `dtype`).
  void to(const torch::Device& device, std::optional<torch::Dtype> dtype = std::nullopt);
  /// Every encoder in eval mode, its parameters without grad (frozen).
  void freeze();

 private:
  Layout layout_ = Layout::kClip;
  std::vector<Encoder> encoders_;
  int64_t max_sequence_length_ = 512;
  // encode() warns about cut prompts once per stack (a run's validations encode them again).
  mutable bool truncation_warned_ = false;
};

/// "clip", "dual-clip" or "clip-t5".
std::string to_string(TextEncoderStack::Layout layout);

/// The CLIP tokenizer folder of `dir`: `dir` itself when it holds vocab.json, else
/// `dir`/tokenizer (a pipeline folder: Stable Diffusion, SDXL, FLUX.1). Throws difftrain::Error
/// ("--model 'DIR' ...") when `dir` is not a folder or has neither.
std::string resolve_tokenizer_dir(const std::string& dir);

/// One prompt's ids as `difftrain tokenize` prints them, and the warning for a prompt that
/// was cut ("" when it fits).
struct TokenizedPrompt {
  std::vector<int64_t> ids;
  std::string warning;
};

/// The ids of each prompt as the tokenizer folder `dir` gives them with padding="max_length",
/// truncation=True: T5 (Transformers' T5Tokenizer: pieces cut to max_length - 1, </s>, <pad>)
/// when `dir` holds spiece.model, else CLIP (bos, BPE ids, eos, padding). max_length 0: the
/// tokenizer's model_max_length. no_padding drops the padding (the ids stay truncated). The
/// warning names the prompt's index and its first ~40 characters and says what was dropped.
std::vector<TokenizedPrompt> tokenize_prompts(const std::string& dir,
                                              const std::vector<std::string>& prompts,
                                              int64_t max_length = 0, bool no_padding = false);

}  // namespace difftrain::diffusion
