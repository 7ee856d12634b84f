#pragma once
// Private to src/families/flux: the FLUX.1 family's parts behind ModelFamily (family.cpp).

#include "difftrain/families/family.h"

#include <map>
#include <string>
#include <vector>

namespace difftrain::families::flux {

/// The transformer folder of `dir`: dir/transformer in a pipeline folder, else `dir`.
std::string flux_transformer_dir(const std::string& dir);

/// io::read_lora of `path` with the FLUX.1 key layouts (kohya / BFL, ComfyUI, XLabs) turned into
/// Diffusers module names for the transformer of the folder `dir` (its config gives the sizes a
/// fused qkv / linear1 splits into).
io::LoraWeights read_flux_lora(const std::string& path, const std::string& dir,
                               const io::LoraReadOptions& options = {});

/// ModelFamily::adapt_lora: kohya / BFL names of the transformer become Diffusers module names
/// (io/flux_lora.h, with the sizes of `dir`'s transformer), CLIP's kohya names are resolved
/// against text_encoder/.
void adapt_flux_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat format);

/// `difftrain lora merge` for a FluxPipeline folder (or a bare transformer folder): the
/// transformer's and the CLIP text encoder's weights with the LoRA folded in, every other file
/// copied; built beside `output_dir` and renamed into place.
models::LoraFolderMergeSummary merge_flux_lora(const std::string& dir, const std::string& lora,
                                               const std::string& output_dir,
                                               const models::LoraFolderMergeOptions& options);

/// `difftrain forward`: one FluxTransformer2DModel forward on named tensors (hidden_states,
/// encoder_hidden_states, pooled_projections, timestep, guidance (dev), img_ids, txt_ids).
torch::Tensor forward_flux(const std::string& dir,
                           const std::map<std::string, torch::Tensor>& inputs,
                           const std::string& source, const std::string& lora, double lora_scale);

/// `difftrain estimate-memory` for a FluxPipeline folder or a FluxTransformer2DModel config.
std::vector<train::MemoryEstimate> estimate_flux_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies);

}  // namespace difftrain::families::flux
