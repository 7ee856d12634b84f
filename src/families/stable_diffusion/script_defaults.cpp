// The training options of Stable Diffusion runs and the defaults of Diffusers' Stable Diffusion
// training scripts (families/stable_diffusion/text_to_image.h).
#include "difftrain/families/stable_diffusion/text_to_image.h"

#include "difftrain/train/ddpm_options.h"
#include "difftrain/train/text_image_options.h"

namespace difftrain::families::stable_diffusion {

std::vector<train::OptionSpec> text_to_image_option_specs() {
  auto specs = train::ddpm_option_specs();
  for (auto& spec : train::text_image_option_specs()) specs.push_back(std::move(spec));
  specs.push_back(train::clip_skip_option_spec());
  return specs;
}

std::map<std::string, std::string> text_to_image_other_tools_options() {
  auto table = train::ddpm_other_tools_options();
  table.merge(train::text_image_other_tools_options());
  table.emplace("unet_lr", "--learning_rate");
  return table;
}

bool dreambooth(const train::TrainConfig& c) {
  const auto it = c.family.values.find("instance_prompt");
  return it != c.family.values.end() && it->is_string() && !it->get<std::string>().empty();
}

train::ScriptDefaults text_to_image_script_defaults(const train::TrainConfig& c) {
  train::ScriptDefaults d;
  const bool dreambooth = stable_diffusion::dreambooth(c);
  const std::string lora = c.lora ? "_lora" : "";
  d.resolution = 512;
  if (dreambooth) {
    // train_dreambooth.py, train_dreambooth_lora.py.
    d.script = "train_dreambooth" + lora + ".py";
    d.train_batch_size = 4;
    d.num_train_epochs = 1;
    d.learning_rate = c.lora ? 5e-4 : 5e-6;
    d.adam_weight_decay = 1e-2;
  } else {
    // train_text_to_image.py, train_text_to_image_lora.py.
    d.script = "train_text_to_image" + lora + ".py";
    d.train_batch_size = 16;
    d.num_train_epochs = 100;
    d.learning_rate = 1e-4;
    d.adam_weight_decay = 1e-2;
  }
  return d;
}

}  // namespace difftrain::families::stable_diffusion
