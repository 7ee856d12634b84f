#pragma once
// Merging a LoRA file into a saved model folder for good: what `difftrain lora merge` runs.
// Diffusers: `pipe = DiffusionPipeline.from_pretrained(dir); pipe.load_lora_weights(file);
// pipe.fuse_lora(lora_scale=s); pipe.unload_lora_weights(); pipe.save_pretrained(out)`, for the
// UNet. See docs/LORA.md, "difftrain lora merge".

#include "difftrain/io/lora_format.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace difftrain::models {

/// Options of merge_lora_into_folder().
struct LoraFolderMergeOptions {
  /// Strength of the LoRA (merge_lora's lora_scale, Diffusers' `fuse_lora(lora_scale=...)`);
  /// 1 applies it as trained. Must be finite.
  double lora_scale = 1.0;
  /// Weights variant of the UNet to read and write: "fp16" reads and writes
  /// `diffusion_pytorch_model.fp16.safetensors` (see weights_path); "" the default file.
  std::string variant;
  /// How to read the LoRA file (e.g. a PEFT adapter's lora_alpha).
  io::LoraReadOptions read;
};

/// What merge_lora_into_folder() did.
struct LoraFolderMergeSummary {
  std::string unet_dir;  ///< the UNet folder read: `model_dir` or `model_dir`/unet
  /// The merged weight files in the output folder (every shard of a sharded denoiser, then the
  /// text encoders').
  std::vector<std::string> weights_written;
  io::LoraFormat format = io::LoraFormat::kDiffusers;  ///< the LoRA file's format
  int64_t modules_merged = 0;                          ///< UNet weights changed
  /// Text-encoder weights changed (a pipeline's text_encoder and SDXL's text_encoder_2).
  int64_t text_encoder_modules_merged = 0;
  /// Targets of components not merged (text encoders of a UNet folder, other components), by
  /// component: warned about.
  std::map<std::string, int64_t> skipped_components;
  /// UNet weight files of the input other than the one merged (other variants, .bin, shards),
  /// relative to `model_dir`: not copied, since they hold the UNet without the LoRA.
  std::vector<std::string> skipped_files;
  int64_t files_copied = 0;  ///< files of the input copied unchanged
};

/// Writes a copy of the model folder `model_dir` to `output_dir` with the LoRA file `lora_path`
/// (Diffusers, PEFT or kohya, keys in any mix of them, with the r / alpha of its
/// lora_adapter_metadata or a PEFT adapter_config.json beside it; or a folder holding
/// adapter_model.safetensors or pytorch_lora_weights.safetensors; io::read_lora) folded into the
/// UNet's weights (merge_lora, component
/// "unet", `options.lora_scale`) and, in a pipeline folder, into text_encoder/ and SDXL's
/// text_encoder_2/ (their model[.variant].safetensors rewritten with every tensor, merged ones in
/// the file's dtype; their other weight files dropped, as the UNet's). `model_dir` is a pipeline
/// folder (model_index.json + unet/ + other components) or a UNet folder (config.json +
/// diffusion_pytorch_model.safetensors); no scheduler is needed. The output has the same layout:
/// the merged UNet saved with save_unet (config.json + weights named as read, in the dtype the
/// input file had when all its floating tensors share one, else float32; the merge itself is in
/// float32), and every other file and folder copied unchanged (symlinks followed), except the
/// UNet's other weight files (see LoraFolderMergeSummary::skipped_files). LoRA targets of other
/// components (and text-encoder targets for a UNet folder) are not merged; they are counted and
/// logged as a warning. The output is built in a sibling folder
/// `<output_dir>.partial-<pid>` and renamed into place at the end, so a failed merge leaves no
/// output. Throws difftrain::Error naming the path when: `model_dir` is not a model folder, the
/// LoRA file is missing or invalid (read_lora's errors), `output_dir` is empty, exists and is not
/// an empty folder, is `model_dir` or lies inside it, lora_scale is not finite, the LoRA does not
/// fit the UNet (merge_lora's errors), or a copy or write fails.
LoraFolderMergeSummary merge_lora_into_folder(const std::string& model_dir,
                                              const std::string& lora_path,
                                              const std::string& output_dir,
                                              const LoraFolderMergeOptions& options = {});

}  // namespace difftrain::models
