#pragma once
// The network a diffusion objective trains, behind one call: denoise(x, t, conditioning), with the
// conditioning as named tensors. A UNet stands here through UNetDenoiser
// (families/unet/denoiser.h); a transformer (FLUX's, with its packed latents, text sequence, pooled
// projection and position ids) is another implementation, so the training objective and the task
// code that calls it do not change.

#include <torch/types.h>

#include <map>
#include <string>

namespace difftrain::diffusion {

/// What a denoiser is conditioned on besides x and t, by Diffusers' argument names:
/// "encoder_hidden_states" [B, S, D], "class_labels" [B], "timestep_cond", "text_embeds" [B, D],
/// "time_ids" [B, K] (SDXL's added_cond_kwargs), and later "pooled_projections", "txt_ids",
/// "img_ids", "guidance" (FLUX).
using Conditioning = std::map<std::string, torch::Tensor>;

/// A model that predicts from a noisy input.
class Denoiser {
 public:
  virtual ~Denoiser() = default;
  /// x: [B, ...] noisy input; t: [B] the objective's timesteps; -> [B, ...] the prediction (noise,
  /// velocity, x0 or flow, by the objective), x's shape. Throws difftrain::Error for a
  /// conditioning name the model does not take.
  virtual torch::Tensor denoise(const torch::Tensor& x, const torch::Tensor& t,
                                const Conditioning& cond) = 0;
};

}  // namespace difftrain::diffusion
