#pragma once
// Private to src/families/unet: the UNet family's training task (unet_task.cpp).
#include "difftrain/train/training_task.h"

#include <memory>

namespace difftrain::families::unet {
/// Diffusers' train_unconditional.py: a fresh or pretrained UNet2DModel on MNIST-like data or an
/// image folder.
std::unique_ptr<train::TrainingTask> make_unet_task(train::TaskOptions options);
}  // namespace difftrain::families::unet
