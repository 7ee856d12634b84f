#pragma once
// A model family built outside difftrain's tree (docs/ARCHITECTURE.md, "Adding a model family"):
// "toy-dit", a tiny text-conditioned DiT denoiser of 8x8 one-channel images made of difftrain's
// shared blocks (models::BasicTransformerBlock, models::TimestepEmbedding, models::Linear), a
// byte-level text encoder of its own, flow-matching training (diffusion::FlowMatchObjective with
// the flow-matching option group), one option of its own (--toy_samples), and a LoRA key layout of
// its own ("toy::<module>::down|up|alpha"). Its folders:
//   DIR/model_index.json  {"_class_name": "ToyDiTPipeline", "denoiser": ["toy", "ToyDiT"]}
//   DIR/config.json       ToyConfig
//   DIR/model.safetensors text_encoder.* and denoiser.* weights
#include "difftrain/families/family.h"

#include <string>

namespace toy {

/// The sizes of a toy model (config.json).
struct ToyConfig {
  int64_t size = 8;       ///< image side (pixels), one channel
  int64_t patch = 2;      ///< patch side
  int64_t width = 32;     ///< token width
  int64_t depth = 2;      ///< transformer blocks
  int64_t heads = 2;      ///< attention heads
  int64_t text_len = 16;  ///< caption bytes kept
  nlohmann::json to_json() const;
  /// Throws difftrain::Error naming `where` for a missing or impossible size.
  static ToyConfig from_json(const nlohmann::json& j, const std::string& where);
};

/// Writes a fresh toy model folder (weights from `seed`) at `dir`.
void write_initial_model(const std::string& dir, const ToyConfig& config, uint64_t seed);

/// Registers the family (families::register_family); call before difftrain's command line.
void register_toy_family();

}  // namespace toy
