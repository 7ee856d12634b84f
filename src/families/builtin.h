#pragma once
// Private to src/families: the built-in families (one folder each) and the helpers their
// `difftrain sample` code shares.

#include "difftrain/families/family.h"

#include <torch/types.h>

#include <memory>
#include <string>
#include <vector>

namespace difftrain::families {

/// src/families/unet/: DDPMPipeline / DDIMPipeline folders and bare UNet2DModel /
/// UNet2DConditionModel folders; the default family.
const ModelFamily& unet_family();
/// src/families/stable_diffusion/: StableDiffusionPipeline (SD 1.x/2.x) folders.
const ModelFamily& stable_diffusion_family();
/// src/families/sdxl/: StableDiffusionXLPipeline folders.
const ModelFamily& sdxl_family();
/// src/families/flux/: FluxPipeline folders and bare FluxTransformer2DModel folders.
const ModelFamily& flux_family();

/// --device: "auto" (the first CUDA device when one is visible, else the CPU), "cpu", "cuda" or
/// "cuda:N", as in Diffusers' pipe.to(device). Throws difftrain::Error for anything else or a
/// CUDA device that is not there.
torch::Device parse_sample_device(const std::string& text);

/// The prompts of a text-to-image `difftrain sample`: --prompt (repeatable) or --prompt_file
/// (io::read_prompt_file's rules), at least one; `folder_kind` ("Stable Diffusion", "FLUX.1")
/// names the folder in the error without any.
std::vector<std::string> sample_prompts(const SampleOptions& a, const std::string& folder_kind);

/// What the UNet-based families (unet, stable-diffusion, sdxl) share: the denoiser is a
/// UNet2D(Condition)Model in `dir` or `dir`/unet, so forward, lora merge (UNet and the text
/// encoders a pipeline folder has), the memory model and the LoRA names (the UNet's; each
/// family adds its text encoders) are the same.
class UNetBasedFamily : public ModelFamily {
 public:
  /// The UNet's names (adapt_unet_lora), then every other lora_components() entry as a CLIP
  /// text encoder (adapt_text_encoder_lora).
  void adapt_lora(io::LoraWeights& lora, const std::string& dir,
                  io::LoraFormat format) const override;
  models::LoraFolderMergeSummary merge_lora(
      const std::string& dir, const std::string& lora, const std::string& output_dir,
      const models::LoraFolderMergeOptions& options) const override;
  torch::Tensor forward(const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
                        const std::string& source, const std::string& lora,
                        double lora_scale) const override;
  std::vector<train::MemoryEstimate> estimate_memory(
      const std::string& model_path, const train::MemoryEstimateOptions& options,
      const std::vector<accel::ShardingStrategy>& strategies) const override;
};

/// ModelFamily::adapt_lora's parts: the UNet's kohya names resolved against `dir`'s UNet (dir/unet
/// in a pipeline folder), with SGM names for kohya output of a UNet with added conditioning; a
/// text encoder's (dir/`component`) when the LoRA has targets for it and the folder is there.
void adapt_unet_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat format);
void adapt_text_encoder_lora(io::LoraWeights& lora, const std::string& dir,
                             const std::string& component);

/// The defaults of the Diffusers script a Stable Diffusion (`sdxl` false) or SDXL run of `config`
/// follows: train_text_to_image[_lora][_sdxl].py for captioned images, train_dreambooth[_lora]
/// [_sdxl].py with --instance_prompt (full SDXL DreamBooth, which Diffusers has no script for,
/// takes train_dreambooth.py's at SDXL's resolution).
train::ScriptDefaults text_to_image_script_defaults(const train::TrainConfig& config, bool sdxl);

/// Stable Diffusion and SDXL's `difftrain sample` (StableDiffusion(XL)Pipeline semantics).
diffusion::GenerateResult sample_text_to_image(const SampleOptions& options);

}  // namespace difftrain::families

namespace difftrain::train {
// The built-in families' training tasks (src/families/<name>/).
std::unique_ptr<TrainingTask> make_unet_task(TaskOptions options);
std::unique_ptr<TrainingTask> make_text_to_image_task(TaskOptions options);
std::unique_ptr<TrainingTask> make_sdxl_task(TaskOptions options);
}  // namespace difftrain::train
