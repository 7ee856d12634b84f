#pragma once
// Private to src/families/sdxl: the SDXL family's pipeline extension (pipeline.cpp: what
// StableDiffusionXLPipeline adds to StableDiffusionPipeline) and training task (sdxl_task.cpp).
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "difftrain/train/training_task.h"

#include <memory>

namespace difftrain::families::sdxl {

/// StableDiffusionXLPipeline as an extension of Stable Diffusion's pipeline: text_encoder_2
/// (CLIPTextModelWithProjection) and tokenizer_2, the two encoders' penultimate layers side by
/// side and the second's pooled embedding, the UNet's text_time conditioning (pooled embedding
/// and micro-conditioning time ids), guidance 5, the float16 VAE decoded in float32.
const std::shared_ptr<const stable_diffusion::PipelineExtension>& pipeline_extension();

/// StableDiffusionXLPipeline.__call__'s micro-conditioning arguments (original_size,
/// crops_coords_top_left, target_size and their negative_* forms), each a pair: the family's
/// sample options, and the names its pipeline extension reads.
std::vector<train::OptionSpec> micro_conditioning_options();

/// StableDiffusionXLPipeline's micro-conditioning: [original_size (h, w), crops_coords_top_left
/// (top, left), target_size (h, w)] as one row [1, 6] float32 (`_get_add_time_ids`).
torch::Tensor add_time_ids(const std::vector<int64_t>& original_size,
                           const std::vector<int64_t>& crops_coords_top_left,
                           const std::vector<int64_t>& target_size);

/// Diffusers' train_text_to_image[_lora]_sdxl.py and train_dreambooth_lora_sdxl.py.
std::unique_ptr<train::TrainingTask> make_sdxl_task(train::TaskOptions options);

}  // namespace difftrain::families::sdxl
