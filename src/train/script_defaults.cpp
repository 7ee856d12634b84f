// A family's Diffusers script defaults applied to the options a run was not given
// (train_config.h: apply_script_defaults).
#include "difftrain/train/train_config.h"

namespace difftrain::train {

void apply_script_defaults(TrainConfig& c, const ScriptDefaults& d) {
  const auto unset = [&](const char* name) { return c.given.count(name) == 0; };
  if (unset("resolution")) c.resolution = d.resolution;
  if (unset("train_batch_size")) c.train_batch_size = d.train_batch_size;
  // Diffusers' scripts: --max_train_steps None, so the epochs decide the length.
  if (unset("max_train_steps") && unset("num_train_epochs")) {
    c.max_train_steps = 0;
    c.num_train_epochs = d.num_train_epochs;
  }
  if (unset("learning_rate")) c.learning_rate = d.learning_rate;
  if (unset("lr_scheduler")) c.lr_scheduler = d.lr_scheduler;
  if (unset("lr_warmup_steps")) c.lr_warmup_steps = d.lr_warmup_steps;
  if (unset("adam_beta1")) c.adam_beta1 = d.adam_beta1;
  if (unset("adam_beta2")) c.adam_beta2 = d.adam_beta2;
  if (unset("adam_weight_decay")) c.adam_weight_decay = d.adam_weight_decay;
  if (unset("adam_epsilon")) c.adam_epsilon = d.adam_epsilon;
  // An epoch cadence given alone turned the step one off (parse_train_config).
  if (unset("checkpointing_steps") && !c.save_every_n_epochs) {
    c.checkpointing_steps = d.checkpointing_steps;
  }
  if (unset("num_validation_images")) c.num_validation_images = d.num_validation_images;
  if (unset("use_ema")) c.use_ema = d.use_ema;
  if (!d.lora_target_modules.empty() && unset("lora_target_modules") && c.lora_layers.empty()) {
    c.lora_target_modules = d.lora_target_modules;
  }
  for (const auto& [name, value] : d.family_options.items()) {
    if (unset(name.c_str()) && c.family.find(name) != nullptr) c.family.values[name] = value;
  }
  c.defaults_from = d.script;
  c.not_applicable.insert(d.not_applicable.begin(), d.not_applicable.end());
  if (!c.use_ema)
    c.not_applicable.insert({"ema_decay", "ema_inv_gamma", "ema_power", "ema_max_decay"});
  if (!c.lora) {
    c.not_applicable.insert({"rank", "lora_alpha", "lora_dropout", "lora_target_modules",
                             "lora_format", "lora_layers", "base_weights_dtype",
                             "text_encoder_lora_target_modules"});
  }
  c.family.complete_and_check();
  c.validate();
}

}  // namespace difftrain::train
