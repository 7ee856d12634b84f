#pragma once
// A pipeline's text encoders as one component: the TextEncoders a family composes (text_encoder.h:
// a tokenizer and its model each) and the PromptComposition that makes the prompt embeddings
// from their outputs (prompt_composition.h; Diffusers' encode_prompt, per pipeline). Pipelines
// encode prompts with it, training tasks tokenize captions, encode batches and key their caches
// with it, and LoRA finds its encoders by component name. There is no closed list of layouts:
// one CLIP, two CLIPs and CLIP + T5 are compositions, and a new encoder is a new TextEncoder.

#include "difftrain/diffusion/clip_text_encoder.h"
#include "difftrain/diffusion/prompt_composition.h"
#include "difftrain/diffusion/t5_text_encoder.h"
#include "difftrain/diffusion/text_encoder.h"

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::diffusion {

class TextEncoderStack {
 public:
  using Files = TextEncoderFiles;

  TextEncoderStack() = default;
  /// Throws difftrain::Error when the encoders do not fit the composition
  /// (PromptComposition::check) or one is null.
  TextEncoderStack(std::shared_ptr<const PromptComposition> composition, TextEncoders encoders);

  bool empty() const { return encoders_.empty(); }
  size_t size() const { return encoders_.size(); }
  /// Encoder i, in the composition's order.
  const TextEncoder& operator[](size_t i) const { return *encoders_.at(i); }
  TextEncoder& operator[](size_t i) { return *encoders_.at(i); }
  /// Encoder i as the class it is (ClipTextEncoder, T5TextEncoder, a family's own); throws
  /// difftrain::Error naming the component when it is another.
  template <class T>
  const T& as(size_t i) const {
    const auto* e = dynamic_cast<const T*>(encoders_.at(i).get());
    if (e == nullptr) wrong_class(i);
    return *e;
  }
  const TextEncoders& encoders() const { return encoders_; }
  /// The composition (null for an empty stack).
  const std::shared_ptr<const PromptComposition>& composition() const { return composition_; }

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
  /// The width P of the pooled embedding; 0 when the composition has none.
  int64_t pooled_dim() const;

  /// The largest Diffusers clip_skip the composition takes (one encoder: layers - 1;
  /// concatenated hidden states: the shallower encoder's layers - 2, its embedding being the
  /// penultimate layer's already; 0 where clip_skip does not apply).
  int64_t max_clip_skip() const;
  /// Diffusers' clip_skip from kohya's `--clip_skip` N (1 = the last layer): N - 1. Throws
  /// difftrain::Error for N < 1 or beyond max_clip_skip() + 1, naming the bound.
  int64_t clip_skip_from_kohya(int64_t kohya_clip_skip) const;

  /// The batch key of encoder i's token ids: "input_ids", "input_ids_2", ...
  static std::string ids_key(size_t i);
  /// The batch key of encoder i's attention mask (encoders that make one): "attention_mask",
  /// "attention_mask_2", ...
  static std::string mask_key(size_t i);
  /// `caption`'s token ids for every encoder ([L] int64) under ids_key(i), and its mask under
  /// mask_key(i) for the encoders that make one.
  std::map<std::string, torch::Tensor> tokenize(const std::string& caption) const;
  /// The tokens of several prompts, one [N, L] per encoder.
  std::vector<Tokens> tokenize(const std::vector<std::string>& prompts) const;
  /// The tokens under ids_key / mask_key `prefix`-ed in a collated batch (what tokenize(caption)
  /// put there), one per encoder.
  std::vector<Tokens> tokens_of(const std::map<std::string, torch::Tensor>& batch,
                                const std::string& prefix = "") const;

  /// What the tokenizers cut from `prompts` (Diffusers warns "The following part of your input
  /// was truncated ..."): one line per encoder that cuts any, naming how many of the prompts it
  /// cuts, the most tokens cut from one, and the first such prompt; empty when all fit. `what`
  /// names them ("prompt", "caption").
  std::vector<std::string> truncation_report(const std::vector<std::string>& prompts,
                                             const std::string& what = "prompt") const;
  /// encode() warns once (main rank) about the prompts it cuts, unless the caller already said
  /// it (a training run reports its captions before encoding them): this silences it.
  void set_truncation_reported() const { truncation_warned_ = true; }

  /// The token count that encoders whose prompt length is the pipeline's choice pad or cut
  /// prompts to (FluxPipeline's max_sequence_length for its T5); the others keep their
  /// tokenizer's. Throws difftrain::Error for n < 1.
  void set_max_sequence_length(int64_t n);

  /// Prompt embeddings of `prompts` on the first encoder's device, under no-grad. `prompts_2`,
  /// when given (one per prompt), go to the second encoder instead of `prompts` (Diffusers'
  /// prompt_2).
  PromptEmbeds encode(const std::vector<std::string>& prompts, int64_t clip_skip = 0,
                      const std::vector<std::string>& prompts_2 = {}) const;
  /// The same from tokens already made (one per encoder, in order, on any device), with grad as
  /// the caller's mode is (text-encoder training). Throws difftrain::Error for a clip_skip beyond
  /// max_clip_skip().
  PromptEmbeds encode_tokens(const std::vector<Tokens>& tokens, int64_t clip_skip = 0) const;
  /// encode_tokens() of token ids alone (encoders that take no mask).
  PromptEmbeds encode_ids(const std::vector<torch::Tensor>& ids, int64_t clip_skip = 0) const;

  /// Every encoder to `device` (and `dtype`).
  void to(const torch::Device& device, std::optional<torch::Dtype> dtype = std::nullopt);
  /// Every encoder in eval mode, its parameters without grad (frozen).
  void freeze();

 private:
  [[noreturn]] void wrong_class(size_t i) const;

  std::shared_ptr<const PromptComposition> composition_;
  TextEncoders encoders_;
  // encode() warns about cut prompts once per stack (a run's validations encode them again).
  mutable bool truncation_warned_ = false;
};

/// The tokenizer folder of `dir`: `dir` itself when it holds vocab.json or tokenizer.json, else
/// `dir`/tokenizer (a pipeline folder: Stable Diffusion, SDXL, FLUX.1). Throws difftrain::Error
/// ("--model 'DIR' ...") when `dir` is not a folder or has neither.
std::string resolve_tokenizer_dir(const std::string& dir);

/// One prompt's ids as `difftrain tokenize` prints them, and the warning for a prompt that
/// was cut ("" when it fits).
struct TokenizedPrompt {
  std::vector<int64_t> ids;
  std::string warning;
};

/// How `difftrain tokenize` reads a prompt.
struct TokenizeOptions {
  /// Pad and cut to this many ids; 0: the tokenizer's model_max_length (CLIP, T5), no padding
  /// and no cut (Qwen2, whose model_max_length of 131072 no pipeline pads to).
  int64_t max_length = 0;
  /// Drop the padding (the ids stay cut).
  bool no_padding = false;
  /// Wrap each prompt in the folder's chat template first, as `apply_chat_template([{"role":
  /// "user", "content": prompt}], add_generation_prompt=True, **template_kwargs)` does (Qwen2
  /// folders), and print the ids without padding.
  bool chat_template = false;
  /// The template's keyword arguments (a JSON object); ZImagePipeline's by default.
  std::string template_kwargs = R"({"enable_thinking": true})";
};

/// The ids of each prompt as the tokenizer folder `dir` gives them with padding="max_length",
/// truncation=True: T5 (Transformers' T5Tokenizer: pieces cut to max_length - 1, </s>, <pad>)
/// when `dir` holds spiece.model, Qwen2's byte-level BPE (no tokens added, pad on the right)
/// when its tokenizer_config.json names a Qwen2 tokenizer class, else CLIP (bos, BPE ids, eos,
/// padding). The warning names the prompt's index and its first ~40 characters and says what was
/// dropped. Throws difftrain::Error for `chat_template` on a folder without one.
std::vector<TokenizedPrompt> tokenize_prompts(const std::string& dir,
                                              const std::vector<std::string>& prompts,
                                              const TokenizeOptions& options = {});

}  // namespace difftrain::diffusion
