// The defaults of Diffusers' Stable Diffusion and SDXL training scripts
// (families/stable_diffusion/text_to_image.h).
#include "difftrain/families/stable_diffusion/text_to_image.h"

namespace difftrain::families::stable_diffusion {
using namespace difftrain::diffusion;
using namespace difftrain::train;
using namespace difftrain::families::unet;

train::ScriptDefaults text_to_image_script_defaults(const train::TrainConfig& c, bool sdxl) {
  train::ScriptDefaults d;
  const bool dreambooth = !c.instance_prompt.empty();
  const std::string xl = sdxl ? "_sdxl" : "";
  const std::string lora = c.lora ? "_lora" : "";
  d.resolution = sdxl ? 1024 : 512;
  if (dreambooth) {
    // train_dreambooth.py, train_dreambooth_lora.py, train_dreambooth_lora_sdxl.py.
    d.script = (sdxl && !c.lora) ? "train_dreambooth.py" : "train_dreambooth" + lora + xl + ".py";
    d.train_batch_size = 4;
    d.num_train_epochs = 1;
    d.learning_rate = c.lora ? (sdxl ? 1e-4 : 5e-4) : 5e-6;
    d.adam_weight_decay = (c.lora && sdxl) ? 1e-4 : 1e-2;
  } else {
    // train_text_to_image.py, train_text_to_image_lora.py, train_text_to_image[_lora]_sdxl.py.
    d.script = "train_text_to_image" + lora + xl + ".py";
    d.train_batch_size = 16;
    d.num_train_epochs = 100;
    d.learning_rate = 1e-4;
    d.adam_weight_decay = 1e-2;
  }
  // Class labels do not apply to text-to-image.
  d.not_applicable = {"class_conditional", "class_dropout_prob", "only_class"};
  return d;
}

}  // namespace difftrain::families::stable_diffusion
