#pragma once
// DreamBooth's class images (prior preservation), a component a model family composes: the class
// folder needs a number of images; the missing ones are drawn from the pretrained pipeline with
// the class prompt, split across ranks, each image from its own seed, so the folder is the same
// whatever the world size.

#include "difftrain/accel/accelerator.h"

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>

namespace difftrain::train {

/// What generate_class_images() needs.
struct ClassImageOptions {
  std::string class_data_dir;
  std::string class_prompt;
  int64_t num_class_images = 0;
  /// Image i of the folder (counted from the first image there) is drawn from seed + i.
  uint64_t seed = 0;
};

/// Renders `count` class images [count, H, W, 3] in [0, 1], image j from seed `seed + j`
/// (Seeding::kPerImage); called on each rank with a share.
using ClassImageRenderer = std::function<torch::Tensor(int64_t count, uint64_t seed)>;

/// Fills `options.class_data_dir` up to num_class_images images (class_NNNNNN.png, numbered after
/// the images already there), each rank rendering its contiguous share under acc.autocast(); does
/// nothing when the folder has enough. Collective: every rank calls it. Throws difftrain::Error
/// when the folder has too few images and a metadata.jsonl (generated images would have no
/// captions there).
void generate_class_images(accel::Accelerator& acc, const ClassImageOptions& options,
                           const ClassImageRenderer& render);

}  // namespace difftrain::train
