#pragma once
// A decoder LLM (Transformers' Qwen3Model) as a TextEncoder: each prompt wrapped in the tokenizer
// folder's chat template as a user message (`apply_chat_template(..., add_generation_prompt=True,
// **template_kwargs)`), tokenized with Qwen2's byte-level BPE, padded on the right and cut to a
// sequence length the pipeline chooses (`padding="max_length", max_length=max_sequence_length,
// truncation=True`), encoded with the padding mask. What a family takes of the hidden states
// (ZImagePipeline: hidden_states[-2] at the real tokens) is its composition's choice.

#include "difftrain/diffusion/text_encoder.h"
#include "difftrain/models/text_encoders/qwen3_model.h"
#include "difftrain/models/tokenizers/qwen2_tokenizer.h"

#include <nlohmann/json.hpp>

namespace difftrain::diffusion {

/// How prompts become the LLM's input.
struct Qwen3PromptFormat {
  /// Wrap prompts in the folder's chat template (false: the prompt text as is).
  bool chat_template = true;
  /// The template's keyword arguments (ZImagePipeline: {"enable_thinking": true}).
  nlohmann::ordered_json template_kwargs = {{"enable_thinking", true}};
  /// Pad and cut to this many tokens, the template's included (max_sequence_length).
  int64_t sequence_length = 512;
  /// Instead of the chat template (chat_template false): a fixed text with one "{}" where the
  /// prompt goes, as Python's str.format fills it (QwenImagePipeline's prompt_template_encode).
  std::string text_template;
  /// Pad to the batch's longest rendered prompt (padding=True) instead of sequence_length; the
  /// cut stays at sequence_length (truncation=True, max_length).
  bool pad_to_longest = false;
};

class Qwen3TextEncoder final : public TextEncoder {
 public:
  /// Throws difftrain::Error when `model` or `tokenizer` is null, sequence_length < 1, or
  /// `format.chat_template` is asked of a tokenizer folder without one.
  Qwen3TextEncoder(TextEncoderFiles files, std::shared_ptr<const models::Qwen2Tokenizer> tokenizer,
                   models::Qwen3Model model, Qwen3PromptFormat format = {});
  /// Reads the tokenizer folder and the model, file by file in `dtype`, on the CPU.
  /// With `visual` given, a Qwen2.5-VL folder's vision-tower tensors go there
  /// (models::load_qwen3_model's).
  static std::shared_ptr<Qwen3TextEncoder> load(const TextEncoderFiles& files,
                                                const std::string& variant,
                                                torch::Dtype dtype = torch::kFloat32,
                                                Qwen3PromptFormat format = {},
                                                io::TensorMap* visual = nullptr);

  const models::Qwen2Tokenizer& tokenizer() const { return *tokenizer_; }
  const Qwen3PromptFormat& format() const { return format_; }
  /// The language model (null after tokenizer_only()).
  models::Qwen3Model model() const { return model_; }
  /// The text the tokenizer reads for `prompt` (the chat template applied when asked).
  std::string render(const std::string& prompt) const;

  std::string class_name() const override { return architecture_; }
  torch::nn::Module* module() const override;
  std::shared_ptr<TextEncoder> clone() const override {
    return std::make_shared<Qwen3TextEncoder>(*this);
  }
  std::shared_ptr<TextEncoder> tokenizer_only() const override;
  int64_t hidden_size() const override { return hidden_size_; }
  int64_t num_layers() const override { return num_layers_; }
  /// input_ids and attention_mask [N, sequence_length] (or [N, the longest] with pad_to_longest):
  /// the rendered prompts' ids, then pad_token.
  Tokens tokenize(const std::vector<std::string>& prompts) const override;
  using TextEncoder::tokenize;
  /// sequence_length: the template's tokens count too.
  int64_t kept_tokens() const override { return format_.sequence_length; }
  /// The rendered prompt's tokens (the template's included).
  int64_t prompt_tokens(const std::string& prompt) const override;
  std::string length_rule() const override;
  bool set_sequence_length(int64_t tokens) override;
  std::string cache_key() const override;
  /// skip_layers k: last_hidden_state is Transformers' hidden_states[-(k + 1)] (k = 0: the final
  /// norm of the last layer; k > 0: the raw output of layer num_layers - 1 - k, and the layers
  /// after it are not run). hidden_states: every entry. attention_mask: the tokens'.
  TextEncoding encode(const Tokens& tokens, const EncodeRequest& request) const override;

 private:
  std::shared_ptr<const models::Qwen2Tokenizer> tokenizer_;
  models::Qwen3Model model_{nullptr};
  Qwen3PromptFormat format_;
  int64_t hidden_size_ = 0, num_layers_ = 0;
  std::string architecture_ = "Qwen3Model";
};

}  // namespace difftrain::diffusion
