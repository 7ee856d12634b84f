// TextEncoderStack: the text side of a pipeline (text_encoders.h).
#include "difftrain/diffusion/text_encoders.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/tokenizers/qwen2_tokenizer.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

namespace difftrain::diffusion {
namespace fs = std::filesystem;

namespace {
std::string prompt_excerpt(const std::string& prompt);
}  // namespace

TextEncoderStack::TextEncoderStack(std::shared_ptr<const PromptComposition> composition,
                                   TextEncoders encoders)
    : composition_(std::move(composition)), encoders_(std::move(encoders)) {
  if (!composition_) throw Error("text-encoder stack: no prompt composition given");
  for (const auto& e : encoders_) {
    if (!e) throw Error("text-encoder stack: an encoder is null");
  }
  composition_->check(encoders_);
}

void TextEncoderStack::wrong_class(size_t i) const {
  throw Error("text-encoder stack: " + encoders_.at(i)->component() + " is a " +
              encoders_.at(i)->class_name() + ", not the encoder class asked for");
}

std::vector<torch::nn::Module*> TextEncoderStack::modules() const {
  std::vector<torch::nn::Module*> out;
  for (const auto& e : encoders_) {
    if (e->module() != nullptr) out.push_back(e->module());
  }
  return out;
}

TextEncoderStack TextEncoderStack::tokenizers_only() const {
  TextEncoderStack out = *this;
  for (auto& e : out.encoders_) e = e->tokenizer_only();
  return out;
}

bool TextEncoderStack::has_models() const {
  for (const auto& e : encoders_) {
    if (e->module() == nullptr) return false;
  }
  return !encoders_.empty();
}

std::vector<std::string> TextEncoderStack::components() const {
  std::vector<std::string> out;
  for (const auto& e : encoders_) out.insert(out.end(), {e->component(), e->tokenizer_component()});
  return out;
}

int64_t TextEncoderStack::embed_dim() const {
  return empty() ? 0 : composition_->embed_dim(encoders_);
}

int64_t TextEncoderStack::pooled_dim() const {
  return empty() ? 0 : composition_->pooled_dim(encoders_);
}

void TextEncoderStack::set_max_sequence_length(int64_t n) {
  if (n < 1) {
    throw Error("max_sequence_length is " + std::to_string(n) + "; it must be at least 1");
  }
  // A copy of each encoder that takes it: stacks copied from this one keep their own length.
  for (auto& e : encoders_) {
    auto copy = e->clone();
    if (copy->set_sequence_length(n)) e = std::move(copy);
  }
}

int64_t TextEncoderStack::max_clip_skip() const {
  return empty() ? 0 : composition_->max_clip_skip(encoders_);
}

int64_t TextEncoderStack::clip_skip_from_kohya(int64_t n) const {
  if (empty()) throw Error("--clip_skip: the pipeline has no text encoder");
  return composition_->clip_skip_from_kohya(encoders_, n);
}

std::string TextEncoderStack::ids_key(size_t i) {
  return i == 0 ? "input_ids" : "input_ids_" + std::to_string(i + 1);
}

std::string TextEncoderStack::mask_key(size_t i) {
  return i == 0 ? "attention_mask" : "attention_mask_" + std::to_string(i + 1);
}

std::vector<std::string> TextEncoderStack::truncation_report(
    const std::vector<std::string>& prompts, const std::string& what) const {
  std::vector<std::string> lines;
  for (const auto& e : encoders_) {
    int64_t cut_prompts = 0, most = 0, first = -1;
    const int64_t kept = e->kept_tokens();
    for (size_t i = 0; i < prompts.size(); ++i) {
      const int64_t cut = e->prompt_tokens(prompts[i]) - kept;
      if (cut <= 0) continue;
      ++cut_prompts;
      if (first < 0) first = static_cast<int64_t>(i);
      most = std::max(most, cut);
    }
    if (cut_prompts == 0) continue;
    lines.push_back(fmt::format(
        "{} of {} {}(s) are longer than {}'s {} tokens ({}): up to {} token(s) cut from one, "
        "the first {} {}; they are encoded truncated, as Diffusers does",
        cut_prompts, prompts.size(), what, e->component(), kept, e->length_rule(), most, what,
        prompt_excerpt(prompts[static_cast<size_t>(first)])));
  }
  return lines;
}

std::map<std::string, torch::Tensor> TextEncoderStack::tokenize(const std::string& caption) const {
  std::map<std::string, torch::Tensor> out;
  for (size_t i = 0; i < encoders_.size(); ++i) {
    auto t = encoders_[i]->tokenize(caption);
    out[ids_key(i)] = std::move(t.input_ids);
    if (t.attention_mask.defined()) out[mask_key(i)] = std::move(t.attention_mask);
  }
  return out;
}

std::vector<Tokens> TextEncoderStack::tokenize(const std::vector<std::string>& prompts) const {
  std::vector<Tokens> out;
  for (const auto& e : encoders_) out.push_back(e->tokenize(prompts));
  return out;
}

std::vector<Tokens> TextEncoderStack::tokens_of(const std::map<std::string, torch::Tensor>& batch,
                                                const std::string& prefix) const {
  std::vector<Tokens> out;
  for (size_t i = 0; i < encoders_.size(); ++i) {
    Tokens t;
    const auto ids = batch.find(prefix + ids_key(i));
    if (ids == batch.end()) {
      throw Error("text-encoder stack: the batch has no " + prefix + ids_key(i) + " for " +
                  encoders_[i]->component());
    }
    t.input_ids = ids->second;
    const auto mask = batch.find(prefix + mask_key(i));
    if (mask != batch.end()) t.attention_mask = mask->second;
    out.push_back(std::move(t));
  }
  return out;
}

PromptEmbeds TextEncoderStack::encode(const std::vector<std::string>& prompts, int64_t clip_skip,
                                      const std::vector<std::string>& prompts_2) const {
  torch::NoGradGuard no_grad;
  if (!truncation_warned_ && log::rank() == 0) {
    truncation_warned_ = true;
    for (const auto& line : truncation_report(prompts)) log::warn("{}", line);
  }
  auto tokens = tokenize(prompts);
  if (!prompts_2.empty()) {
    if (encoders_.size() < 2) {
      throw Error("a second prompt is for a pipeline's second text encoder; this pipeline has " +
                  std::to_string(encoders_.size()));
    }
    if (prompts_2.size() != prompts.size()) {
      throw Error("got " + std::to_string(prompts_2.size()) + " second prompts for " +
                  std::to_string(prompts.size()) + " prompts; give one per prompt");
    }
    tokens[1] = encoders_[1]->tokenize(prompts_2);
  }
  return encode_tokens(tokens, clip_skip);
}

PromptEmbeds TextEncoderStack::encode_tokens(const std::vector<Tokens>& tokens,
                                             int64_t clip_skip) const {
  if (empty()) throw Error("the pipeline has no text encoder to encode prompts with");
  if (!has_models()) {
    throw Error(
        "the text encoders were released after their embeddings were cached; encode "
        "before releasing them");
  }
  if (tokens.size() != encoders_.size()) {
    throw Error("text-encoder stack: got token ids for " + std::to_string(tokens.size()) +
                " encoder(s), the stack has " + std::to_string(encoders_.size()));
  }
  if (clip_skip < 0 || clip_skip > max_clip_skip()) {
    throw Error("clip_skip " + std::to_string(clip_skip) + " needs more than the text encoder's " +
                std::to_string(max_clip_skip() + 1) + " layers");
  }
  return composition_->compose(encoders_, tokens, clip_skip);
}

PromptEmbeds TextEncoderStack::encode_ids(const std::vector<torch::Tensor>& ids,
                                          int64_t clip_skip) const {
  std::vector<Tokens> tokens;
  for (const auto& t : ids) tokens.push_back({t, {}});
  return encode_tokens(tokens, clip_skip);
}

void TextEncoderStack::to(const torch::Device& device, std::optional<torch::Dtype> dtype) {
  for (auto* m : modules()) {
    if (dtype) {
      m->to(device, *dtype);
    } else {
      m->to(device);
    }
  }
}

void TextEncoderStack::freeze() {
  for (auto* m : modules()) {
    m->eval();
    for (auto& p : m->parameters()) p.set_requires_grad(false);
  }
}

std::string resolve_tokenizer_dir(const std::string& dir) {
  if (!fs::is_directory(dir)) {
    throw Error("--model '" + dir +
                "' does not exist: give a pipeline folder (with tokenizer/) or a tokenizer folder "
                "(with vocab.json)");
  }
  if (fs::exists(fs::path(dir) / "vocab.json") || fs::exists(fs::path(dir) / "tokenizer.json")) {
    return dir;
  }
  const auto sub = (fs::path(dir) / "tokenizer").string();
  if (fs::is_directory(sub)) return sub;
  throw Error("--model '" + dir +
              "' has neither vocab.json nor a tokenizer/ folder: give a pipeline folder or a "
              "CLIP tokenizer folder");
}

namespace {

// The first ~40 characters of a prompt, JSON-quoted so that it stays on one line.
std::string prompt_excerpt(const std::string& prompt) {
  size_t cut = prompt.size(), chars = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if ((static_cast<unsigned char>(prompt[i]) & 0xC0) == 0x80) continue;  // UTF-8 continuation
    if (chars++ == 40) {
      cut = i;
      break;
    }
  }
  const auto quoted = nlohmann::json(prompt.substr(0, cut))
                          .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return cut < prompt.size() ? quoted.substr(0, quoted.size() - 1) + "...\"" : quoted;
}

}  // namespace

