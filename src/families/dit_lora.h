#pragma once
// The LoRA file layouts of a single-transformer (DiT) family, shared by the families whose
// transformer is the only LoRA component (Z-Image, Qwen-Image): Diffusers / PEFT
// (`transformer.<module>.lora_A.weight`), the ComfyUI / musubi-tuner form (`diffusion_model.
// <module>` with lora_down / lora_up / .alpha, read as `transformer.` keys, with the original
// checkpoint's module names renamed to Diffusers'), and kohya names (`lora_unet_<module with _>`,
// moved to the transformer and resolved against its weight names).

#include "difftrain/families/lora_merge.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/lora_layout.h"

#include <functional>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::families {

struct DitLoraLayout {
  std::string name;  ///< "Z-Image", "Qwen-Image": for messages and the layout's name
  /// The transformer's top-level modules, as its weight names begin ("layers", "img_in").
  std::vector<std::string> top_modules;
  /// Module renames of the ComfyUI form (an ECMAScript regex on the module name, its
  /// replacement), e.g. Z-Image's `\.attention\.out$` -> `.attention.to_out.0`.
  std::vector<std::pair<std::string, std::string>> comfyui_renames;
  /// The transformer folder of a pipeline folder or a bare transformer folder.
  std::function<std::string(const std::string& dir)> transformer_dir;
  /// A family whose original checkpoint names its modules otherwise than Diffusers (Wan:
  /// `blocks.0.self_attn.q` for `blocks.0.attn1.to_q`): the renames Diffusers -> original (the
  /// inverse of comfyui_renames). kohya names are then resolved against both namings (musubi-
  /// tuner writes the original's), and kohya / ComfyUI exports name the original modules. Empty
  /// when the ComfyUI form uses Diffusers' names.
  std::vector<std::pair<std::string, std::string>> original_renames;
};

/// Whether `module` (dotted) starts with one of the layout's top-level modules.
bool dit_module(const DitLoraLayout& layout, const std::string& module);

/// The ComfyUI / musubi-tuner key layout of the family, for lora_key_layouts().
io::LoraKeyLayout dit_comfyui_key_layout(const DitLoraLayout& layout);

/// read_lora, then the kohya lora_unet_ targets of the family's modules moved to the transformer
/// and resolved against its weight names (`dir`: a pipeline or transformer folder).
io::LoraWeights read_dit_lora(const DitLoraLayout& layout, const std::string& path,
                              const std::string& dir, const io::LoraReadOptions& options = {});

/// `difftrain lora merge` of such a family (`name`: "Qwen-Image", for messages): the
/// transformer's diffusion_pytorch_model files merged file by file (merge_lora_by_files), the
/// LoRA read by `read` (the family's read_dit_lora).
models::LoraFolderMergeSummary merge_dit_lora(const std::string& name,
                                              const decltype(FileMergePlan::read)& read,
                                              const std::string& dir, const std::string& lora,
                                              const std::string& output_dir,
                                              const models::LoraFolderMergeOptions& options);

/// For exports: the targets resolved, then, for kohya, named lora_unet_ as sd-scripts and
/// musubi-tuner name the transformer.
void adapt_dit_lora(const DitLoraLayout& layout, io::LoraWeights& lora, const std::string& dir,
                    io::LoraFormat format);

}  // namespace difftrain::families
