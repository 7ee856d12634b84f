#pragma once
// Z-Image's denoising loop (ZImagePipeline.__call__'s steps 5 and 6): Z-Image's default sigmas
// through the flow-matching Euler sampler (mu from the latent size, used under dynamic
// shifting), the transformer called on per-sample lists with t = 1 - timestep / 1000, classifier-
// free guidance `pos + g (pos - neg)` with ZImagePipeline's renormalisation and truncation, and
// the model's x0 - noise negated into the sampler's velocity.

#include "difftrain/diffusion/sampler.h"
#include "difftrain/models/transformers/z_image_transformer.h"

#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <functional>
#include <vector>

namespace difftrain::families::z_image {

/// ZImagePipeline's call arguments that shape the loop.
struct DenoiseOptions {
  int64_t num_inference_steps = 8;
  /// `guidance_scale`: 0 (Turbo) runs no CFG; g > 0 gives pos + g (pos - neg).
  double guidance_scale = 0.0;
  /// `cfg_normalization` as a number (false: 0 = off, true: 1): a CFG prediction whose norm
  /// exceeds k · |pos| is scaled back to it, per sample.
  double cfg_normalization = 0.0;
  /// `cfg_truncation`: steps whose (1000 - t) / 1000 exceeds it run without CFG (> 1: never).
  double cfg_truncation = 1.0;
};

/// get_default_z_image_sigmas(n): torch.linspace(1, 1/n, n) in float32, as doubles.
std::vector<double> default_sigmas(int64_t n);

/// Runs the loop from `latents` (float32 [B, C, h, w], the initial noise) and returns the final
/// latents (float32). prompt_embeds / negative_embeds: B tensors [L_i, cap_feat_dim] each
/// (negative ones are needed when guidance_scale > 0). `scheduler_config` gives mu's constants.
/// `on_step(i, steps)` is called after each step (progress).
torch::Tensor denoise(models::ZImageTransformer2DModelImpl& transformer,
                      diffusion::Sampler& sampler, const nlohmann::json& scheduler_config,
                      torch::Tensor latents, const std::vector<torch::Tensor>& prompt_embeds,
                      const std::vector<torch::Tensor>& negative_embeds,
                      const DenoiseOptions& options,
                      const std::function<void(int64_t, int64_t)>& on_step = {});

}  // namespace difftrain::families::z_image
