// What the UNet-based families share (builtin.h: UNetBasedFamily): forward, lora merge, the
// memory model and the UNet's LoRA names.
#include "builtin.h"
#include "difftrain/io/lora_format.h"

#include <filesystem>
#include "difftrain/families/unet/memory.h"
#include "difftrain/families/unet/pipeline.h"

namespace difftrain::families {

void UNetBasedFamily::adapt_lora(io::LoraWeights& lora, const std::string& dir,
                                 io::LoraFormat format) const {
  adapt_unet_lora(lora, dir, format);
  // Every other component a UNet family trains LoRA on is a CLIP text encoder.
  for (const auto& component : lora_components()) {
    if (component != "unet") adapt_text_encoder_lora(lora, dir, component);
  }
}

models::LoraFolderMergeSummary UNetBasedFamily::merge_lora(
    const std::string& dir, const std::string& lora, const std::string& output_dir,
    const models::LoraFolderMergeOptions& options) const {
  // Read once more for the check: merge_lora_into_folder() writes as it merges.
  std::error_code ec;
  if (std::filesystem::exists(lora, ec)) {
    check_lora_fits_family(io::read_lora(lora, options.read), lora, dir);
  }
  return models::merge_lora_into_folder(dir, lora, output_dir, options);
}

torch::Tensor UNetBasedFamily::forward(const std::string& dir,
                                       const std::map<std::string, torch::Tensor>& inputs,
                                       const std::string& source, const std::string& lora,
                                       double lora_scale) const {
  models::UNet unet =
      diffusion::load_unet_with_lora(diffusion::resolve_unet_dir(dir), lora, lora_scale);
  return diffusion::forward_from_tensors(*unet, inputs, source);
}

std::vector<train::MemoryEstimate> UNetBasedFamily::estimate_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies) const {
  return train::estimate_memory(model_path, options, strategies);
}

}  // namespace difftrain::families

namespace difftrain::families {

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
  // A UNet's objective: the flow-matching flags and class labels do not apply.
  d.not_applicable = {"class_conditional",   "class_dropout_prob", "only_class",
                      "weighting_scheme",    "logit_mean",         "logit_std",
                      "mode_scale",          "timestep_sampling",  "sigmoid_scale",
                      "discrete_flow_shift", "max_sequence_length"};
  return d;
}

}  // namespace difftrain::families
