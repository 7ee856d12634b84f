// The defaults of Diffusers' Stable Diffusion training scripts
// (families/stable_diffusion/text_to_image.h).
#include "difftrain/families/stable_diffusion/text_to_image.h"

namespace difftrain::families::stable_diffusion {

train::ScriptDefaults text_to_image_script_defaults(const train::TrainConfig& c) {
  train::ScriptDefaults d;
  const bool dreambooth = !c.instance_prompt.empty();
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
