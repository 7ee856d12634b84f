#pragma once
// The data side of a text-to-image training task, a component the Stable Diffusion / SDXL task
// (stable_diffusion/text_to_image_task.h) and the FLUX.1 task (flux/flux_task.cpp) compose: the
// captioned dataset (instance images, DreamBooth class images generated with the family's own
// pipeline when missing), aspect-ratio buckets, the latent and text-embedding caches, and the
// latents and prompt embeddings of a batch. Private to src/families. The family loads its VAE
// and text encoders and hands them over (Parts); what it does with the encodings (a UNet's
// conditioning, FLUX's packed tokens) stays in the family's task.
#include <torch/torch.h>
#include <filesystem>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>
#include "difftrain/accel/accelerator.h"
#include "difftrain/data/buckets.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/train/model_card.h"
#include "difftrain/train/text_image_dataset.h"
#include "difftrain/train/text_image_options.h"
#include "difftrain/train/training_cache.h"
#include "difftrain/train/training_task.h"
#include "pipeline_folder.h"

namespace difftrain::families {

/// The latents [B, C, h, w] (scaled and shifted for the denoiser) and text embeddings [B, L, D]
/// of one half of a batch; the pooled embeddings [B, P] where the encoders give one (SDXL,
/// FLUX.1); SDXL's time ids [B, 6] (filled by its task).
/// What the text-to-image data side needs of a VAE: its module (device, dtype, freezing), the
/// posterior of pixel values [B, 3, H, W] (float32 on the CPU; moved to the VAE) over latents
/// [B, C, h, w], and the latents training sees from a posterior draw (AutoencoderKL: scaled and
/// shifted; Qwen-Image's causal VAE: one frame, normalised by its per-channel statistics).
struct ImageVae {
  std::shared_ptr<torch::nn::Module> module;
  train::PixelEncoder encode;
  std::function<torch::Tensor(const torch::Tensor& z)> scale;
  explicit operator bool() const { return module != nullptr; }
};

/// The ImageVae of an AutoencoderKL (scale_latents).
ImageVae image_vae(const models::AutoencoderKL& vae);

struct EncodedBatch {
  torch::Tensor latents;
  torch::Tensor embeds;
  torch::Tensor pooled, time_ids;
  /// [B, L], 1 = a real token, where the composition keeps the mask (a decoder LLM's embeddings,
  /// each caption cut to its real tokens by the family).
  torch::Tensor attention_mask;
  /// --masked_loss: [B, 1, H, W] in [0, 1] at pixel resolution (class rows all ones), for
  /// TrainingObjective::losses(); undefined without.
  torch::Tensor loss_mask;
};

class TextImageData {
 public:
  /// What the family loaded for its data: the frozen VAE (on the device) and where it came from
  /// (the cache key), the task's text-encoder stack (the task may release its models once the
  /// text cache is filled), Diffusers' clip_skip, and the multiple every image side must be (the
  /// VAE's downsampling factor; FLUX.1 twice that, for its 2x2 patches).
  struct Parts {
    ImageVae vae;
    std::string vae_dir, vae_variant;
    diffusion::TextEncoderStack* text = nullptr;
    int64_t clip_skip = 0;
    int64_t size_multiple = 8;
    std::string size_reason = "the VAE's downsampling factor";
    /// The latents are the VAE posterior's mode (its mean: train_dreambooth_lora_z_image.py's
    /// `latent_dist.mode()`) instead of a draw from it (the SD, SDXL and FLUX.1 scripts'
    /// `latent_dist.sample()`).
    bool latent_mode = false;
    /// Why this run serves captions from a text-embedding cache ("" = the caller's
    /// cache_text is a choice it drops for captions that change every epoch: --shuffle_caption,
    /// --caption_tag_dropout_rate; such a run then encodes each batch's captions).
    std::string text_cache_reason;
  };
  /// Draws `count` class images [count, H, W, 3] in [0, 1] with the class prompt, image i from
  /// seed + i (the family's pipeline).
  using ClassImages = std::function<torch::Tensor(int64_t count, uint64_t seed)>;

  explicit TextImageData(train::TaskOptions options) : o_(std::move(options)) {}

  /// The flags a captioned-image run refuses before anything loads (another --dataset,
  /// --cache_latents with random crops or flips, buckets with prior preservation); `model`
  /// names the folder in the message.
  static void check_options(const train::TaskOptions& o, const std::string& model);

  /// Builds the dataset: checks the resolution against parts.size_multiple, generates missing
  /// class images (prior preservation), assigns buckets, fills the latent cache (--cache_latents)
  /// and, with `cache_text`, the text-embedding cache, which then replaces token ids.
  void build(accel::Accelerator& acc, const std::string& output_dir, Parts parts,
             const ClassImages& class_images, bool cache_text);
  /// Whether build() filled the text-embedding cache (the task may then release its encoders).
  bool text_cache_filled() const { return text_cache_filled_; }

  /// Latents and text embeddings of one half of a batch (`prefix` "" or "class_"): cached or
  /// encoded now (the VAE under no-grad; the text encoders with grad when they train), each
  /// sample's posterior draw from sample_generator(seed, epoch, key, kLatent).
  EncodedBatch encode(const data::Batch& batch, const std::string& prefix,
                      const std::vector<int64_t>& keys, int64_t epoch, torch::Device device);

