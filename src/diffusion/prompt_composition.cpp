// The built-in PromptCompositions (prompt_composition.h).
#include "difftrain/diffusion/prompt_composition.h"

#include "difftrain/core/error.h"
#include "difftrain/models/module_info.h"

#include <torch/torch.h>

#include <algorithm>

namespace difftrain::diffusion {
namespace {

torch::Device first_device(const TextEncoders& encoders) {
  return models::module_device(*encoders.at(0)->module());
}

int64_t fewest_layers(const TextEncoders& encoders) {
  int64_t layers = 0;
  for (const auto& e : encoders) {
    const int64_t n = e->num_layers();
    layers = layers == 0 ? n : std::min(layers, n);
  }
  return layers;
}

class LastHiddenState final : public PromptComposition {
 public:
  std::string name() const override { return "last hidden state"; }
  void check(const TextEncoders& encoders) const override {
    if (encoders.size() != 1) {
      throw Error("the " + name() + " composition takes 1 text encoder, got " +
                  std::to_string(encoders.size()));
    }
  }
  int64_t embed_dim(const TextEncoders& encoders) const override {
    return encoders.at(0)->hidden_size();
  }
  int64_t max_clip_skip(const TextEncoders& encoders) const override {
    // Layer (layers - skip)'s output, down to the first layer's.
    return std::max<int64_t>(fewest_layers(encoders) - 1, 0);
  }
  PromptEmbeds compose(const TextEncoders& encoders, const std::vector<Tokens>& tokens,
                       int64_t clip_skip) const override {
    PromptEmbeds out;
    out.embeds = encoders[0]->encode(tokens[0], {clip_skip, false}).last_hidden_state;
    return out;
  }
};

class ConcatenatedHiddenStates final : public PromptComposition {
 public:
  explicit ConcatenatedHiddenStates(std::string pipeline) : pipeline_(std::move(pipeline)) {}
  std::string name() const override { return "concatenated hidden states"; }
  void check(const TextEncoders& encoders) const override {
    if (encoders.size() < 2) {
      throw Error("the " + name() + " composition takes 2 or more text encoders, got " +
                  std::to_string(encoders.size()));
    }
    const auto& last = *encoders.back();
    if (last.pooled_size() == 0 || last.class_name() != "CLIPTextModelWithProjection") {
      throw Error(last.component() + " is a " + last.class_name() + " without text_projection; " +
                  (pipeline_.empty() ? std::string("the") : pipeline_ + "'s") +
                  " last text encoder is a CLIPTextModelWithProjection (its pooled output is the "
                  "projected text_embeds)");
    }
  }
  int64_t embed_dim(const TextEncoders& encoders) const override {
    int64_t d = 0;
    for (const auto& e : encoders) d += e->hidden_size();
    return d;
  }
  int64_t pooled_dim(const TextEncoders& encoders) const override {
    return encoders.back()->pooled_size();
  }
  int64_t max_clip_skip(const TextEncoders& encoders) const override {
    // hidden_states[-(skip + 2)], down to the embedding layer's output.
    return std::max<int64_t>(fewest_layers(encoders) - 1, 0);
  }
  int64_t clip_skip_from_kohya(const TextEncoders& encoders, int64_t n) const override {
    const int64_t most = max_clip_skip(encoders) + 1;
    if (n >= 1 && n >= most) {
      // The prompt embedding is the penultimate layer's output already: one layer fewer can be
      // skipped than for one encoder (kohya's sdxl_train refuses the same).
      throw Error("--clip_skip " + std::to_string(n) + " is too large" +
                  (pipeline_.empty() ? std::string() : " for " + pipeline_) +
                  ", whose prompt embedding is already the penultimate layer: at most " +
                  std::to_string(most - 1) + " for these text encoders");
    }
    return PromptComposition::clip_skip_from_kohya(encoders, n);
  }
  PromptEmbeds compose(const TextEncoders& encoders, const std::vector<Tokens>& tokens,
                       int64_t clip_skip) const override {
    const torch::Device device = first_device(encoders);
    PromptEmbeds out;
    std::vector<torch::Tensor> parts;
    for (size_t i = 0; i < encoders.size(); ++i) {
      const auto r = encoders[i]->encode(tokens[i], {0, /*hidden_states=*/true});
      const auto& states = r.hidden_states;
      parts.push_back(states[states.size() - static_cast<size_t>(clip_skip) - 2].to(device));
      if (i + 1 == encoders.size()) out.pooled = r.pooled.to(device);
    }
    out.embeds = torch::cat(parts, -1);
    return out;
  }

 private:
  std::string pipeline_;
};

class PooledAndSequence final : public PromptComposition {
 public:
  PooledAndSequence(size_t pooled_from, size_t sequence_from)
      : pooled_from_(pooled_from), sequence_from_(sequence_from) {}
  std::string name() const override { return "pooled and sequence"; }
  void check(const TextEncoders& encoders) const override {
    const size_t needed = std::max(pooled_from_, sequence_from_) + 1;
    if (encoders.size() != needed) {
      throw Error("the " + name() + " composition takes " + std::to_string(needed) +
                  " text encoders, got " + std::to_string(encoders.size()));
    }
    if (encoders[pooled_from_]->pooled_size() == 0) {
      throw Error(encoders[pooled_from_]->component() + " (" +
                  encoders[pooled_from_]->class_name() +
                  ") has no pooled output to give the pooled prompt embedding");
    }
  }
  int64_t embed_dim(const TextEncoders& encoders) const override {
    return encoders.at(sequence_from_)->hidden_size();
  }
  int64_t pooled_dim(const TextEncoders& encoders) const override {
    return encoders.at(pooled_from_)->pooled_size();
  }
  PromptEmbeds compose(const TextEncoders& encoders, const std::vector<Tokens>& tokens,
                       int64_t /*clip_skip*/) const override {
    const torch::Device device = first_device(encoders);
    PromptEmbeds out;
    out.pooled = encoders[pooled_from_]->encode(tokens[pooled_from_], {}).pooled.to(device);
    out.embeds =
        encoders[sequence_from_]->encode(tokens[sequence_from_], {}).last_hidden_state.to(device);
    return out;
  }

 private:
  size_t pooled_from_, sequence_from_;
};

}  // namespace

int64_t PromptComposition::clip_skip_from_kohya(const TextEncoders& encoders, int64_t n) const {
  const int64_t most = max_clip_skip(encoders) + 1;
  if (n < 1) {
    throw Error("--clip_skip " + std::to_string(n) +
                " counts layers from the last: 1 is the last layer, 2 the penultimate");
  }
  if (n > most) {
    throw Error("--clip_skip " + std::to_string(n) + " is more than the text encoder's " +
                std::to_string(most) + " layers");
  }
  return n - 1;
}

std::shared_ptr<const PromptComposition> last_hidden_state() {
  return std::make_shared<LastHiddenState>();
}

std::shared_ptr<const PromptComposition> concatenated_hidden_states(std::string pipeline) {
  return std::make_shared<ConcatenatedHiddenStates>(std::move(pipeline));
}

std::shared_ptr<const PromptComposition> pooled_and_sequence(size_t pooled_from,
                                                             size_t sequence_from) {
  return std::make_shared<PooledAndSequence>(pooled_from, sequence_from);
}

}  // namespace difftrain::diffusion
