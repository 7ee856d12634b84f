#pragma once
// Private to src/families/sdxl: the SDXL family's training task (sdxl_task.cpp).
#include "difftrain/train/training_task.h"

#include <memory>

namespace difftrain::train {
/// Diffusers' train_text_to_image[_lora]_sdxl.py and train_dreambooth_lora_sdxl.py.
std::unique_ptr<TrainingTask> make_sdxl_task(TaskOptions options);
}  // namespace difftrain::train
