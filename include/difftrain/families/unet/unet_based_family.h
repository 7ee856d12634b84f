#pragma once
// What the UNet-based families (unet, stable-diffusion, sdxl) share: the denoiser is a
// UNet2D(Condition)Model in `dir` or `dir`/unet, so forward, lora merge (the UNet and the text
// encoders a pipeline folder has), the memory model and the LoRA names (the UNet's; each family
// adds its text encoders) are the same. A family built on a UNet derives from it.
#include "difftrain/families/family.h"

#include <map>
#include <string>
#include <vector>

namespace difftrain::families::unet {

/// A ModelFamily whose denoiser is a UNet (families/unet/).
class UNetBasedFamily : public ModelFamily {
 public:
  /// The UNet's names (adapt_unet_lora), then every other lora_components() entry as a CLIP
  /// text encoder (adapt_text_encoder_lora).
  void adapt_lora(io::LoraWeights& lora, const std::string& dir,
                  io::LoraFormat format) const override;
  models::LoraFolderMergeSummary merge_lora(
      const std::string& dir, const std::string& lora, const std::string& output_dir,
      const models::LoraFolderMergeOptions& options) const override;
  torch::Tensor forward(const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
                        const std::string& source, const std::string& lora,
                        double lora_scale) const override;
  /// Diffusers' oldest LoRA layout names the UNet's modules bare.
  std::string lora_bare_component() const override { return "unet"; }
  /// kohya's `--unet_lr`.
  std::map<std::string, std::string> other_tools_options() const override;
  /// The DDPM objective's options (train::ddpm_option_specs()): a UNet family trains with it.
  std::vector<train::OptionSpec> options() const override;
  std::vector<train::MemoryEstimate> estimate_memory(
      const std::string& model_path, const train::MemoryEstimateOptions& options,
      const std::vector<accel::ShardingStrategy>& strategies) const override;
};

/// ModelFamily::adapt_lora's part for the UNet: its kohya names resolved against `dir`'s UNet
/// (dir/unet in a pipeline folder), with SGM names for kohya output of a UNet with added
/// conditioning.
void adapt_unet_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat format);

}  // namespace difftrain::families::unet
