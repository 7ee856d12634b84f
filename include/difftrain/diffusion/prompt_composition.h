#pragma once
// How a pipeline's text encoders make its prompt embeddings (the body of Diffusers'
// encode_prompt): a PromptComposition over the TextEncoders a family composes. Three generic
// ones are built in, named after what they do, not after a pipeline:
// - last_hidden_state(): one encoder's last_hidden_state after skipping clip_skip layers
//   (StableDiffusionPipeline);
// - concatenated_hidden_states(): every encoder's hidden_states[-(clip_skip + 2)] side by side,
//   the last encoder's pooled output (StableDiffusionXLPipeline);
// - pooled_and_sequence(): one encoder's pooled output and another's last_hidden_state
//   (FluxPipeline: CLIP pooled, T5 per token).
// A family that needs another rule (a decoder LLM's hidden_states[-2] of the unpadded tokens)
// writes its own subclass.

#include "difftrain/diffusion/text_encoder.h"

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::diffusion {

/// Prompt embeddings: per token [N, L, D] and, for compositions that have one, pooled [N, P];
/// the per-token mask [N, L] when the composition keeps one (1 = a real token).
struct PromptEmbeds {
  torch::Tensor embeds;
  torch::Tensor pooled;
  torch::Tensor attention_mask;
};

using TextEncoders = std::vector<std::shared_ptr<TextEncoder>>;

class PromptComposition {
 public:
  virtual ~PromptComposition() = default;
  /// What it does, for logs ("last hidden state", ...).
  virtual std::string name() const = 0;
  /// Throws difftrain::Error when `encoders` do not fit (their number, a missing pooled output).
  virtual void check(const TextEncoders& encoders) const = 0;
  /// The width D of the per-token embeddings.
  virtual int64_t embed_dim(const TextEncoders& encoders) const = 0;
  /// The width P of the pooled embedding; 0 when there is none.
  virtual int64_t pooled_dim(const TextEncoders& /*encoders*/) const { return 0; }
  /// The largest Diffusers clip_skip it takes; 0 when clip_skip does not apply.
  virtual int64_t max_clip_skip(const TextEncoders& /*encoders*/) const { return 0; }
  /// Diffusers' clip_skip from kohya's `--clip_skip` N (1 = the last layer): N - 1. Throws
  /// difftrain::Error for N < 1 or beyond what the encoders have, naming the bound.
  virtual int64_t clip_skip_from_kohya(const TextEncoders& encoders, int64_t n) const;
  /// The prompt embeddings from each encoder's tokens (encoders.size() entries, checked by the
  /// caller), on the first encoder's device. clip_skip is within [0, max_clip_skip()].
  virtual PromptEmbeds compose(const TextEncoders& encoders, const std::vector<Tokens>& tokens,
                               int64_t clip_skip) const = 0;
};

/// One encoder; embeds = its last_hidden_state with `clip_skip` layers skipped (through the
/// final norm); no pooled embedding.
std::shared_ptr<const PromptComposition> last_hidden_state();

/// Two or more encoders; embeds = cat(hidden_states[-(clip_skip + 2)] of each, -1) (before the
/// final norm), pooled = the last encoder's pooled output, which it must have. `pipeline` names
/// the pipeline in messages ("" for none): kohya's clip_skip refused as "too large for <pipeline>".
std::shared_ptr<const PromptComposition> concatenated_hidden_states(std::string pipeline = "");

/// pooled = encoder `pooled_from`'s pooled output, embeds = encoder `sequence_from`'s
/// last_hidden_state (no mask); clip_skip does not apply.
std::shared_ptr<const PromptComposition> pooled_and_sequence(size_t pooled_from = 0,
                                                             size_t sequence_from = 1);

}  // namespace difftrain::diffusion
