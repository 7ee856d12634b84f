#pragma once
// Z-Image's transformer as a diffusion::Denoiser, the way train_dreambooth_lora_z_image.py calls
// it: each noisy latent [C, H, W] becomes a one-frame [C, 1, H, W] list entry, each caption's
// embeddings are cut to its real tokens, the timestep is (1000 - t) / 1000 (1 = clean), and the
// model's output (x0 - noise) is negated into the flow target's direction (noise - x0).

#include "difftrain/diffusion/denoiser.h"
#include "difftrain/models/transformers/z_image_transformer.h"

namespace difftrain::families::z_image {

class ZImageDenoiser : public diffusion::Denoiser {
 public:
  explicit ZImageDenoiser(models::ZImageTransformer2DModel transformer)
      : transformer_(std::move(transformer)) {}

  /// x: [B, C, H, W] latents (or clips [B, C, F, H, W]); t: [B] timesteps in [0, 1000]; cond:
  /// "encoder_hidden_states" [B, L, D] (Qwen3's hidden_states[-2]) and optionally
  /// "encoder_attention_mask" [B, L] (1 = a real token; default: every token). Returns the
  /// prediction in x's shape. Throws difftrain::Error for an unknown or missing name.
  torch::Tensor denoise(const torch::Tensor& x, const torch::Tensor& t,
                        const diffusion::Conditioning& cond) override;

  const models::ZImageTransformer2DModel& transformer() const { return transformer_; }

 private:
  models::ZImageTransformer2DModel transformer_;
};

}  // namespace difftrain::families::z_image
