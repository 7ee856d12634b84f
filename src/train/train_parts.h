#pragma once
// The pieces of a training run, shared by trainer.cpp (the loop), parts.cpp (building them and
// the loss) and outputs.cpp (checkpoints, validation, run info, the final export).
#include "difftrain/accel/accelerator.h"
#include "difftrain/accel/trackers.h"
#include "difftrain/data/data_loader.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/diffusion/ema.h"
#include "difftrain/diffusion/noise_scheduler.h"
#include "difftrain/models/lora_training.h"
#include "difftrain/models/unet.h"
#include "difftrain/optim/flat_optimizer.h"
#include "difftrain/optim/lr_schedule.h"
#include "difftrain/train/train_config.h"
#include "text_to_image.h"

#include <filesystem>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::train {

struct TrainParts {
  std::shared_ptr<data::Dataset> dataset;
  std::function<void(int64_t)> set_epoch;  ///< the dataset's augmentation epoch
  int64_t num_classes = 0;                 ///< labels of the dataset (0: unlabelled)
  std::vector<std::string> class_names;
  int64_t channels = 1;
  std::shared_ptr<data::DataLoader> loader;

  models::UNet unet{nullptr};
  bool class_conditional = false;
  int64_t null_class = -1;  ///< label used for class dropout and guidance (-1: none)
  models::LoraLayers lora{nullptr};
  /// Text-to-image runs (a Stable Diffusion folder): the frozen VAE, text encoder, tokenizer.
  std::shared_ptr<TextToImageParts> t2i;
  /// What is trained, prepared and checkpointed: the UNet, or the LoRA adapters.
  std::shared_ptr<torch::nn::Module> trainable;

  std::shared_ptr<optim::FlatOptimizer> raw_optimizer;
  std::shared_ptr<accel::AcceleratedOptimizer> optimizer;
  std::shared_ptr<optim::LRScheduler> lr_schedule;
  std::shared_ptr<accel::AcceleratedScheduler> scheduler;
  std::shared_ptr<diffusion::NoiseScheduler> noise_scheduler;
  std::unique_ptr<diffusion::EMAModel> ema;

  int64_t updates_per_epoch = 0;
  int64_t total_steps = 0;
  double learning_rate = 0;  ///< after scale_lr

  double current_lr() const;
};

TrainParts build_parts(const TrainConfig& config, accel::Accelerator& acc);
/// The image-folder options of the run (resolution, crops, flips, seed, captions) for `dir`.
data::ImageFolderOptions image_folder_options(const TrainConfig& config, const std::string& dir,
                                              int channels);
void print_run_header(const TrainConfig& config, accel::Accelerator& acc, const TrainParts& parts);

/// The loss of one micro-batch: Diffusers' objective with per-sample randomness.
torch::Tensor training_loss(const TrainConfig& config, TrainParts& parts, const data::Batch& batch,
                            int64_t epoch, torch::Device device);

void save_checkpoint(const TrainConfig& config, accel::Accelerator& acc, TrainParts& parts,
                     int64_t global_step);
/// Restores a checkpoint; returns its step.
int64_t load_checkpoint(const std::string& dir, const TrainConfig& config, accel::Accelerator& acc,
                        TrainParts& parts);
void write_run_info(const TrainConfig& config, accel::Accelerator& acc, const TrainParts& parts,
                    const std::filesystem::path& log_dir);
void run_validation(const TrainConfig& config, accel::Accelerator& acc, TrainParts& parts,
                    int64_t global_step, accel::Trackers* trackers);
void export_final(const TrainConfig& config, accel::Accelerator& acc, TrainParts& parts);

}  // namespace difftrain::train
