// T5TextEncoder: T5 as a TextEncoder (t5_text_encoder.h).
#include "difftrain/diffusion/t5_text_encoder.h"

#include "difftrain/core/error.h"
#include "difftrain/models/module_info.h"

#include <torch/torch.h>

namespace difftrain::diffusion {

T5TextEncoder::T5TextEncoder(TextEncoderFiles files,
                             std::shared_ptr<const models::T5Tokenizer> tokenizer,
                             models::T5EncoderModel model, int64_t sequence_length)
    : TextEncoder(std::move(files)), tokenizer_(std::move(tokenizer)), model_(std::move(model)) {
  if (model_.is_empty() || !tokenizer_) {
    throw Error("text encoder: " + component() + " (T5) is not loaded");
  }
  d_model_ = model_->options().d_model();
  num_layers_ = model_->options().num_layers();
  set_sequence_length(sequence_length);
}

std::shared_ptr<T5TextEncoder> T5TextEncoder::load(const TextEncoderFiles& files,
                                                   const std::string& variant, torch::Dtype dtype,
                                                   int64_t sequence_length) {
  auto tokenizer =
      std::make_shared<const models::T5Tokenizer>(models::T5Tokenizer::load(files.tokenizer_dir));
  auto model = models::load_t5_encoder(files.model_dir, dtype, variant);
  return std::make_shared<T5TextEncoder>(files, std::move(tokenizer), std::move(model),
                                         sequence_length);
}

torch::nn::Module* T5TextEncoder::module() const {
  return model_.is_empty() ? nullptr : model_.ptr().get();
}

std::shared_ptr<TextEncoder> T5TextEncoder::tokenizer_only() const {
  auto out = std::make_shared<T5TextEncoder>(*this);
  out->model_ = models::T5EncoderModel(nullptr);
  return out;
}

Tokens T5TextEncoder::tokenize(const std::vector<std::string>& prompts) const {
  return {(*tokenizer_)(prompts, sequence_length_), {}};
}

int64_t T5TextEncoder::prompt_tokens(const std::string& prompt) const {
  return static_cast<int64_t>(tokenizer_->piece_ids(prompt).size());
}

std::string T5TextEncoder::length_rule() const {
  return "--max_sequence_length " + std::to_string(sequence_length_) + " with </s>";
}

bool T5TextEncoder::set_sequence_length(int64_t tokens) {
  if (tokens < 1) {
    throw Error("max_sequence_length is " + std::to_string(tokens) + "; it must be at least 1");
  }
  sequence_length_ = tokens;
  return true;
}

std::string T5TextEncoder::cache_key() const { return "t5 " + std::to_string(sequence_length_); }

TextEncoding T5TextEncoder::encode(const Tokens& tokens, const EncodeRequest& request) const {
  check_loaded();
  if (request.skip_layers != 0) {
    throw Error(component() + " (T5EncoderModel) takes no clip_skip");
  }
  auto& model = *model_.ptr();
  TextEncoding out;
  if (request.hidden_states) {
    auto r = model.forward_all(tokens.input_ids.to(models::module_device(model)));
    out.last_hidden_state = r.last_hidden_state;
    out.hidden_states = std::move(r.hidden_states);
  } else {
    out.last_hidden_state = model.forward(tokens.input_ids.to(models::module_device(model)));
  }
  return out;
}

}  // namespace difftrain::diffusion
