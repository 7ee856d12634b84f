// The one place a TrainConfig (flags, YAML, Accelerate/DeepSpeed files, environment: merged by
// train_config.cpp) becomes the library's options: the Trainer's and the task's.
#include "difftrain/train/trainer.h"

namespace difftrain::train {

TrainerOptions trainer_options(const TrainConfig& c) {
  TrainerOptions o;
  o.mixed_precision = c.mixed_precision;
  o.gradient_accumulation_steps = c.gradient_accumulation_steps;
  o.seed = c.seed;
  // Sharding from the trainer's own options or config files; otherwise from `difftrain launch`
  // (its --sharding_strategy / FSDP or DeepSpeed config reach the ranks as DIFFTRAIN_* variables).
  if (c.sharding_strategy != "NO_SHARD" || !c.deepspeed_config.empty() ||
      !c.accelerate_config_file.empty() || c.offload_optimizer_device != "none" ||
      c.offload_param_device != "none") {
    o.sharding = c.sharding_options();
  }
  o.train_batch_size = c.train_batch_size;
  o.dataloader_num_workers = c.dataloader_num_workers;
  o.learning_rate = c.learning_rate;
  o.scale_lr = c.scale_lr;
  o.optimizer = c.optimizer;
  o.use_8bit_adam = c.use_8bit_adam;
  o.prodigy_beta3 = c.prodigy_beta3;
  o.prodigy_decouple = c.prodigy_decouple;
  o.prodigy_use_bias_correction = c.prodigy_use_bias_correction;
  o.prodigy_safeguard_warmup = c.prodigy_safeguard_warmup;
  o.adam_beta1 = c.adam_beta1;
  o.adam_beta2 = c.adam_beta2;
  o.adam_weight_decay = c.adam_weight_decay;
  o.adam_epsilon = c.adam_epsilon;
  o.max_grad_norm = c.max_grad_norm;
  o.lr_scheduler = c.lr_scheduler;
  o.lr_warmup_steps = c.lr_warmup_steps;
  o.lr_num_cycles = c.lr_num_cycles;
  o.lr_power = c.lr_power;
  o.max_train_steps = c.max_train_steps;
  o.num_train_epochs = c.num_train_epochs;
  o.use_ema = c.use_ema;
  o.ema_max_decay = c.ema_max_decay;
  o.ema_inv_gamma = c.ema_inv_gamma;
  o.ema_power = c.ema_power;
  o.output_dir = c.output_dir;
  o.overwrite_output_dir = c.overwrite_output_dir;
  if (c.cache_dir.empty()) o.keep_on_overwrite = {"cache"};
  o.inputs = {{"pretrained_model_name_or_path", c.pretrained_model_name_or_path},
              {"pretrained_vae_model_name_or_path", c.pretrained_vae_model_name_or_path},
              {"model_config_name_or_path", c.model_config_name_or_path},
              {"train_data_dir", c.train_data_dir}};
  for (const auto& spec : c.family.specs) {  // the family's, e.g. --class_data_dir
    const auto value = c.family.values.find(spec.name);
    if (spec.input_path && value != c.family.values.end() && value->is_string()) {
      o.inputs.push_back({spec.name, value->get<std::string>()});
    }
  }
  o.logging_dir = c.logging_dir;
  o.report_to = c.report_to;
  o.logging_steps = c.logging_steps;
  o.checkpointing_steps = c.checkpointing_steps;
  o.checkpoints_total_limit = c.checkpoints_total_limit;
  o.resume_from_checkpoint = c.resume_from_checkpoint;
  o.save_every_n_epochs = c.save_every_n_epochs.value_or(0);
  o.save_last_n_epochs = c.save_last_n_epochs.value_or(0);
  o.validation_steps = c.validation_steps;
  o.validation_epochs = c.validation_epochs.value_or(0);
  o.num_validation_images = c.num_validation_images;
  o.final_validation = c.final_validation;
  o.config = c.to_json();
  o.shown_config = c.shown_json();
  o.defaults_from = c.defaults_from;
  // Options whose change makes a checkpoint a different run: refused at resume.
  o.structural_keys = {"model_config_name_or_path",
                       "pretrained_model_name_or_path",
                       "dataset",
                       "resolution",
                       "resolution_buckets",
                       "bucket_step",
                       "bucket_min_side",
                       "bucket_max_side",
                       "lora",
                       "rank",
                       "lora_alpha",
                       "lora_target_modules",
                       "lora_layers",
                       "base_weights_dtype",
                       "use_ema",
                       "use_8bit_adam",
                       "max_train_samples",
                       "dataset_repeats"};
  // Options whose change breaks bit-exact continuation: a warning.
  // The batch per rank and the accumulation are not among them: a resume compares the global
  // batch (per rank x ranks x accumulation), which any world size can keep.
  o.exactness_keys = {"seed",
                      "learning_rate",
                      "lr_scheduler",
                      "lr_warmup_steps",
                      "max_train_steps",
                      "mixed_precision",
                      "random_flip",
                      "guidance_scale"};
  // The family's own, as it declared them.
  for (const auto& spec : c.family.specs) {
    if (spec.structural) o.structural_keys.push_back(spec.name);
    if (spec.exactness) o.exactness_keys.push_back(spec.name);
  }
  o.warnings = c.warnings;
  return o;
}

TaskOptions task_options(const TrainConfig& c) {
  TaskOptions o;
  o.data.dataset = c.dataset;
  o.data.train_data_dir = c.train_data_dir;
  o.data.resolution = c.resolution;
  o.data.crop_width = c.resolution_width;
  o.data.crop_height = c.resolution_height;
  o.data.center_crop = c.center_crop;
  o.data.random_flip = c.random_flip;
  o.data.resolution_buckets = c.resolution_buckets;
  o.data.bucket_step = c.bucket_step;
  o.data.bucket_min_side = c.bucket_min_side;
  o.data.bucket_max_side = c.bucket_max_side;
  o.data.train_batch_size = c.train_batch_size;
  o.data.skip_bad_images = c.skip_bad_images;
  o.data.max_train_samples = c.max_train_samples;
  o.data.dataset_repeats = c.dataset_repeats;
  o.data.seed = c.seed;

  o.model.pretrained_model_name_or_path = c.pretrained_model_name_or_path;
  o.model.model_config_name_or_path = c.model_config_name_or_path;
  o.model.variant = c.variant;
  o.model.vae = c.pretrained_vae_model_name_or_path;
  o.model.base_weights_dtype = c.base_weights_dtype;
  o.model.gradient_checkpointing = c.gradient_checkpointing;

  // The objective's options are the family's (TaskOptions::family: train/ddpm_options.h,
  // train/flow_matching_options.h), which its task reads; the streams' seed is the run's.
  o.noise.seed = c.seed;

  o.lora.enabled = c.lora;
  o.lora.rank = c.rank;
  o.lora.alpha = c.lora_alpha.value_or(static_cast<double>(c.rank));
  o.lora.dropout = c.lora_dropout;
  o.lora.target_modules = c.lora_target_modules;
  o.lora.target_modules_given = c.lora_target_modules != TrainConfig{}.lora_target_modules;
  {
    std::string item;
    for (char ch : c.lora_layers + ",") {
      if (ch != ',') {
        if (ch != ' ') item += ch;
      } else if (!item.empty()) {
        o.lora.layers.push_back(item);
        item.clear();
      }
    }
  }
  o.lora.format = c.lora_format;

  o.validation.num_images = c.num_validation_images;
  o.validation.inference_steps = c.validation_inference_steps;
  o.validation.guidance_scale = c.guidance_scale.value_or(1.0);
  o.validation.guidance_scale_given = c.guidance_scale;
  o.validation.scheduler = c.validation_scheduler;
  o.validation.seed = c.seed;

  // The text-to-image group's options are the family's (train/text_image_options.h), which
  // its task reads; the cache folder is the run's.
  o.text.cache_dir = c.cache_dir;

  o.encode_batch_size = c.train_batch_size;
  o.family = c.family;
  return o;
}

}  // namespace difftrain::train