std::vector<TokenizedPrompt> tokenize_prompts(const std::string& dir,
                                              const std::vector<std::string>& prompts,
                                              const TokenizeOptions& options) {
  std::vector<TokenizedPrompt> out;
  const int64_t max_length = options.max_length;
  const bool no_padding = options.no_padding;
  if (models::Qwen2Tokenizer::is_folder(dir)) {
    const auto qwen = models::Qwen2Tokenizer::from_folder(dir);
    nlohmann::ordered_json kwargs;
    if (options.chat_template) {
      try {
        kwargs = nlohmann::ordered_json::parse(options.template_kwargs);
      } catch (const nlohmann::json::exception&) {
        kwargs = nullptr;
      }
      if (!kwargs.is_object()) {
        throw Error("--template_kwargs '" + options.template_kwargs +
                    "' is not a JSON object: write e.g. '{\"enable_thinking\": true}'");
      }
    }
    for (size_t i = 0; i < prompts.size(); ++i) {
      std::string text = prompts[i];
      if (options.chat_template) {
        const nlohmann::ordered_json messages = {{{"role", "user"}, {"content", text}}};
        text = qwen.apply_chat_template(messages, true, kwargs);
      }
      TokenizedPrompt p;
      if (max_length <= 0) {
        p.ids = qwen.encode(text);
      } else {
        const auto e = qwen.encode_padded(text, max_length);
        if (e.truncated) {
          p.warning = "prompt " + std::to_string(i) + " (" + prompt_excerpt(prompts[i]) + ") has " +
                      std::to_string(e.num_tokens) + " tokens; only the first " +
                      std::to_string(max_length) + " fit in max_length " +
                      std::to_string(max_length) + ", the last " +
                      std::to_string(e.num_tokens - max_length) + " were dropped";
        }
        const bool pad = !no_padding && !options.chat_template;
        const auto keep =
            pad ? e.input_ids.size() : static_cast<size_t>(std::min(e.num_tokens, max_length));
        p.ids.assign(e.input_ids.begin(), e.input_ids.begin() + static_cast<std::ptrdiff_t>(keep));
      }
      out.push_back(std::move(p));
    }
    return out;
  }
  if (options.chat_template) {
    throw Error("--chat_template: the tokenizer folder '" + dir +
                "' is not a Qwen2 tokenizer (tokenizer_config.json's tokenizer_class) and has no "
                "chat template: drop --chat_template or give the text encoder's tokenizer");
  }
  if (fs::is_regular_file(fs::path(dir) / "spiece.model")) {
    const auto t5 = models::T5Tokenizer::load(dir);
    const int64_t length = max_length > 0 ? max_length : t5.model_max_length();
    for (size_t i = 0; i < prompts.size(); ++i) {
      TokenizedPrompt p;
      bool truncated = false;
      p.ids = t5.encode(prompts[i], length, &truncated);
      if (truncated) {
        p.warning = "prompt " + std::to_string(i) + " (" + prompt_excerpt(prompts[i]) +
                    ") is longer than " + std::to_string(length - 1) +
                    " T5 pieces; the rest was dropped";
      }
      if (no_padding) {
        while (p.ids.size() > 1 && p.ids.back() == t5.pad_id()) p.ids.pop_back();
      }
      out.push_back(std::move(p));
    }
    return out;
  }
  auto tokenizer = models::ClipTokenizer::from_folder(dir);
  if (max_length > 0) tokenizer.set_model_max_length(max_length);
  const int64_t kept = tokenizer.model_max_length() - 2;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto e = tokenizer.encode(prompts[i]);
    TokenizedPrompt p;
    if (e.truncated) {
      // Diffusers logs the same: "The following part of your input was truncated ...".
      p.warning = "prompt " + std::to_string(i) + " (" + prompt_excerpt(prompts[i]) + ") has " +
                  std::to_string(e.num_tokens) + " tokens; only the first " + std::to_string(kept) +
                  " fit in model_max_length " + std::to_string(tokenizer.model_max_length()) +
                  " with bos and eos, the last " + std::to_string(e.num_tokens - kept) +
                  " were dropped";
    }
    const size_t length =
        no_padding ? static_cast<size_t>(std::min(e.num_tokens, kept) + 2) : e.input_ids.size();
    p.ids.assign(e.input_ids.begin(), e.input_ids.begin() + static_cast<std::ptrdiff_t>(length));
    out.push_back(std::move(p));
  }
  return out;
}

}  // namespace difftrain::diffusion
