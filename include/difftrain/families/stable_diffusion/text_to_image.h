#pragma once
// What the Stable Diffusion family lends a family built on it (SDXL): the defaults of Diffusers'
// text-to-image and DreamBooth scripts, and StableDiffusion(XL)Pipeline sampling.
#include "difftrain/families/family.h"

namespace difftrain::families::stable_diffusion {

/// The defaults of the Diffusers script a Stable Diffusion (`sdxl` false) or SDXL run of `config`
/// follows: train_text_to_image[_lora][_sdxl].py for captioned images, train_dreambooth[_lora]
/// [_sdxl].py with --instance_prompt (full SDXL DreamBooth, which Diffusers has no script for,
/// takes train_dreambooth.py's at SDXL's resolution).
train::ScriptDefaults text_to_image_script_defaults(const train::TrainConfig& config, bool sdxl);

/// `difftrain sample` for a StableDiffusion(XL)Pipeline folder.
diffusion::GenerateResult sample_text_to_image(const SampleOptions& options);

}  // namespace difftrain::families::stable_diffusion
