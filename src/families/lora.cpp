// `difftrain lora convert` (families/family.h: convert_lora) and the name resolution the built-in
// families' adapt_lora share.
#include "builtin.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/models/sgm_names.h"
#include "difftrain/models/unet_config.h"

#include <filesystem>

namespace difftrain::families {
namespace fs = std::filesystem;
namespace {

// The module names of the safetensors weights `path` (keys ending in .weight), from its header.
std::vector<std::string> weight_module_names(const std::string& path) {
  std::vector<std::string> names;
  for (const auto& [key, entry] : io::read_safetensors_header(path).tensors) {
    (void)entry;
    if (key.size() > 7 && key.compare(key.size() - 7, 7, ".weight") == 0) {
      names.push_back(key.substr(0, key.size() - 7));
    }
  }
  return names;
}

}  // namespace

void adapt_unet_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat format) {
  const bool pipeline = fs::exists(fs::path(dir) / "model_index.json");
  const std::string unet_dir = pipeline ? (fs::path(dir) / "unet").string() : dir;
  const auto config = models::UNetConfig::load((fs::path(unet_dir) / "config.json").string());
  const auto names = weight_module_names(models::weights_path(unet_dir));
  // kohya names resolve against the UNet's module names, and against their SGM names (kohya's
  // SDXL files); a UNet with added conditioning (SDXL's) is written with SGM names in kohya form.
  io::resolve_kohya_names(lora, "unet", names, models::sgm_aliases(config, names));
  if (format == io::LoraFormat::kKohya && config.addition_embed_type) {
    lora = models::with_sgm_unet_names(lora, config);
  }
}

void adapt_text_encoder_lora(io::LoraWeights& lora, const std::string& dir,
                             const std::string& component) {
  const fs::path folder = fs::path(dir) / component;
  if (lora.count(component) == 0 || !fs::is_directory(folder)) return;
  io::resolve_kohya_names(lora, component,
                          weight_module_names((folder / "model.safetensors").string()));
}

LoraConversion convert_lora(const std::string& input, const std::string& output,
                            io::LoraFormat format, const std::string& model) {
  io::LoraWeights lora = io::read_lora(input);
  LoraConversion out;
  out.read_format = lora.format;
  if (!model.empty()) family_of(model).adapt_lora(lora, model, format);
  io::write_lora(output, lora, format);
  for (const auto& [component, targets] : lora.components) out.targets[component] = targets.size();
  return out;
}

}  // namespace difftrain::families
