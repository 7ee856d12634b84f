// TextEncoderStack: the text side of a pipeline (text_encoders.h).
#include "difftrain/diffusion/text_encoders.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <filesystem>

namespace difftrain::diffusion {
namespace fs = std::filesystem;

namespace {

size_t encoders_in_layout(TextEncoderStack::Layout layout) {
  return layout == TextEncoderStack::Layout::kClip ? 1 : 2;
}

}  // namespace

std::string to_string(TextEncoderStack::Layout layout) {
  switch (layout) {
    case TextEncoderStack::Layout::kClip: return "clip";
    case TextEncoderStack::Layout::kDualClip: return "dual-clip";
    case TextEncoderStack::Layout::kClipT5: break;
  }
  return "clip-t5";
}

torch::nn::Module* TextEncoderStack::Encoder::module() const {
  if (t5) return t5.ptr().get();
  return model ? static_cast<torch::nn::Module*>(model.ptr().get()) : nullptr;
}

TextEncoderStack::TextEncoderStack(Layout layout, std::vector<Encoder> encoders)
    : layout_(layout), encoders_(std::move(encoders)) {
  if (encoders_.size() != encoders_in_layout(layout_)) {
    throw Error("a " + to_string(layout_) + " text-encoder stack takes " +
                std::to_string(encoders_in_layout(layout_)) + " encoder(s), got " +
                std::to_string(encoders_.size()));
  }
  for (size_t i = 0; i < encoders_.size(); ++i) {
    auto& e = encoders_[i];
    if (layout_ == Layout::kClipT5 && i == 1) {
      if (e.t5.is_empty() || !e.t5_tokenizer) {
        throw Error("text-encoder stack: " + e.component + " (T5) is not loaded");
      }
      continue;
    }
    if (e.model.is_empty()) throw Error("text-encoder stack: " + e.component + " is not loaded");
    const int64_t positions = e.model->config().max_position_embeddings;
    if (e.tokenizer.model_max_length() > positions) e.tokenizer.set_model_max_length(positions);
  }
  if (layout_ == Layout::kDualClip && !encoders_[1].model->has_projection()) {
    throw Error(encoders_[1].component +
                " has no text_projection; SDXL's second encoder is a "
                "CLIPTextModelWithProjection");
  }
}

TextEncoderStack TextEncoderStack::load(Layout layout, const std::vector<Files>& files,
                                        const std::string& variant, torch::Dtype dtype) {
  std::vector<Encoder> encoders;
  for (size_t i = 0; i < files.size(); ++i) {
    const auto& f = files[i];
    Encoder e;
    e.component = f.component;
    e.tokenizer_component = f.tokenizer_component;
    e.model_dir = f.model_dir;
    e.tokenizer_dir = f.tokenizer_dir;
    if (layout == Layout::kClipT5 && i == 1) {
      e.t5_tokenizer =
          std::make_shared<models::T5Tokenizer>(models::T5Tokenizer::load(f.tokenizer_dir));
      e.t5 = models::load_t5_encoder(f.model_dir, dtype, variant);
      encoders.push_back(std::move(e));
      continue;
    }
    e.tokenizer = models::ClipTokenizer::from_folder(f.tokenizer_dir);
    const bool projection = layout == Layout::kDualClip && i == 1;
    e.model = models::load_clip_text_model(f.model_dir, variant, projection);
    if (dtype != torch::kFloat32) e.model->to(dtype);
    encoders.push_back(std::move(e));
  }
  return TextEncoderStack(layout, std::move(encoders));
}

std::vector<torch::nn::Module*> TextEncoderStack::modules() const {
  std::vector<torch::nn::Module*> out;
  for (const auto& e : encoders_) {
    if (e.module() != nullptr) out.push_back(e.module());
  }
  return out;
}

TextEncoderStack TextEncoderStack::tokenizers_only() const {
  TextEncoderStack out = *this;
  for (auto& e : out.encoders_) {
    e.model = models::ClipTextModel(nullptr);
    e.t5 = models::T5EncoderModel(nullptr);
  }
  return out;
}

bool TextEncoderStack::has_models() const {
  for (const auto& e : encoders_) {
    if (e.module() == nullptr) return false;
  }
  return !encoders_.empty();
}

std::vector<std::string> TextEncoderStack::components() const {
  std::vector<std::string> out;
  for (const auto& e : encoders_) out.insert(out.end(), {e.component, e.tokenizer_component});
  return out;
}

int64_t TextEncoderStack::embed_dim() const {
  if (empty()) return 0;
  if (layout_ == Layout::kClip) return encoders_[0].model->config().hidden_size;
  if (layout_ == Layout::kClipT5) return encoders_[1].t5->options().d_model();
  int64_t d = 0;
  for (const auto& e : encoders_) d += e.model->config().hidden_size;
  return d;
}

int64_t TextEncoderStack::pooled_dim() const {
  if (empty()) return 0;
  if (layout_ == Layout::kClipT5) return encoders_[0].model->config().hidden_size;
  return layout_ == Layout::kDualClip ? encoders_[1].model->config().projection_dim : 0;
}

void TextEncoderStack::set_max_sequence_length(int64_t n) {
  if (n < 1) {
    throw Error("max_sequence_length is " + std::to_string(n) + "; it must be at least 1");
  }
  max_sequence_length_ = n;
}

int64_t TextEncoderStack::max_clip_skip() const {
  if (layout_ == Layout::kClipT5) return 0;
  int64_t layers = 0;
  for (const auto& e : encoders_) {
    const int64_t n = e.model->config().num_hidden_layers;
    layers = layers == 0 ? n : std::min(layers, n);
  }
  // kClip reads layer (layers - skip)'s output; kDualClip hidden_states[-(skip + 2)], down to the
  // embedding layer's output (skip = layers - 1).
  return std::max<int64_t>(layers - 1, 0);
}

int64_t TextEncoderStack::clip_skip_from_kohya(int64_t n) const {
  const int64_t most = max_clip_skip() + 1;
  if (n < 1) {
    throw Error("--clip_skip " + std::to_string(n) +
                " counts layers from the last: 1 is the last layer, 2 the penultimate");
  }
  if (layout_ == Layout::kDualClip && n >= most) {
    // The prompt embedding is already the penultimate layer's output: one layer fewer can be
    // skipped than for one CLIP (kohya's sdxl_train refuses the same).
    throw Error("--clip_skip " + std::to_string(n) +
                " is too large for SDXL, whose prompt embedding is already the penultimate "
                "layer: at most " +
                std::to_string(most - 1) + " for these text encoders");
  }
  if (n > most) {
    throw Error("--clip_skip " + std::to_string(n) + " is more than the text encoder's " +
                std::to_string(most) + " layers");
  }
  return n - 1;
}

std::string TextEncoderStack::ids_key(size_t i) {
  return i == 0 ? "input_ids" : "input_ids_" + std::to_string(i + 1);
}

namespace {
std::string prompt_excerpt(const std::string& prompt);
}  // namespace

std::vector<std::string> TextEncoderStack::truncation_report(
    const std::vector<std::string>& prompts, const std::string& what) const {
  std::vector<std::string> lines;
  for (const auto& e : encoders_) {
    int64_t cut_prompts = 0, most = 0, first = -1;
    int64_t kept = 0;
    for (size_t i = 0; i < prompts.size(); ++i) {
      int64_t cut = 0;
      if (e.t5_tokenizer) {
        kept = max_sequence_length_ - 1;  // </s> takes the last place
        cut = static_cast<int64_t>(e.t5_tokenizer->piece_ids(prompts[i]).size()) - kept;
      } else {
        kept = e.tokenizer.model_max_length() - 2;  // bos and eos
        cut = e.tokenizer.encode(prompts[i]).num_tokens - kept;
      }
      if (cut <= 0) continue;
      ++cut_prompts;
      if (first < 0) first = static_cast<int64_t>(i);
      most = std::max(most, cut);
    }
    if (cut_prompts == 0) continue;
    lines.push_back(fmt::format(
        "{} of {} {}(s) are longer than {}'s {} tokens ({}): up to {} token(s) cut from one, "
        "the first {} {}; they are encoded truncated, as Diffusers does",
        cut_prompts, prompts.size(), what, e.component, kept,
        e.t5_tokenizer
            ? "--max_sequence_length " + std::to_string(max_sequence_length_) + " with </s>"
            : "model_max_length " + std::to_string(e.tokenizer.model_max_length()) +
                  " with bos and eos",
        most, what, prompt_excerpt(prompts[static_cast<size_t>(first)])));
  }
  return lines;
}

std::map<std::string, torch::Tensor> TextEncoderStack::tokenize(const std::string& caption) const {
  std::map<std::string, torch::Tensor> out;
  for (size_t i = 0; i < encoders_.size(); ++i) {
    const auto& e = encoders_[i];
    out[ids_key(i)] =
        e.t5_tokenizer
            ? torch::tensor(e.t5_tokenizer->encode(caption, max_sequence_length_), torch::kInt64)
            : torch::tensor(e.tokenizer.encode(caption).input_ids, torch::kInt64);
  }
  return out;
}

std::vector<torch::Tensor> TextEncoderStack::tokenize(
    const std::vector<std::string>& prompts) const {
  std::vector<torch::Tensor> out;
  for (const auto& e : encoders_) {
    out.push_back(e.t5_tokenizer ? (*e.t5_tokenizer)(prompts, max_sequence_length_)
                                 : e.tokenizer.encode_batch(prompts));
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
  auto ids = tokenize(prompts);
  if (!prompts_2.empty()) {
    if (layout_ != Layout::kClipT5) {
      throw Error("a second prompt is for FLUX.1's T5 encoder; this pipeline's text encoders are " +
                  to_string(layout_));
    }
    if (prompts_2.size() != prompts.size()) {
      throw Error("got " + std::to_string(prompts_2.size()) + " second prompts for " +
                  std::to_string(prompts.size()) + " prompts; give one per prompt");
    }
    ids[1] = (*encoders_[1].t5_tokenizer)(prompts_2, max_sequence_length_);
  }
  return encode_ids(ids, clip_skip);
}

PromptEmbeds TextEncoderStack::encode_ids(const std::vector<torch::Tensor>& ids,
                                          int64_t clip_skip) const {
  if (empty()) throw Error("the pipeline has no text encoder to encode prompts with");
  if (!has_models()) {
    throw Error(
        "the text encoders were released after their embeddings were cached; encode "
        "before releasing them");
  }
  if (ids.size() != encoders_.size()) {
    throw Error("text-encoder stack: got token ids for " + std::to_string(ids.size()) +
                " encoder(s), the stack has " + std::to_string(encoders_.size()));
  }
  if (clip_skip < 0 || clip_skip > max_clip_skip()) {
    throw Error("clip_skip " + std::to_string(clip_skip) + " needs more than the text encoder's " +
                std::to_string(max_clip_skip() + 1) + " layers");
  }
  const torch::Device device = models::module_device(*encoders_[0].model);
  PromptEmbeds out;
  if (layout_ == Layout::kClipT5) {
    // FluxPipeline.encode_prompt: CLIP's pooler_output and T5's last_hidden_state, no masks.
    out.pooled = encoders_[0].model.ptr()->forward(ids[0].to(device)).pooler_output;
    auto& t5 = *encoders_[1].t5.ptr();
    out.embeds = t5.forward(ids[1].to(models::module_device(t5))).to(device);
    return out;
  }
  if (layout_ == Layout::kClip) {
    // Encoding changes no state: the holders' shared pointers give the non-const forward().
    out.embeds = encoders_[0].model.ptr()->forward(ids[0].to(device), clip_skip).last_hidden_state;
    return out;
  }
  // StableDiffusionXLPipeline.encode_prompt: hidden_states[-(clip_skip + 2)] of each encoder,
  // before final_layer_norm; the pooled embedding is the last encoder's text_embeds.
  std::vector<torch::Tensor> parts;
  for (size_t i = 0; i < encoders_.size(); ++i) {
    auto& model = *encoders_[i].model.ptr();
    auto r =
        model.forward(ids[i].to(models::module_device(model)), 0, /*output_hidden_states=*/true);
    const auto& states = r.hidden_states;
    parts.push_back(states[states.size() - static_cast<size_t>(clip_skip) - 2].to(device));
    if (i + 1 == encoders_.size()) out.pooled = r.text_embeds.to(device);
  }
  out.embeds = torch::cat(parts, -1);
  return out;
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
                "' does not exist: give a Stable Diffusion pipeline folder (with tokenizer/) or a "
                "tokenizer folder (with vocab.json)");
  }
  if (fs::exists(fs::path(dir) / "vocab.json")) return dir;
  const auto sub = (fs::path(dir) / "tokenizer").string();
  if (fs::is_directory(sub)) return sub;
  throw Error("--model '" + dir +
              "' has neither vocab.json nor a tokenizer/ folder: give a Stable Diffusion "
              "pipeline folder or a CLIP tokenizer folder");
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
                                              int64_t max_length, bool no_padding) {
  std::vector<TokenizedPrompt> out;
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
