// ClipTextEncoder: CLIP as a TextEncoder (clip_text_encoder.h).
#include "difftrain/diffusion/clip_text_encoder.h"

#include "difftrain/core/error.h"
#include "difftrain/models/module_info.h"

#include <torch/torch.h>

namespace difftrain::diffusion {

ClipTextEncoder::ClipTextEncoder(TextEncoderFiles files, models::ClipTokenizer tokenizer,
                                 models::ClipTextModel model)
    : TextEncoder(std::move(files)), tokenizer_(std::move(tokenizer)), model_(std::move(model)) {
  if (model_.is_empty()) throw Error("text encoder: " + component() + " is not loaded");
  config_ = model_->config();
  projection_ = model_->has_projection();
  if (tokenizer_.model_max_length() > config_.max_position_embeddings) {
    tokenizer_.set_model_max_length(config_.max_position_embeddings);
  }
}

std::shared_ptr<ClipTextEncoder> ClipTextEncoder::load(const TextEncoderFiles& files,
                                                       bool with_projection,
                                                       const std::string& variant,
                                                       torch::Dtype dtype) {
  auto tokenizer = models::ClipTokenizer::from_folder(files.tokenizer_dir);
  auto model = models::load_clip_text_model(files.model_dir, variant, with_projection);
  if (dtype != torch::kFloat32) model->to(dtype);
  return std::make_shared<ClipTextEncoder>(files, std::move(tokenizer), std::move(model));
}

std::string ClipTextEncoder::class_name() const {
  return projection_ ? "CLIPTextModelWithProjection" : "CLIPTextModel";
}

torch::nn::Module* ClipTextEncoder::module() const {
  return model_.is_empty() ? nullptr : model_.ptr().get();
}

std::shared_ptr<TextEncoder> ClipTextEncoder::tokenizer_only() const {
  auto out = std::make_shared<ClipTextEncoder>(*this);
  out->model_ = models::ClipTextModel(nullptr);
  return out;
}

int64_t ClipTextEncoder::pooled_size() const {
  return projection_ ? config_.projection_dim : config_.hidden_size;
}

Tokens ClipTextEncoder::tokenize(const std::vector<std::string>& prompts) const {
  return {tokenizer_.encode_batch(prompts), {}};
}

int64_t ClipTextEncoder::prompt_tokens(const std::string& prompt) const {
  return tokenizer_.encode(prompt).num_tokens;
}

std::string ClipTextEncoder::length_rule() const {
  return "model_max_length " + std::to_string(tokenizer_.model_max_length()) + " with bos and eos";
}

TextEncoding ClipTextEncoder::encode(const Tokens& tokens, const EncodeRequest& request) const {
  check_loaded();
  // Encoding changes no state: the holder's shared pointer gives the non-const forward().
  auto& model = *model_.ptr();
  auto r = model.forward(tokens.input_ids.to(models::module_device(model)), request.skip_layers,
                         request.hidden_states);
  TextEncoding out;
  out.last_hidden_state = r.last_hidden_state;
  out.pooled = projection_ ? r.text_embeds : r.pooler_output;
  out.hidden_states = std::move(r.hidden_states);
  return out;
}

}  // namespace difftrain::diffusion
