#pragma once
// A CLIP text encoder as a TextEncoder: Transformers' CLIPTokenizer with CLIPTextModel or
// CLIPTextModelWithProjection (pooled output: text_embeds with the projection, else
// pooler_output).

#include "difftrain/diffusion/text_encoder.h"
#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/models/tokenizers/clip_tokenizer.h"

namespace difftrain::diffusion {

class ClipTextEncoder final : public TextEncoder {
 public:
  /// The tokenizer's model_max_length is capped at the model's max_position_embeddings. Throws
  /// difftrain::Error when `model` is null.
  ClipTextEncoder(TextEncoderFiles files, models::ClipTokenizer tokenizer,
                  models::ClipTextModel model);
  /// Reads `files.tokenizer_dir` and `files.model_dir` (safetensors `variant`), the model as
  /// CLIPTextModelWithProjection when `with_projection`, then cast to `dtype` on the CPU.
  static std::shared_ptr<ClipTextEncoder> load(const TextEncoderFiles& files, bool with_projection,
                                               const std::string& variant,
                                               torch::Dtype dtype = torch::kFloat32);

  const models::ClipTokenizer& tokenizer() const { return tokenizer_; }
  /// The model (null once released).
  const models::ClipTextModel& model() const { return model_; }

  std::string class_name() const override;
  torch::nn::Module* module() const override;
  std::shared_ptr<TextEncoder> clone() const override {
    return std::make_shared<ClipTextEncoder>(*this);
  }
  std::shared_ptr<TextEncoder> tokenizer_only() const override;
  int64_t hidden_size() const override { return config_.hidden_size; }
  int64_t pooled_size() const override;
  int64_t num_layers() const override { return config_.num_hidden_layers; }
  Tokens tokenize(const std::vector<std::string>& prompts) const override;
  using TextEncoder::tokenize;
  int64_t kept_tokens() const override { return tokenizer_.model_max_length() - 2; }
  int64_t prompt_tokens(const std::string& prompt) const override;
  std::string length_rule() const override;
  /// skip_layers: CLIPTextModel's clip_skip (last_hidden_state is layer L - skip, final-normed).
  TextEncoding encode(const Tokens& tokens, const EncodeRequest& request) const override;

 private:
  models::ClipTokenizer tokenizer_;
  models::ClipTextModel model_{nullptr};
  models::ClipTextConfig config_;  // kept when the model is released
  bool projection_ = false;
};

}  // namespace difftrain::diffusion
