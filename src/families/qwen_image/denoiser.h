#pragma once
// Qwen-Image's transformer as a diffusion::Denoiser (training): latents [B, C, h, w] packed into
// 2x2 patches, img_shapes [(1, h/2, w/2)] per sample, the timestep t / 1000 (the sigma itself, 1
// for noise), the caption embeddings and their mask; the prediction (the velocity noise - x0)
// unpacked, as train_dreambooth_lora_qwen_image.py calls it.

#include "difftrain/diffusion/denoiser.h"
#include "difftrain/models/transformers/qwen_image_transformer.h"

namespace difftrain::families::qwen_image {

class QwenImageDenoiser : public diffusion::Denoiser {
 public:
  explicit QwenImageDenoiser(models::QwenImageTransformer2DModel transformer)
      : transformer_(std::move(transformer)) {}

  /// x: [B, C, h, w] (h, w even); t: [B] in [0, 1000]; cond: "encoder_hidden_states" [B, L, D]
  /// and optionally "encoder_attention_mask" [B, L] (1 = a real token). Throws difftrain::Error
  /// for an unknown or missing name, or shapes that do not fit.
  torch::Tensor denoise(const torch::Tensor& x, const torch::Tensor& t,
                        const diffusion::Conditioning& cond) override;

 private:
  models::QwenImageTransformer2DModel transformer_;
};

}  // namespace difftrain::families::qwen_image
