#pragma once
// Private to src/families/sdxl: the SDXL family's training task (sdxl_task.cpp).
#include "difftrain/train/training_task.h"

#include <memory>

namespace difftrain::families::sdxl {
/// Diffusers' train_text_to_image[_lora]_sdxl.py and train_dreambooth_lora_sdxl.py.
std::unique_ptr<train::TrainingTask> make_sdxl_task(train::TaskOptions options);
}  // namespace difftrain::families::sdxl
