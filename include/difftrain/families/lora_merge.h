#pragma once
// `difftrain lora merge` for the families whose models are merged file by file: the LoRA's deltas
// are added to the weight tensors of a component's safetensors files by name (`<module>.weight`),
// one file at a time, so a sharded multi-billion-parameter transformer never needs a model built
// or two copies in memory; every other file of the folder is copied. Diffusers:
// `pipe.load_lora_weights(f); pipe.fuse_lora(lora_scale=s); pipe.unload_lora_weights();
// pipe.save_pretrained(out)`. The FLUX.1 and Z-Image families use it.
#include "difftrain/io/lora_format.h"
#include "difftrain/models/lora/lora_folder.h"

#include <functional>
#include <map>
#include <string>

namespace difftrain::families {

/// What a family merges file by file.
struct FileMergePlan {
  /// The components merged in a pipeline folder, with the stem of their weight files
  /// ("transformer" -> "diffusion_pytorch_model", "text_encoder" -> "model"); the first is the
  /// denoiser, the only one merged into a bare model folder.
  std::vector<std::pair<std::string, std::string>> components;
  /// Reads the LoRA file against the model folder (the family's layouts and name resolution).
  std::function<io::LoraWeights(const std::string& lora, const std::string& dir,
                                const io::LoraReadOptions& options)>
      read;
  /// The layouts the family reads, for the missing-file message ("Diffusers, PEFT, kohya or
  /// ComfyUI").
  std::string layouts;
};

/// Writes a copy of the model folder `dir` (a pipeline folder, or the bare denoiser's) to
/// `output_dir` with the LoRA file folded into the plan's components, built beside it and renamed
/// into place. Throws difftrain::Error for a bad scale, an output folder that exists (not empty)
/// or lies inside `dir`, a missing LoRA, a LoRA for another family (check_lora_fits_family) or
/// without targets here, or an update whose size or module the folder has not.
models::LoraFolderMergeSummary merge_lora_by_files(const std::string& dir, const std::string& lora,
                                                   const std::string& output_dir,
                                                   const models::LoraFolderMergeOptions& options,
                                                   const FileMergePlan& plan);

}  // namespace difftrain::families
