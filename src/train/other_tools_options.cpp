// Other tools' option names for `difftrain train` (other_tools_options.h).
#include "other_tools_options.h"

namespace difftrain::train {

// Other tools' names for what difftrain's trainer has (kohya sd-scripts, SimpleTuner): difftrain's
// option (and how to use it), or, after a '!', what to do instead where difftrain has none. Flags
// for what a family has are the family's (ModelFamily::other_tools_options()), and those for an
// option group's are the group's (ddpm_other_tools_options(), text_image_other_tools_options()).
const std::map<std::string, std::string>& foreign_options() {
  static const std::map<std::string, std::string> table = {
      {"network_dim", "--rank (the LoRA rank)"},
      {"network_alpha", "--lora_alpha"},
      {"network_dropout", "--lora_dropout"},
      {"network_module", "--lora (difftrain trains LoRA with --lora)"},
      {"network_weights",
       "!difftrain does not start a LoRA from an existing file; continue a difftrain run with "
       "--resume_from_checkpoint, or train a new LoRA"},
      {"lora_rank", "--rank"},
      {"fp8_base", "--base_weights_dtype fp8_e4m3 (or int8)"},
      {"fp8_base_unet", "--base_weights_dtype fp8_e4m3"},
      {"text_encoder_lr",
       "--learning_rate (the text encoder's LoRA trains at the same rate; difftrain has no "
       "separate one)"},
      {"max_train_epochs", "--num_train_epochs"},
      {"num_epochs", "--num_train_epochs"},
      {"save_every_n_steps", "--checkpointing_steps"},
      {"save_model_as", "--lora_format (diffusers, peft or kohya; always .safetensors)"},
      {"optimizer_type", "--optimizer adamw|prodigy (and --use_8bit_adam for AdamW8bit)"},
      {"enable_bucket", "--resolution_buckets"},
      {"min_bucket_reso", "--bucket_min_side"},
      {"max_bucket_reso", "--bucket_max_side"},
      {"bucket_reso_steps", "--bucket_step"},
      {"max_data_loader_n_workers", "--dataloader_num_workers"},
      {"log_with", "--report_to"},
      {"sample_every_n_steps", "--validation_steps"},
      {"alpha_mask", "--masked_loss (without --conditioning_data_dir it reads the images' alpha)"},
      {"lr_scheduler_num_cycles", "--lr_num_cycles"},
      {"lr_scheduler_power", "--lr_power"},
      {"ae", "--pretrained_vae_model_name_or_path"},
      {"full_bf16", "--mixed_precision bf16"},
      {"full_fp16", "--mixed_precision fp16"},
      {"output_name",
       "!the LoRA is always <output_dir>/pytorch_lora_weights.safetensors (Diffusers' name); "
       "pick the folder with --output_dir"},
      {"xformers", "!difftrain picks its attention kernel itself: leave it out"},
      {"sdpa", "!difftrain picks its attention kernel itself: leave it out"},
      {"mem_eff_attn", "!difftrain picks its attention kernel itself: leave it out"},
  };
  return table;
}

// Other tools' spellings of difftrain's own options, read as them.
const std::map<std::string, std::string>& option_aliases() {
  static const std::map<std::string, std::string> table = {
      {"repeats", "dataset_repeats"},  // Diffusers' advanced DreamBooth scripts
  };
  return table;
}

}  // namespace difftrain::train
