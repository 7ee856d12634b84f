#pragma once
// Unconditional and class-conditional image sampling, as Diffusers' DDPMPipeline / DDIMPipeline
// run on the CPU: the same initial noise and later draws from a seeded CPU generator, so the same
// seed gives the same images. Also finds the parts of a pipeline folder.

#include "difftrain/diffusion/generate.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/models/unets/unet.h"

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::families::unet {

/// Where a model folder keeps its parts.
struct PipelineFolder {
  std::string unet_dir;          ///< holds config.json + diffusion_pytorch_model.safetensors
  std::string scheduler_config;  ///< a scheduler_config.json
  std::string pipeline_class;    ///< model_index.json's _class_name ("" without one)
};

/// Resolves `dir`: a pipeline folder (model_index.json + unet/ + scheduler/, as
/// DDPMPipeline.save_pretrained writes) or a UNet folder with scheduler_config.json beside
/// config.json. Anything else throws difftrain::Error naming what is missing.
PipelineFolder resolve_pipeline_folder(const std::string& dir);

/// Loads the UNet in `unet_dir` (float32, CPU) and, when `lora_path` is non-empty, merges that
/// LoRA file (Diffusers, PEFT or kohya format) into it with `lora_scale` (Diffusers:
/// `load_lora_weights` + `fuse_lora(lora_scale)`). Logs what was merged; warns about targets
/// for other components (text encoders).
models::UNet load_unet_with_lora(const std::string& unet_dir, const std::string& lora_path = "",
                                 double lora_scale = 1.0);

/// The UNet folder of `dir`: dir/unet when `dir` is a pipeline folder (has model_index.json),
/// else `dir` itself.
std::string resolve_unet_dir(const std::string& dir);

/// One UNet forward on named tensors, as `difftrain forward` runs it to compare a checkpoint
/// with Diffusers: "sample" [B, C, H, W] (floating point, run in float32) and "timestep" ([] or
/// [B]) are required; "class_labels" [B], "encoder_hidden_states" [B, S, D] and
/// "timestep_cond", and SDXL's "text_embeds" [B, D] and "time_ids" [B, 6] are passed when present;
/// "out" is ignored silently and any other name with a warning. `source` names the tensors' file in
/// messages. Eval mode, no grad. Returns the UNet's output [B, C_out, H, W].
torch::Tensor forward_from_tensors(models::UNetImpl& unet,
                                   const std::map<std::string, torch::Tensor>& inputs,
                                   const std::string& source);

/// Settings of one sampling run (DDPMPipeline / DDIMPipeline `__call__` arguments).
struct SampleOptions {
  int64_t num_images = 1;  ///< batch_size
  /// Denoising steps; 0 = the pipeline's default (DDPM 1000, every other sampler 50). DDIM's eta
  /// is a sampler setting (SamplerOptions::eta).
  int64_t num_inference_steps = 0;
  /// One class id per image for class-conditional UNets (num_class_embeds); empty otherwise.
  std::vector<int64_t> class_labels;
  /// > 1: classifier-free guidance against the null class (the last class id,
  /// num_class_embeds - 1, which difftrain's trainer reserves for label dropout).
  double guidance_scale = 1.0;
  uint64_t seed = 0;
  /// Side of the square image; 0 = the UNet's sample_size.
  int64_t height = 0, width = 0;
  /// Called after each step with (step index from 1, number of steps).
  std::function<void(int64_t, int64_t)> on_step;
};

/// Runs the reverse process with any sampler: noise x_T = randn([K, C, H, W], generator(seed)) *
/// init_noise_sigma, then for each of the sampler's timesteps x = sampler.step(unet(
/// sampler.scale_model_input(x, t), t), t, x, generator) (DDPMPipeline's loop, which is this with
/// DDPM or DDIM, whose init_noise_sigma is 1 and scale_model_input the identity).
/// Returns images [K, H, W, C] float32 in [0, 1] = (x / 2 + 0.5).clamp(0, 1), Diffusers'
/// output_type="np". The UNet runs in eval mode under no-grad.
torch::Tensor sample_images(models::UNetImpl& unet, diffusion::Sampler& scheduler,
                            const SampleOptions& options);

/// An unconditional or class-conditional UNet pipeline (Diffusers' DDPMPipeline /
/// DDIMPipeline): the UNet and the sampler it runs with. generate() runs sample_images().
class UNetPipeline : public diffusion::Pipeline {
 public:
  UNetPipeline() = default;
  UNetPipeline(models::UNet unet, std::unique_ptr<diffusion::Sampler> sampler,
               PipelineFolder folder = {});

  PipelineFolder folder;  ///< where it came from (empty when assembled in memory, e.g. training)
  models::UNet unet{nullptr};
  std::unique_ptr<diffusion::Sampler> sampler;

  /// The folder's pipeline class, else "DDIMPipeline" with a DDIM sampler and "DDPMPipeline"
  /// with any other.
  std::string class_name() const override;
  void to(const torch::Device& device, std::optional<torch::Dtype> dtype = std::nullopt) override;
  /// Defaults: one image per class label (or 1), 1000 steps with DDPM and 50 with every other
  /// sampler, guidance 1 (none).
  diffusion::GenerateRequest resolve(diffusion::GenerateRequest request) const override;
  diffusion::GenerateResult generate(const diffusion::GenerateRequest& request) override;
};

/// The sampler of the pipeline folder `folder` with `difftrain sample`'s defaults: `scheduler`
/// (a name of sampler_names() or a Diffusers class) or, when empty, the folder's scheduler
/// class, except that a DDIMPipeline folder runs "ddim" (DDIMPipeline turns whatever scheduler it
/// is given into a DDIMScheduler); `eta` is DDIM's (the other samplers ignore it).
std::unique_ptr<diffusion::Sampler> load_pipeline_sampler(const PipelineFolder& folder,
                                                          const std::string& scheduler = "",
                                                          double eta = 0.0);

/// Loads the UNet pipeline folder `dir` (resolve_pipeline_folder): its UNet with options.lora
/// merged, and load_pipeline_sampler(folder, options.scheduler, options.eta). variant and vae do
/// not apply (a warning says so when given).
UNetPipeline load_unet_pipeline(const std::string& dir,
                                const diffusion::PipelineLoadOptions& options = {});

}  // namespace difftrain::families::unet
