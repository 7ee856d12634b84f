#pragma once
// The Z-Image training task (z_image_task.cpp). Private to src/families/z_image.
#include "difftrain/train/memory_estimate.h"
#include "difftrain/train/training_task.h"

#include <memory>
#include <string>
#include <vector>

namespace difftrain::families::z_image {

/// train_dreambooth_lora_z_image.py's default LoRA targets: the attention projections.
const std::vector<std::string>& default_z_image_lora_targets();

/// LoRA, DreamBooth and full fine-tuning of a ZImagePipeline folder's transformer with flow
/// matching, as train_dreambooth_lora_z_image.py.
std::unique_ptr<train::TrainingTask> make_z_image_training_task(const train::TaskOptions& options);

/// `difftrain estimate-memory` for a ZImagePipeline folder, a ZImageTransformer2DModel folder or
/// its config.json (memory.cpp): parameters and activations from depth-reduced copies at the real
/// width; Qwen3 not counted (released once the captions are cached).
std::vector<train::MemoryEstimate> estimate_z_image_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies);

}  // namespace difftrain::families::z_image
