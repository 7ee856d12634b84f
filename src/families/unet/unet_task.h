#pragma once
// Private to src/families/unet: the UNet family's training task (unet_task.cpp).
#include "difftrain/train/training_task.h"

#include <memory>

namespace difftrain::train {
/// Diffusers' train_unconditional.py: a fresh or pretrained UNet2DModel on MNIST-like data or an
/// image folder.
std::unique_ptr<TrainingTask> make_unet_task(TaskOptions options);
}  // namespace difftrain::train
