#pragma once
// What the Stable Diffusion family lends a family built on it (SDXL): its training options, the
// defaults of Diffusers' text-to-image and DreamBooth scripts, and `difftrain sample` with the
// pipeline's semantics.
#include "difftrain/families/family.h"

namespace difftrain::families::stable_diffusion {

/// The options of a Stable Diffusion run: the DDPM objective's (train/ddpm_options.h), the
/// text-to-image group and --clip_skip (train/text_image_options.h).
std::vector<train::OptionSpec> text_to_image_option_specs();

/// Other tools' names for those options and the UNet's learning rate
/// (ModelFamily::other_tools_options()).
std::map<std::string, std::string> text_to_image_other_tools_options();

/// Whether `config` trains DreamBooth (its family's --instance_prompt is given).
bool dreambooth(const train::TrainConfig& config);

/// The defaults of the Diffusers script a Stable Diffusion run of `config` follows:
/// train_text_to_image[_lora].py for captioned images, train_dreambooth[_lora].py with
/// --instance_prompt (a family built on it changes what its own scripts change).
train::ScriptDefaults text_to_image_script_defaults(const train::TrainConfig& config);

/// `difftrain sample` for a StableDiffusionPipeline folder or an extension's
/// (stable_diffusion/pipeline.h).
diffusion::GenerateResult sample_text_to_image(const SampleOptions& options);

}  // namespace difftrain::families::stable_diffusion
