#pragma once
// A base for the training task of a UNet family: the UNet being trained, the DDPM noise scheduler
// and objective, the denoising loss with per-sample random streams, LoRA adapters, the
// checkpoint's config files and the LoRA export. The built-in families derive from it
// (src/families/unet/unet_task.cpp; src/families/stable_diffusion/text_to_image_task.h, which
// src/families/sdxl/sdxl_task.cpp derives from in turn). A family whose denoiser is not a UNet
// derives from TrainingTask (training_task.h) and composes diffusion::TrainingObjective and
// diffusion::Denoiser itself. docs/ARCHITECTURE.md, "Adding a model family".
#include "difftrain/data/image_folder.h"
#include "difftrain/diffusion/noise_scheduler.h"
#include "difftrain/diffusion/objective.h"
#include "difftrain/families/unet/denoiser.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/unets/unet.h"
#include "difftrain/train/text_image_dataset.h"
#include "difftrain/train/training_task.h"

#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::families::unet {

class DiffusionTask : public train::TrainingTask {
 public:
  /// The DDPM objective's options (o_.noise) come from the family's (train/ddpm_options.h), when
  /// options.family declares them; else as given.
  explicit DiffusionTask(train::TaskOptions options);

  std::shared_ptr<data::Dataset> dataset() const override { return dataset_; }
  void set_epoch(int64_t epoch) override { set_epoch_(epoch); }
  std::shared_ptr<torch::nn::Module> trainable() const override { return trainable_; }
  std::string parameter_summary() const override;
  int64_t frozen_bytes() const override;
  void write_to_checkpoint(const std::filesystem::path& dir) const override;

 protected:
  /// DDPMScheduler for training: the pretrained folder's scheduler config when it has one, else
  /// the flags' (ddpm_num_steps, ddpm_beta_schedule); prediction_type from the flags. Then the
  /// DDPM objective on it (min-SNR, noise offset, input perturbation from the flags).
  void build_noise_scheduler();
  /// What trains: LoRA adapters on the UNet (and on `text_encoder` with train_text_encoder,
  /// both under one module) or the whole UNet. Then, under bf16, the frozen weights (the LoRA
  /// base and frozen_modules()) move to bf16: half the memory, while what trains stays fp32.
  /// SDXL: `text_encoder_2` gets its own adapters too (under "text_encoder_2").
  void build_trainable(accel::Accelerator& acc, torch::nn::Module* text_encoder,
                       torch::nn::Module* text_encoder_2 = nullptr);
  /// Frozen modules besides the UNet (the VAE, the text encoder).
  virtual std::vector<torch::nn::Module*> frozen_modules() const { return {}; }

  /// The objective (objective_) on x0 [B, ...] with each sample's random draws from its own
  /// stream `keys[i]`, the denoiser (the UNet) conditioned on `cond`: the per-sample loss [B]
  /// (mean over every non-batch dimension, weighted as the objective says), float32.
  torch::Tensor denoising_losses(const torch::Tensor& x0, const std::vector<int64_t>& keys,
                                 int64_t epoch, torch::Device device,
                                 const diffusion::Conditioning& cond,
                                 const torch::Tensor& loss_mask = {});

  /// Writes pytorch_lora_weights.safetensors (UNet adapters, plus the text encoders') in `out`;
  /// kohya format for an SDXL UNet uses SGM module names.
  void export_lora(const std::filesystem::path& out) const;

  train::TaskOptions o_;
  std::shared_ptr<data::Dataset> dataset_;
  std::function<void(int64_t)> set_epoch_;
  models::UNet unet_{nullptr};
  models::LoraLayers lora_{nullptr};
  models::LoraLayers text_lora_{nullptr};    ///< adapters on the text encoder, else null
  models::LoraLayers text_lora_2_{nullptr};  ///< SDXL: adapters on text_encoder_2, else null
  std::shared_ptr<torch::nn::Module> trainable_;
  std::shared_ptr<diffusion::NoiseScheduler> noise_scheduler_;
  std::shared_ptr<diffusion::TrainingObjective> objective_;
  std::unique_ptr<diffusion::Denoiser> denoiser_;  ///< the UNet, made on first use
};

}  // namespace difftrain::families::unet
