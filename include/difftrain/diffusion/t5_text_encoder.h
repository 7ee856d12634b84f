#pragma once
// A T5 encoder as a TextEncoder: Transformers' T5Tokenizer (SentencePiece) with T5EncoderModel,
// prompts padded or cut to a sequence length the pipeline chooses (FluxPipeline's
// max_sequence_length), no attention mask, no pooled output.

#include "difftrain/diffusion/text_encoder.h"
#include "difftrain/models/text_encoders/t5_encoder.h"
#include "difftrain/models/tokenizers/t5_tokenizer.h"

namespace difftrain::diffusion {

class T5TextEncoder final : public TextEncoder {
 public:
  /// Throws difftrain::Error when `model` or `tokenizer` is null, or sequence_length < 1.
  T5TextEncoder(TextEncoderFiles files, std::shared_ptr<const models::T5Tokenizer> tokenizer,
                models::T5EncoderModel model, int64_t sequence_length = 512);
  /// Reads the SentencePiece tokenizer and the model, file by file in `dtype` (never whole in
  /// float32), on the CPU.
  static std::shared_ptr<T5TextEncoder> load(const TextEncoderFiles& files,
                                             const std::string& variant,
                                             torch::Dtype dtype = torch::kFloat32,
                                             int64_t sequence_length = 512);

  const models::T5Tokenizer& tokenizer() const { return *tokenizer_; }
  const models::T5EncoderModel& model() const { return model_; }
  int64_t sequence_length() const { return sequence_length_; }

  std::string class_name() const override { return "T5EncoderModel"; }
  torch::nn::Module* module() const override;
  std::shared_ptr<TextEncoder> clone() const override {
    return std::make_shared<T5TextEncoder>(*this);
  }
  std::shared_ptr<TextEncoder> tokenizer_only() const override;
  int64_t hidden_size() const override { return d_model_; }
  int64_t num_layers() const override { return num_layers_; }
  Tokens tokenize(const std::vector<std::string>& prompts) const override;
  using TextEncoder::tokenize;
  /// sequence_length() - 1: </s> takes the last place.
  int64_t kept_tokens() const override { return sequence_length_ - 1; }
  int64_t prompt_tokens(const std::string& prompt) const override;
  std::string length_rule() const override;
  bool set_sequence_length(int64_t tokens) override;
  std::string cache_key() const override;
  /// last_hidden_state of every position (no mask, as FluxPipeline); skip_layers must be 0.
  TextEncoding encode(const Tokens& tokens, const EncodeRequest& request) const override;

 private:
  std::shared_ptr<const models::T5Tokenizer> tokenizer_;
  models::T5EncoderModel model_{nullptr};
  int64_t sequence_length_ = 512, d_model_ = 0, num_layers_ = 0;
};

}  // namespace difftrain::diffusion
