#pragma once
// The text-to-image side of `difftrain train` (Diffusers' train_text_to_image_lora.py and
// train_dreambooth_lora.py): a Stable Diffusion folder's frozen VAE and text encoder, captioned
// images (metadata.jsonl, or one instance prompt, plus DreamBooth class images), the latent and
// text-embedding cache, and validation renders from a prompt.

#include "difftrain/accel/accelerator.h"
#include "difftrain/data/dataset.h"
#include "difftrain/diffusion/scheduler_config.h"
#include "difftrain/diffusion/sd_pipeline.h"
#include "difftrain/models/lora_training.h"
#include "difftrain/train/train_config.h"

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::train {

/// The frozen parts of the pipeline and what was cached from them.
struct TextToImageParts {
  diffusion::StableDiffusionFolder folder;
  models::ClipTokenizer tokenizer;
  models::ClipTextModel text_encoder{nullptr};
  models::AutoencoderKL vae{nullptr};
  /// LoRA adapters on the text encoder (--train_text_encoder), else null.
  models::LoraLayers text_lora{nullptr};
  /// Diffusers' clip_skip (kohya's --clip_skip minus 1).
  int64_t skip = 0;
  bool prior = false;  ///< DreamBooth prior preservation: batches carry class_* entries too
  bool latents_cached = false;
  bool embeddings_cached = false;
};

/// Loads the folder's tokenizer, text encoder, VAE and UNet (into `unet`), builds the captioned
/// dataset (generating missing class images first with prior preservation) and, with
/// --cache_latents, fills or reuses the cache; every rank calls it. Examples carry "index",
/// "pixel_values" [3, R, R] or the cached "latent_mean"/"latent_logvar" [C, r, r], and
/// "input_ids" [L] or the cached "prompt_embeds" [L, D]; with prior preservation the same keys
/// prefixed "class_".
std::shared_ptr<TextToImageParts> build_text_to_image(const TrainConfig& c, accel::Accelerator& acc,
                                                      models::UNet& unet,
                                                      std::shared_ptr<data::Dataset>& dataset,
                                                      std::function<void(int64_t)>& set_epoch);

/// The per-sample random-stream key of the class half of example `index` (DreamBooth).
int64_t class_key(int64_t index);

/// The latents [B, C, h, w] (scaled for the UNet) and text embeddings [B, L, D] of one half of a
/// batch (`prefix` "" or "class_"): cached or encoded now (the VAE and frozen text encoder under
/// no-grad), with each sample's posterior draw from sample_generator(seed, epoch, key,
/// kLatent).
struct EncodedBatch {
  torch::Tensor latents;
  torch::Tensor embeds;
};
EncodedBatch encode_batch(const TrainConfig& c, TextToImageParts& t2i,
                          const std::map<std::string, torch::Tensor>& batch,
                          const std::string& prefix, const std::vector<int64_t>& keys,
                          int64_t epoch, torch::Device device);

/// Renders `count` images of --validation_prompt (image i from seed + i, DDIM with
/// validation_inference_steps) with the current UNet (and adapters): [count, H, W, 3] in [0, 1].
torch::Tensor render_validation(const TrainConfig& c, TextToImageParts& t2i, models::UNet& unet,
                                const diffusion::SchedulerConfig& scheduler,
                                const std::vector<int64_t>& image_indices);

/// Writes the final full-training pipeline: `unet_dir` already holds the trained UNet; copies
/// vae/, text_encoder/, tokenizer/ and scheduler/ from the source folder and writes
/// model_index.json (StableDiffusionPipeline).
void export_text_to_image_pipeline(const TextToImageParts& t2i, const std::string& out_dir);

}  // namespace difftrain::train
