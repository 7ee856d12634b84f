// Qwen3TextEncoder: a Qwen3 decoder LLM as a TextEncoder (qwen3_text_encoder.h).
#include "difftrain/diffusion/qwen3_text_encoder.h"

#include "difftrain/core/error.h"
#include "difftrain/models/module_info.h"

#include <torch/torch.h>

namespace difftrain::diffusion {

Qwen3TextEncoder::Qwen3TextEncoder(TextEncoderFiles files,
                                   std::shared_ptr<const models::Qwen2Tokenizer> tokenizer,
                                   models::Qwen3Model model, Qwen3PromptFormat format)
    : TextEncoder(std::move(files)),
      tokenizer_(std::move(tokenizer)),
      model_(std::move(model)),
      format_(std::move(format)) {
  if (model_.is_empty() || !tokenizer_) {
    throw Error("text encoder: " + component() + " (a Qwen language model) is not loaded");
  }
  if (format_.chat_template && tokenizer_->chat_template() == nullptr) {
    throw Error("text encoder: " + tokenizer_component() + " ('" + tokenizer_dir() +
                "') has no chat template (tokenizer_config.json's chat_template or "
                "chat_template.jinja), which the pipeline wraps prompts in: use the tokenizer "
                "folder saved with the model");
  }
  if (!format_.chat_template && !format_.text_template.empty() &&
      format_.text_template.find("{}") == std::string::npos) {
    throw Error("text encoder: the prompt template has no \"{}\" for the prompt");
  }
  hidden_size_ = model_->options().hidden_size();
  architecture_ = model_->options().architecture();
  num_layers_ = model_->options().num_hidden_layers();
  set_sequence_length(format_.sequence_length);
}

std::shared_ptr<Qwen3TextEncoder> Qwen3TextEncoder::load(const TextEncoderFiles& files,
                                                         const std::string& variant,
                                                         torch::Dtype dtype,
                                                         Qwen3PromptFormat format,
                                                         io::TensorMap* visual) {
  auto tokenizer = std::make_shared<const models::Qwen2Tokenizer>(
      models::Qwen2Tokenizer::from_folder(files.tokenizer_dir));
  auto model = models::load_qwen3_model(files.model_dir, dtype, variant, visual);
  return std::make_shared<Qwen3TextEncoder>(files, std::move(tokenizer), std::move(model),
                                            std::move(format));
}

std::string Qwen3TextEncoder::render(const std::string& prompt) const {
  if (!format_.chat_template) {
    if (format_.text_template.empty()) return prompt;
    const size_t at = format_.text_template.find("{}");
    return format_.text_template.substr(0, at) + prompt + format_.text_template.substr(at + 2);
  }
  const nlohmann::ordered_json messages = {{{"role", "user"}, {"content", prompt}}};
  return tokenizer_->apply_chat_template(messages, true, format_.template_kwargs);
}

torch::nn::Module* Qwen3TextEncoder::module() const {
  return model_.is_empty() ? nullptr : model_.ptr().get();
}

std::shared_ptr<TextEncoder> Qwen3TextEncoder::tokenizer_only() const {
  auto out = std::make_shared<Qwen3TextEncoder>(*this);
  out->model_ = models::Qwen3Model(nullptr);
  return out;
}

Tokens Qwen3TextEncoder::tokenize(const std::vector<std::string>& prompts) const {
  const auto n = static_cast<int64_t>(prompts.size());
  int64_t length = format_.sequence_length;
  if (format_.pad_to_longest) {
    int64_t longest = 1;
    for (const auto& p : prompts) {
      longest = std::max(longest, static_cast<int64_t>(tokenizer_->encode(render(p)).size()));
    }
    length = std::min(length, longest);
  }
  auto ids = torch::empty({n, length}, torch::kInt64);
  auto mask = torch::empty({n, length}, torch::kInt64);
  for (int64_t i = 0; i < n; ++i) {
    const auto e = tokenizer_->encode_padded(render(prompts[static_cast<size_t>(i)]), length);
    std::copy(e.input_ids.begin(), e.input_ids.end(), ids[i].data_ptr<int64_t>());
    std::copy(e.attention_mask.begin(), e.attention_mask.end(), mask[i].data_ptr<int64_t>());
  }
  return {ids, mask};
}

int64_t Qwen3TextEncoder::prompt_tokens(const std::string& prompt) const {
  return static_cast<int64_t>(tokenizer_->encode(render(prompt)).size());
}

std::string Qwen3TextEncoder::length_rule() const {
  return "--max_sequence_length " + std::to_string(format_.sequence_length) +
         (format_.chat_template           ? " with the chat template's tokens"
          : format_.text_template.empty() ? ""
                                          : " with the prompt template's tokens");
}

bool Qwen3TextEncoder::set_sequence_length(int64_t tokens) {
  if (tokens < 1) {
    throw Error("max_sequence_length is " + std::to_string(tokens) + "; it must be at least 1");
  }
  format_.sequence_length = tokens;
  return true;
}

std::string Qwen3TextEncoder::cache_key() const {
  return "qwen3 " + std::to_string(format_.sequence_length) + " " +
         (format_.chat_template           ? format_.template_kwargs.dump()
          : format_.text_template.empty() ? std::string("plain")
                                          : "template " + format_.text_template) +
         (format_.pad_to_longest ? " longest" : "");
}

TextEncoding Qwen3TextEncoder::encode(const Tokens& tokens, const EncodeRequest& request) const {
  check_loaded();
  if (request.skip_layers < 0 || request.skip_layers >= num_layers_) {
    throw Error(component() + " (" + architecture_ + "): skip_layers " +
                std::to_string(request.skip_layers) + " is out of [0, " +
                std::to_string(num_layers_ - 1) + "]");
  }
  auto& model = *model_.ptr();
  const auto device = models::module_device(model);
  const auto ids = tokens.input_ids.dim() == 1 ? tokens.input_ids.unsqueeze(0) : tokens.input_ids;
  torch::Tensor mask = tokens.attention_mask;
  if (mask.defined() && mask.dim() == 1) mask = mask.unsqueeze(0);
  if (mask.defined()) mask = mask.to(device);
  TextEncoding out;
  out.attention_mask = tokens.attention_mask;
  auto r =
      model.forward(ids.to(device), mask, request.hidden_states ? -1 : -1 - request.skip_layers);
  const auto n = static_cast<int64_t>(r.hidden_states.size());
  out.last_hidden_state = r.hidden_states[static_cast<size_t>(
      n - 1 - (request.hidden_states ? request.skip_layers : 0))];
  if (request.hidden_states) out.hidden_states = std::move(r.hidden_states);
  if (tokens.input_ids.dim() == 1) out.last_hidden_state = out.last_hidden_state.squeeze(0);
  return out;
}

}  // namespace difftrain::diffusion
