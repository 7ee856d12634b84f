// What the UNet-based families share (families/unet/unet_based_family.h): forward, lora merge,
// the memory model and the UNet's LoRA names.
#include "difftrain/families/unet/unet_based_family.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/unets/sgm_names.h"
#include "difftrain/models/unets/unet_config.h"
#include "difftrain/train/ddpm_options.h"

#include <filesystem>
#include "difftrain/families/unet/memory.h"
#include "difftrain/families/unet/pipeline.h"

namespace difftrain::families::unet {
namespace fs = std::filesystem;

void adapt_unet_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat format) {
  const bool pipeline = fs::exists(fs::path(dir) / "model_index.json");
  const std::string unet_dir = pipeline ? (fs::path(dir) / "unet").string() : dir;
  const auto config = models::UNetConfig::load((fs::path(unet_dir) / "config.json").string());
  const auto names = safetensors_module_names(models::weights_path(unet_dir));
  // kohya names resolve against the UNet's module names, and against their SGM names (kohya's
  // SDXL files); a UNet with added conditioning (SDXL's) is written with SGM names in kohya form.
  io::resolve_kohya_names(lora, "unet", names, models::sgm_aliases(config, names));
  if (format == io::LoraFormat::kKohya && config.addition_embed_type) {
    lora = models::with_sgm_unet_names(lora, config);
  }
}

std::vector<train::OptionSpec> UNetBasedFamily::options() const {
  return train::ddpm_option_specs();
}

std::map<std::string, std::string> UNetBasedFamily::other_tools_options() const {
  auto table = train::ddpm_other_tools_options();
  table.emplace("unet_lr", "--learning_rate");
  return table;
}

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
      families::unet::load_unet_with_lora(families::unet::resolve_unet_dir(dir), lora, lora_scale);
  return families::unet::forward_from_tensors(*unet, inputs, source);
}

std::vector<train::MemoryEstimate> UNetBasedFamily::estimate_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies) const {
  return families::unet::estimate_memory(model_path, options, strategies);
}

}  // namespace difftrain::families::unet
