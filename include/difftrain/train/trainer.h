#pragma once
// `difftrain train`: the ready-made trainer (Diffusers' train_unconditional.py and
// train_text_to_image_lora.py on the Accelerator). One call runs a whole training job on the
// process group of `difftrain launch` (or a single process). See docs/TRAINING.md.
#include "difftrain/train/train_config.h"

#include <cstdint>
#include <string>

namespace difftrain::train {

/// What a finished run produced.
struct TrainResult {
  std::string output_dir;
  int64_t global_step = 0;  ///< optimizer updates done
  double last_loss = 0.0;   ///< mean loss of the last update over every rank
};

/// Runs the training job `config` describes: builds the dataset, the UNet (fresh, pretrained, or
/// pretrained with LoRA adapters), the optimizer, LR schedule, noise scheduler and EMA, prepares
/// them on an Accelerator, resumes if asked, trains to max_train_steps (or num_train_epochs),
/// checkpoints, validates, logs, and exports the final pipeline folder or LoRA file. Every rank
/// calls it. Throws difftrain::Error for bad input (before any training where it can be known)
/// and when interrupted by SIGINT/SIGTERM (after writing a checkpoint).
TrainResult run_training(TrainConfig config);

/// The newest complete checkpoint-<step> folder under `output_dir` that verifies against its
/// checksums.json (accel::verify_checkpoint), or "" if there is none. Unfinished
/// `checkpoint-<step>.tmp` folders are never chosen; a newer damaged checkpoint is skipped with
/// a warning naming it and the reason.
std::string latest_checkpoint(const std::string& output_dir);

/// Removes the `checkpoint-<step>.tmp` folders an interrupted save left under `output_dir`
/// (logging each). The trainer's main rank calls it at start.
void remove_unfinished_checkpoints(const std::string& output_dir);

}  // namespace difftrain::train
