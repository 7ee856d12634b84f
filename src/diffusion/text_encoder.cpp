// The TextEncoder base's shared parts (text_encoder.h).
#include "difftrain/diffusion/text_encoder.h"

#include "difftrain/core/error.h"

namespace difftrain::diffusion {

Tokens TextEncoder::tokenize(const std::string& prompt) const {
  const Tokens batch = tokenize(std::vector<std::string>{prompt});
  Tokens out;
  out.input_ids = batch.input_ids[0];
  if (batch.attention_mask.defined()) out.attention_mask = batch.attention_mask[0];
  return out;
}

void TextEncoder::check_loaded() const {
  if (module() == nullptr) {
    throw Error(component() +
                " was released after its embeddings were cached; encode before releasing it");
  }
}

}  // namespace difftrain::diffusion
