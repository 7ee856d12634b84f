#pragma once
// Private to src/families/flux: the FLUX.1 family's parts behind ModelFamily (family.cpp).

#include "../denoiser_memory.h"
#include "difftrain/families/family.h"
#include "difftrain/families/flux/lora_layouts.h"
#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/models/text_encoders/t5_encoder.h"
#include "difftrain/models/transformers/flux_transformer.h"

#include <map>
#include <string>
#include <vector>

namespace difftrain::families::flux {

/// The transformer folder of `dir`: dir/transformer in a pipeline folder, else `dir`.
std::string flux_transformer_dir(const std::string& dir);

/// The transformer's LoRA targets when none are given: Diffusers' FLUX script's default
/// --lora_layers (families/flux/lora_layouts.h).
inline const std::vector<std::string>& default_flux_lora_targets() {
  return families::flux::diffusers_flux_lora_targets();
}

/// The FLUX.1 training task (flux_task.cpp): LoRA (transformer, optionally CLIP), DreamBooth and
/// full fine-tuning with flow matching, as Diffusers' FLUX scripts.
std::unique_ptr<train::TrainingTask> make_flux_training_task(const train::TaskOptions& options);

/// io::read_lora of `path` with the FLUX.1 key layouts (kohya / BFL, ComfyUI, XLabs) turned into
/// Diffusers module names for the transformer of the folder `dir` (its config gives the sizes a
/// fused qkv / linear1 splits into).
io::LoraWeights read_flux_lora(const std::string& path, const std::string& dir,
                               const io::LoraReadOptions& options = {});

/// ModelFamily::adapt_lora: kohya / BFL names of the transformer become Diffusers module names
/// (families/flux/lora_layouts.h, with the sizes of `dir`'s transformer), CLIP's kohya names are
/// resolved against text_encoder/.
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

/// Every parameter tensor (name, elements, a Linear's in/out) of a FluxTransformer2DModel built
/// from `options`, grouped by block ("transformer_blocks.<i>", "single_transformer_blocks.<i>", ""
/// for the rest), in the order FSDP's transformer-based wrap makes units of them; counted, not
/// built.
using FluxParam = families::DenoiserParam;
std::vector<std::pair<std::string, std::vector<FluxParam>>> flux_transformer_parameters(
    const models::FluxTransformer2DModelOptions& options);

/// The parameters of a T5EncoderModel built from `options`, counted from the config, and the
/// bytes they take with its Linear weights stored as `storage` (the others at `dense_bytes`).
int64_t t5_encoder_parameter_count(const models::T5EncoderOptions& options);
int64_t t5_encoder_stored_bytes(const models::T5EncoderOptions& options,
                                models::WeightStorage storage, int64_t dense_bytes);

/// `difftrain estimate-memory` for a FluxPipeline folder or a FluxTransformer2DModel config:
/// state bytes from the parameter lists (full fine-tuning, or LoRA on to_q/to_k/to_v/to_out.0),
/// the frozen text encoders and VAE, activations measured on depth-reduced copies (no block,
/// one double, one single block at the real width) and scaled by the block counts; resolution is
/// the latent side (128 for 1024 px), encoder_sequence_length the T5 tokens.
std::vector<train::MemoryEstimate> estimate_flux_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies);

}  // namespace difftrain::families::flux
