#pragma once
// Sampling chains of the unconditional fixture UNet (tests/golden/diffusers/unet2d_uncond, with
// Diffusers' DDIMPipeline and DDPMPipeline images beside it), in float32 as a user runs them and
// in float64 as the reference for float32 rounding (chain_tolerance.h). Shared by the pipeline
// unit tests and the `difftrain sample` CLI tests.

#include "difftrain/diffusion/sampler.h"
#include "difftrain/families/unet/pipeline.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"
#include "source_dir.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <functional>
#include <stdexcept>
#include <string>

namespace difftrain::test {

inline const std::string kUncondDir =
    std::string(difftrain_test::source_dir()) + "/tests/golden/diffusers/unet2d_uncond";

// DDIMPipeline / DDPMPipeline images of the uncond fixture UNet. `dtype` float64 runs the same
// chain (same generator draws) with the UNet in float64: the reference for float32 rounding
// (chain_tolerance.h). `config_edit` changes the scheduler_config.json before the sampler is
// built (a deliberate semantic error, in ChainToleranceRejectsSemanticErrors).
inline torch::Tensor uncond_images(const std::string& kind, int64_t images, int64_t steps,
                                   uint64_t seed, torch::Dtype dtype = torch::kFloat32,
                                   const std::function<void(nlohmann::json&)>& config_edit = {}) {
  auto folder = families::unet::resolve_pipeline_folder(kUncondDir);
  auto unet = models::load_unet(folder.unet_dir);
  unet->to(dtype);
  nlohmann::json config;
  std::ifstream(folder.scheduler_config) >> config;
  if (config_edit) config_edit(config);
  auto scheduler = diffusion::make_sampler(config, kind, folder.scheduler_config);
  families::unet::SampleOptions o;
  o.num_images = images;
  o.num_inference_steps = steps;
  o.seed = seed;
  return families::unet::sample_images(*unet, *scheduler, o);
}

inline torch::Tensor uncond_reference(const std::string& file) {
  return io::load_safetensors(kUncondDir + "/" + file).tensors.at("images");
}

// DDPMPipeline's chain with the UNet in float64. DDPM draws variance noise in model_output's
// dtype (Diffusers' randn_tensor(..., dtype=model_output.dtype)), and a float64 draw is another
// random stream than a float32 one; so each model output is rounded to float32 before the step,
// which then draws exactly the float32 run's noise. That rounding (~1e-7 per step) is ~20x below
// the UNet's own float32 rounding, so the result still measures the float32 run's rounding.
inline torch::Tensor uncond_ddpm_float64(int64_t images, int64_t steps, uint64_t seed) {
  auto folder = families::unet::resolve_pipeline_folder(kUncondDir);
  auto unet = models::load_unet(folder.unet_dir);
  unet->to(torch::kFloat64);
  unet->eval();
  auto scheduler = diffusion::load_sampler(folder.scheduler_config, "ddpm");
  scheduler->set_timesteps(steps);
  at::Generator gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const auto& cfg = unet->config();
  auto x = at::randn({images, cfg.in_channels, cfg.sample_size[0], cfg.sample_size[1]}, gen,
                     torch::kFloat32)
               .to(torch::kFloat64);
  torch::NoGradGuard no_grad;
  const auto timesteps = scheduler->timesteps();
  for (int64_t i = 0; i < timesteps.size(0); ++i) {
    auto eps = unet->forward(x, timesteps[i]).to(torch::kFloat32);
    x = scheduler->step(eps, scheduler->timestep(i), x, gen);
    if (x.scalar_type() != torch::kFloat64) throw std::runtime_error("DDPM step left float64");
  }
  return (x / 2 + 0.5).clamp(0, 1).permute({0, 2, 3, 1});
}

}  // namespace difftrain::test
