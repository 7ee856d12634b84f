#pragma once
// The Wan training task (wan_task.cpp). Private to src/families/wan.
#include "difftrain/accel/sharding.h"
#include "difftrain/train/memory_estimate.h"
#include "difftrain/train/training_task.h"

#include <memory>
#include <string>
#include <vector>

namespace difftrain::families::wan {

/// musubi-tuner's Wan LoRA targets by Diffusers' names: every Linear of each transformer block
/// (attn1 / attn2 q, k, v, out, the feed-forward's two), and the image branch's add_k_proj /
/// add_v_proj when the model has one (Wan 2.1 I2V).
const std::vector<std::string>& default_wan_lora_targets(bool image_branch);

/// LoRA / full fine-tuning of a Wan folder on clips and images (musubi-tuner's semantics).
std::unique_ptr<train::TrainingTask> make_wan_training_task(const train::TaskOptions& options);

/// `difftrain estimate-memory` for a Wan folder or transformer config (memory.cpp): one expert's
/// state per rank and the activations of a --num_frames x --height x --width clip.
std::vector<train::MemoryEstimate> estimate_wan_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies);

}  // namespace difftrain::families::wan