  /// The batch's instance rows and, under prior preservation, their class rows after them
  /// (latents, embeddings, pooled embeddings and masks concatenated); `keys` receives every row's
  /// sample key, instances first.
  EncodedBatch encode_batch(const data::Batch& batch, int64_t epoch, torch::Device device,
                            std::vector<int64_t>& keys);
  /// The mean of per-sample `losses` [N], or, under prior preservation (instances first, then as
  /// many class rows), the instances' mean + prior_loss_weight x the class rows' mean.
  torch::Tensor reduce_losses(const torch::Tensor& losses) const;

  std::shared_ptr<data::Dataset> dataset() const { return dataset_; }
  void set_epoch(int64_t epoch) { dataset_->set_epoch(epoch); }
  /// The bucket order of epoch e (empty without buckets).
  std::function<std::vector<int64_t>(int64_t)> sampler() const;
  /// DreamBooth prior preservation: batches carry class_* entries too.
  bool prior() const { return prior_; }
  /// Whether batches carry cached text embeddings instead of token ids.
  bool text_cached() const { return !dataset_->cached_text.empty(); }

  /// The cached entries of each caption (no grad), float32 on the CPU: "prompt_embeds" [N, L, D],
  /// with a pooled embedding "pooled_prompt_embeds" [N, P], and where the composition keeps the
  /// token mask "prompt_attention_mask" [N, L] (int64).
  std::map<std::string, torch::Tensor> encode_captions(const std::vector<std::string>& captions);

 private:
  train::CaptionIds caption_ids() const;
  diffusion::PromptEmbeds encode_ids(const data::Batch& batch, const std::string& prefix);
  std::string text_cache_key() const;
  void assign_buckets(accel::Accelerator& acc, data::ImageFolderDataset& images,
                      train::TextImageDataset& ds);
  // The latent cache (--cache_latents) and the text-embedding cache (cache_text).
  void fill_cache(accel::Accelerator& acc, train::TextImageDataset& ds,
                  const std::string& output_dir, bool cache_text);

  train::TaskOptions o_;
  Parts parts_;
  std::shared_ptr<train::TextImageDataset> dataset_;
  std::shared_ptr<data::BucketLayout> buckets_;
  bool prior_ = false;
  bool text_cache_filled_ = false;
};

/// The validation every text-to-image task renders: --validation_prompt, image i from seed + i.
/// Why a run cannot (no prompt given; "" when it can), and the grid's labels ("seed S").
std::string prompt_validation_unavailable(const train::TaskOptions& o);
std::vector<std::string> prompt_validation_labels(const train::TaskOptions& o, int64_t K);

/// A transformer family's text-to-image training task, the parts FLUX.1's and Z-Image's share:
/// the options with the text-to-image group read back, the data (TextImageData: its dataset,
/// bucket order and epochs) and the --validation_prompt renders' bookkeeping. The family's task
/// loads its models in build() and says what trains, how the loss is made and what is exported.
class TextImageTask : public train::TrainingTask {
 public:
  explicit TextImageTask(train::TaskOptions options)
      : o_(train::with_text_image_options(std::move(options))), data_(o_) {}

  std::shared_ptr<data::Dataset> dataset() const override { return data_.dataset(); }
  std::function<std::vector<int64_t>(int64_t)> sampler() const override { return data_.sampler(); }
  void set_epoch(int64_t epoch) override { data_.set_epoch(epoch); }
  std::string validation_unavailable() const override { return prompt_validation_unavailable(o_); }
  std::vector<std::string> validation_labels(int64_t K) const override {
    return prompt_validation_labels(o_, K);
  }
  std::string validation_note() const override { return " (\"" + o_.validation.prompt + "\")"; }
  bool validation_requested() const override { return !o_.validation.prompt.empty(); }

 protected:
  /// The model card of a one-transformer family's run (Z-Image, Qwen-Image), as their scripts'
  /// save_model_card: `family` in the title, Apache-2.0, the tags, `pipeline_class` in the
  /// snippet (bf16), the LoRA targets.
  train::ModelCard transformer_model_card(const std::string& family, const std::string& script,
                                          const std::string& tag, const std::string& pipeline_class,
                                          const std::vector<std::string>& lora_targets) const;
  /// Exports such a run: the LoRA file in --lora_format (kohya names through `to_kohya`), or,
  /// for a full fine-tune, `transformer`'s weights with the folder's other parts: a
  /// `pipeline_class` folder.
  void export_transformer_run(const std::filesystem::path& out, const TransformerFolder& folder,
                              const torch::nn::Module& transformer, const models::LoraLayers& lora,
                              const std::function<void(io::LoraWeights&)>& to_kohya,
                              const std::string& pipeline_class) const;

  train::TaskOptions o_;
  TextImageData data_;
};

/// Writes a transformer LoRA run's adapters as out/pytorch_lora_weights.safetensors in
/// o.lora.format (diffusers: the pipeline's save_lora_weights; peft; kohya; comfyui), `adapt`
/// renaming Diffusers' module names into the format's (kohya's and ComfyUI's forms of the
/// family's original names) before kohya and comfyui files are written.
void write_transformer_lora(const std::filesystem::path& out, const train::TaskOptions& o,
                            const models::LoraLayers& lora,
                            const std::function<void(io::LoraWeights&, io::LoraFormat)>& adapt);

/// A fine-tuned pipeline folder's frozen parts: each of `parts` (folders: "vae", "scheduler",
/// the text encoders and tokenizers) copied from the pretrained folder `src` into `out` as they
/// came, and `src`'s model_index.json. Throws difftrain::Error naming a part that cannot be
/// copied.
void copy_pipeline_parts(const std::filesystem::path& src, const std::filesystem::path& out,
                         const std::vector<std::string>& parts);

}  // namespace difftrain::families
