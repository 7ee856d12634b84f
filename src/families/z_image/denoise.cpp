// Z-Image's denoising loop (denoise.h), as pipeline_z_image.py runs it.
#include "difftrain/families/z_image/denoise.h"

#include "difftrain/core/error.h"

#include <torch/torch.h>

namespace difftrain::families::z_image {

std::vector<double> default_sigmas(int64_t n) {
  const auto s = torch::linspace(1.0, 1.0 / static_cast<double>(n), n, torch::kFloat32);
  std::vector<double> out;
  for (int64_t i = 0; i < n; ++i) out.push_back(s[i].item<float>());
  return out;
}

torch::Tensor denoise(models::ZImageTransformer2DModelImpl& transformer,
                      diffusion::Sampler& sampler, const nlohmann::json& scheduler_config,
                      torch::Tensor latents, const std::vector<torch::Tensor>& prompt_embeds,
                      const std::vector<torch::Tensor>& negative_embeds,
                      const DenoiseOptions& options,
                      const std::function<void(int64_t, int64_t)>& on_step) {
  const int64_t B = latents.size(0);
  if (static_cast<int64_t>(prompt_embeds.size()) != B) {
    throw Error("z_image::denoise: " + std::to_string(prompt_embeds.size()) +
                " prompt embeddings for " + std::to_string(B) + " latents");
  }
  const bool cfg = options.guidance_scale > 0;
  if (cfg && static_cast<int64_t>(negative_embeds.size()) != B) {
    throw Error("z_image::denoise: guidance_scale " + std::to_string(options.guidance_scale) +
                " needs one negative prompt embedding per latent, got " +
                std::to_string(negative_embeds.size()));
  }
  // mu from (h / 2) (w / 2) latent patches; the sampler uses it only under dynamic shifting.
  const int64_t image_seq_len = (latents.size(2) / 2) * (latents.size(3) / 2);
  diffusion::TimestepOptions ts;
  ts.sigmas = default_sigmas(options.num_inference_steps);
  ts.mu = diffusion::flow_match_mu(image_seq_len, scheduler_config);
  sampler.set_timesteps_with(options.num_inference_steps, ts);
  const auto timesteps = sampler.timesteps().to(torch::kFloat32);
  const int64_t steps = timesteps.size(0);
  const auto dtype = transformer.dtype();
  latents = latents.to(torch::kFloat32);
  for (int64_t i = 0; i < steps; ++i) {
    const auto t = timesteps[i];
    const auto t_norm = (1000 - t) / 1000;  // float32, as the pipeline computes it
    const bool truncated =
        options.cfg_truncation <= 1 && t_norm.item<float>() > options.cfg_truncation;
    const bool apply_cfg = cfg && !truncated;
    std::vector<torch::Tensor> x;
    for (int64_t b = 0; b < B; ++b) x.push_back(latents[b].to(dtype).unsqueeze(1));
    std::vector<torch::Tensor> caps = prompt_embeds;
    if (apply_cfg) {
      for (int64_t b = 0; b < B; ++b) x.push_back(x[static_cast<size_t>(b)]);
      caps.insert(caps.end(), negative_embeds.begin(), negative_embeds.end());
    }
    for (auto& c : caps) c = c.to(dtype);
    const auto model_t = t_norm.to(latents.device()).expand({static_cast<int64_t>(x.size())});
    const auto out = transformer.forward(x, model_t, caps);
    std::vector<torch::Tensor> preds;
    for (int64_t b = 0; b < B; ++b) {
      auto pos = out[static_cast<size_t>(b)].to(torch::kFloat32);
      if (!apply_cfg) {
        preds.push_back(pos);
        continue;
      }
      const auto neg = out[static_cast<size_t>(B + b)].to(torch::kFloat32);
      auto pred = pos + options.guidance_scale * (pos - neg);
      if (options.cfg_normalization > 0) {
        const auto max_norm = pos.norm() * options.cfg_normalization;
        const auto norm = pred.norm();
        if (norm.item<float>() > max_norm.item<float>()) pred = pred * (max_norm / norm);
      }
      preds.push_back(pred);
    }
    const auto velocity = -torch::stack(preds).squeeze(2);
    latents = sampler.step(velocity, sampler.timestep(i), latents);
    if (on_step) on_step(i + 1, steps);
  }
  return latents;
}

}  // namespace difftrain::families::z_image
