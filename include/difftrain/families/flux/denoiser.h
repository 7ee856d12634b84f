#pragma once
// FLUX.1's transformer as a diffusion::Denoiser, the way train_dreambooth_lora_flux.py calls it:
// the noisy latents [B, C, H, W] are packed 2×2 into H/2·W/2 tokens with (0, row, col) ids, the
// text tokens get zero ids, the timestep is t / 1000, dev models get the embedded guidance, and
// the prediction is unpacked back to [B, C, H, W] for the loss.

#include "difftrain/diffusion/denoiser.h"
#include "difftrain/models/transformers/flux_transformer.h"

namespace difftrain::families::flux {

class FluxDenoiser : public diffusion::Denoiser {
 public:
  explicit FluxDenoiser(models::FluxTransformer2DModel transformer)
      : transformer_(std::move(transformer)) {}

  /// x: [B, C, H, W] latents (H, W even); t: [B] timesteps in [0, 1000]; cond:
  /// "encoder_hidden_states" [B, S, D] (T5), "pooled_projections" [B, P] (CLIP), "guidance"
  /// [B] (the raw scale, e.g. 3.5; required by guidance-distilled dev models, refused by
  /// schnell), and optionally "txt_ids" [S, 3] (default zeros) and "img_ids" (default the
  /// latent grid's). Returns the flow prediction [B, C, H, W]. Throws difftrain::Error for an
  /// unknown name or a missing required one.
  torch::Tensor denoise(const torch::Tensor& x, const torch::Tensor& t,
                        const diffusion::Conditioning& cond) override;

  const models::FluxTransformer2DModel& transformer() const { return transformer_; }

 private:
  models::FluxTransformer2DModel transformer_;
};

}  // namespace difftrain::families::flux
