#pragma once
// The Stable-Diffusion text-to-image task (private to src/families): Diffusers'
// train_text_to_image(_lora).py and train_dreambooth_lora.py on a Stable Diffusion 1.x/2.x
// folder: the frozen VAE and text encoder, captioned images (metadata.jsonl, or one instance
// prompt, plus DreamBooth class images), optionally in aspect-ratio buckets, the latent and
// text-embedding cache, validation renders from a prompt, and the final pipeline folder or LoRA.
// The dataset, buckets, caches and class images are the TextImageData component
// (../text_image_data.h, shared with FLUX.1) and the text encoders a diffusion::TextEncoderStack;
// the bodies are in text_to_image_task.cpp. A family built on the pipeline (SDXL) names its
// PipelineExtension (text encoders, the UNet's added conditioning, the guidance) and computes the
// added conditioning of a batch behind protected virtual hooks, which its task overrides.
#include <torch/torch.h>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <set>
#include "../text_image_data.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/phase.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/data/buckets.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/diffusion/generate.h"
#include "difftrain/diffusion/scheduler_config.h"
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "difftrain/families/unet/diffusion_task.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/train/class_images.h"
#include "difftrain/train/text_image_dataset.h"
#include "difftrain/train/training_cache.h"

namespace difftrain::families::stable_diffusion {

namespace fs = std::filesystem;

using models::module_device;
using models::module_dtype;

class TextToImageTask : public families::unet::DiffusionTask {
 public:
  using families::unet::DiffusionTask::DiffusionTask;

  std::string name() const override { return "text-to-image"; }

  std::function<std::vector<int64_t>(int64_t)> sampler() const override { return data_.sampler(); }

  // Loads the folder's tokenizer, text encoder, VAE and UNet, builds the captioned dataset
  // (generating missing class images first with prior preservation) and, with cache_latents,
  // fills or reuses the cache. Examples carry "index", "pixel_values" [3, R, R] or the cached
  // "latent_mean"/"latent_logvar" [C, r, r], and "input_ids" [L] or the cached "prompt_embeds"
  // [L, D]; with prior preservation the same keys prefixed "class_".
  void build(accel::Accelerator& acc, const std::string& output_dir) override;

  // Latents and caption embeddings of the batch (plus the DreamBooth class half, weighted by
  // prior_loss_weight).
  torch::Tensor loss(const data::Batch& batch, int64_t epoch, torch::Device device) override;

  std::string validation_unavailable() const override { return prompt_validation_unavailable(o_); }

  // --validation_prompt rendered once per index i (image i from seed + i). `mine` is this
  // rank's contiguous range, padded at the end with copies the Trainer discards.
  train::ValidationImages render_validation(const std::vector<int64_t>& mine, int64_t /*begin*/,
                                            const SamplerStepCallback& on_step) override;

  std::vector<std::string> validation_labels(int64_t K) const override {
    return prompt_validation_labels(o_, K);
  }

  std::string validation_note() const override { return " (\"" + o_.validation.prompt + "\")"; }
  bool validation_requested() const override { return !o_.validation.prompt.empty(); }

  void export_to(const fs::path& out) override;

  // Diffusers' train_(dreambooth_)lora / train_text_to_image card: creativeml-openrail-m, tags
  // stable-diffusion and stable-diffusion-diffusers (a family built on it changes its part).
  train::ModelCard model_card() const override;

 protected:
  std::vector<torch::nn::Module*> frozen_modules() const override {
    auto out = text_.modules();
    out.insert(out.begin(), vae_.ptr().get());
    return out;
  }

  // ---- What a family built on the pipeline (SdxlTask, src/families/sdxl/) overrides.
  // The text side itself is the folder's TextEncoderStack (text_): one CLIP or the extension's.

  /// The pipeline extension the family's folders have (null: StableDiffusionPipeline's).
  virtual std::shared_ptr<const PipelineExtension> extension() const { return nullptr; }

  /// The UNet's added conditioning of a batch half whose latents are `latents` (SDXL's time
  /// ids [B, 6]); undefined for StableDiffusionPipeline.
  virtual torch::Tensor time_ids(const data::Batch& /*batch*/, const std::string& /*prefix*/,
                                 const torch::Tensor& /*latents*/) const {
    return {};
  }

  /// The pipeline's own guidance scale (StableDiffusionPipeline's 7.5, or the extension's).
  double default_guidance() const {
    const auto e = extension();
    return e ? e->default_guidance() : 7.5;
  }

  families::stable_diffusion::StableDiffusionFolder folder_;
  diffusion::TextEncoderStack text_;  // the folder's tokenizers and text encoders
  models::AutoencoderKL vae_{nullptr};
  int64_t skip_ = 0;  // Diffusers' clip_skip (kohya's --clip_skip minus 1)

 private:
  // Loads the folder's text encoders (frozen, eval, on acc.device()) and reads --clip_skip.
  void load_text_models(accel::Accelerator& acc);

  families::stable_diffusion::StableDiffusion as_pipeline(
      const diffusion::SchedulerConfig& scheduler, const std::string& sampler);

  // A text-to-image request for `prompt` at the run's resolution, with the validation steps and
  // guidance (1 means the pipeline's: 7.5, or the extension's), image i of it from seed + i.
  diffusion::GenerateRequest render_request(const std::string& prompt) const;

  // Latents and embeddings of one half of a batch (TextImageData), plus time_ids().
  EncodedBatch encode_batch(const data::Batch& batch, const std::string& prefix,
                            const std::vector<int64_t>& keys, int64_t epoch, torch::Device device);

  TextImageData data_{o_};  // the captioned dataset, buckets, caches (text_image_data.h)
};

/// Diffusers' train_text_to_image(_lora).py and train_dreambooth(_lora).py on a Stable Diffusion
/// 1.x/2.x folder (text_to_image_task.cpp).
std::unique_ptr<train::TrainingTask> make_text_to_image_task(train::TaskOptions options);

}  // namespace difftrain::families::stable_diffusion
