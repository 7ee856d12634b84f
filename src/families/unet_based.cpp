// What the UNet-based families share (builtin.h: UNetBasedFamily): forward, lora merge, the
// memory model and the UNet's LoRA names.
#include "builtin.h"
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
