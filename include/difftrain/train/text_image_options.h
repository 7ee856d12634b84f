#pragma once
// The text-to-image training options (the names of Diffusers' text-to-image and DreamBooth
// scripts, and kohya's sidecar captions and clip_skip), as groups of family options
// (train/option_spec.h) that a family training on captioned images declares, and their values
// read back into a run's TaskOptions. The DDPM and flow-matching groups are
// train/ddpm_options.h and train/flow_matching_options.h.
#include "difftrain/train/option_spec.h"
#include "difftrain/train/training_task.h"

#include <map>
#include <string>
#include <vector>

namespace difftrain::train {

struct TrainConfig;

/// The captioned-image data and its text encoders: --caption_column (text),
/// --caption_extension (.txt), --instance_prompt, --with_prior_preservation, --class_data_dir,
/// --class_prompt, --prior_loss_weight (1), --num_class_images (100), --cache_latents (into the
/// trainer's --cache_dir),
/// --train_text_encoder, --text_encoder_lora_target_modules (q_proj,k_proj,v_proj,out_proj),
/// --validation_prompt, --validation_negative_prompt. caption_column, instance_prompt,
/// with_prior_preservation, class_prompt, train_text_encoder and
/// text_encoder_lora_target_modules are structural.
std::vector<OptionSpec> text_image_option_specs();

/// --clip_skip (1, kohya's numbering; structural): for a family whose prompt embeddings come
/// from a CLIP layer it may choose (not one that takes CLIP's pooled output only).
OptionSpec clip_skip_option_spec();

/// Other tools' names for the group's options, as ModelFamily::other_tools_options() gives them
/// (kohya's --reg_data_dir, --sample_prompts).
std::map<std::string, std::string> text_image_other_tools_options();

/// Whether `options` declare the text-image group (text_image_option_specs()).
bool has_text_image_options(const FamilyOptions& options);

/// The checks across options of the group and the trainer's (prior preservation needs its
/// class folder, prompt and an instance prompt; --train_text_encoder needs --lora), for a config
/// whose family declares the group (TrainConfig::validate() calls it). Throws difftrain::Error.
void check_text_image_options(const TrainConfig& config);

/// `o` with the group's values (from o.family) in its data, text, LoRA and validation parts;
/// `o` unchanged when its family declares no such group (TaskOptions made by hand).
TaskOptions with_text_image_options(TaskOptions o);

}  // namespace difftrain::train
