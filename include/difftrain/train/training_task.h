#pragma once
// What differs between model families in `difftrain train`: the dataset and its collation, the
// models to build or load and which of them train, the loss of a batch, validation renders and
// the export. The Trainer (trainer.h) owns the loop, the optimizer, the schedules, EMA,
// checkpoints and logs, and talks to the model family only through a TrainingTask.
//
// Each model family (families/family.h) makes its own task: the built-in ones are the
// unconditional / class-conditional UNet (Diffusers' train_unconditional.py), Stable Diffusion
// text-to-image, LoRA and DreamBooth (train_text_to_image(_lora).py, train_dreambooth_lora.py),
// and SDXL (the _sdxl versions of those scripts). A new family (a flow-matching transformer) is
// one more TrainingTask in its own folder. See docs/ARCHITECTURE.md, "Adding a model family".

#include "difftrain/accel/accelerator.h"
#include "difftrain/data/dataset.h"
#include "difftrain/diffusion/objective.h"
#include "difftrain/models/block_swap.h"
#include "difftrain/train/caption_processing.h"
#include "difftrain/train/model_card.h"
#include "difftrain/train/option_spec.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::train {

/// The training data (Diffusers' --dataset_name/--train_data_dir and preprocessing flags).
struct DataOptions {
  std::string dataset = "fashion_mnist";  ///< fashion_mnist | mnist | imagefolder
  std::string train_data_dir;             ///< "" = the dataset's default folder
  int64_t resolution = 32;
  /// --resolution W,H (kohya's form) without buckets: every image cropped to width x height;
  /// 0 = resolution x resolution. height() / width() give the crop either way.
  int64_t crop_width = 0, crop_height = 0;
  int64_t height() const { return crop_height > 0 ? crop_height : resolution; }
  int64_t width() const { return crop_width > 0 ? crop_width : resolution; }
  bool center_crop = false;
  bool random_flip = false;
  bool resolution_buckets = false;  ///< aspect-ratio buckets (data/buckets.h)
  int64_t bucket_step = 64, bucket_min_side = 0, bucket_max_side = 0;
  int64_t train_batch_size = 1;  ///< per rank; a bucket fills whole global batches
  bool skip_bad_images = false;
  std::string caption_column = "text";     ///< metadata.jsonl field holding a caption
  std::string caption_extension = ".txt";  ///< kohya's sidecar caption files ("" = none)
  /// MNIST-like data: one class only (the UNet family's --only_class, set by its task).
  std::optional<int64_t> only_class;
  int64_t max_train_samples = 0;  ///< 0 = all
  /// Each image of an image folder used this many times per epoch (kohya's --dataset_repeats),
  /// on top of kohya <N>_<name> folders' own N.
  int64_t dataset_repeats = 1;
  /// kohya's --masked_loss: examples carry a "mask" (data::ImageFolderOptions::masks) from
  /// conditioning_data_dir, metadata.jsonl's "mask" or the images' alpha.
  bool masked_loss = false;
  std::string conditioning_data_dir;
  uint64_t seed = 0;  ///< augmentation streams
};

/// The model to train: a fresh UNet (built-in or --model_config_name_or_path) or a pretrained
/// Diffusers folder.
struct ModelOptions {
  std::string pretrained_model_name_or_path;
  std::string model_config_name_or_path;
  std::string variant;  ///< weights variant, e.g. fp16
  std::string vae;      ///< a separate VAE folder ("" = the pipeline's vae/)
  /// LoRA runs: how the frozen base's Linear/Conv weights (denoiser and text encoders) are
  /// stored: none | int8 | fp8_e4m3 (models/quantized_weight.h).
  std::string base_weights_dtype = "none";
  /// The UNet family's class labels (its --class_conditional, --class_dropout_prob, set by its
  /// task from TaskOptions::family): default when the dataset has labels; labels replaced by
  /// the null class.
  std::optional<bool> class_conditional;
  double class_dropout_prob = 0.0;
  bool gradient_checkpointing = false;
};

/// The denoising objective (noise scheduler and loss flags of Diffusers' scripts): the DDPM
/// objective's family options (train/ddpm_options.h, read by the UNet-based families' tasks) and
/// the per-sample streams' seed (every task's).
struct NoiseOptions {
  std::string prediction_type = "epsilon";  ///< epsilon | v_prediction | sample
  int64_t ddpm_num_steps = 1000;            ///< when the pretrained folder has no scheduler
  std::string ddpm_beta_schedule = "linear";
  std::optional<double> snr_gamma;  ///< min-SNR weighting
  double noise_offset = 0.0;
  double input_perturbation = 0.0;
  int64_t multires_noise_iterations = 0;  ///< kohya's multires noise (0: none)
  double multires_noise_discount = 0.3;
  diffusion::LossOptions loss;  ///< --loss_type and its Huber schedule
  uint64_t seed = 0;            ///< per-sample noise / timestep streams
};

/// LoRA fine-tuning (PEFT LoraConfig on the UNet, and on the text encoder with
/// train_text_encoder).
struct LoraOptions {
  bool enabled = false;
  int64_t rank = 4;
  double alpha = 4.0;
  double dropout = 0.0;
  std::vector<std::string> target_modules = {"to_q", "to_k", "to_v", "to_out.0"};
  std::string format = "diffusers";  ///< diffusers | peft | kohya (the exported file)
  /// Diffusers' FLUX --lora_layers (module names); empty = target_modules when changed from
  /// their default, else the family's own list.
  std::vector<std::string> layers;
  bool target_modules_given = false;  ///< target_modules differ from the default
  bool train_text_encoder = false;
  std::vector<std::string> text_encoder_target_modules;
};

/// Validation renders.
struct ValidationOptions {
  int64_t num_images = 20;
  int64_t inference_steps = 50;
  double guidance_scale = 1.0;  ///< 1 = the pipeline's own
  /// --guidance_scale as given (unset: the pipeline's own; a family whose model embeds the
  /// guidance trains with it too, unset: its script's default).
  std::optional<double> guidance_scale_given;
  std::string scheduler = "ddim";  ///< sampler name (diffusion::sampler_names())
  std::string prompt;              ///< text-to-image only ("" = no validation renders)
  std::string negative_prompt;
  uint64_t seed = 0;
};

/// Text-to-image and DreamBooth options.
struct TextOptions {
  std::string instance_prompt;  ///< one caption for every image
  bool with_prior_preservation = false;
  std::string class_data_dir;
  std::string class_prompt;
  double prior_loss_weight = 1.0;
  int64_t num_class_images = 100;
  bool cache_latents = false;
  std::string cache_dir;  ///< "" = <output_dir>/cache
  int64_t clip_skip = 1;  ///< kohya numbering: 1 = last layer
  /// Caption prefix / suffix, dropout, shuffling and tag dropout of the instance captions.
  CaptionProcessing captions;
};

/// Everything a task is built from; made once from a TrainConfig by task_options().
struct TaskOptions {
  DataOptions data;
  ModelOptions model;
  NoiseOptions noise;
  LoraOptions lora;
  ValidationOptions validation;
  TextOptions text;
  int64_t encode_batch_size = 16;  ///< images per VAE call when caching latents
  /// The options the family declares (ModelFamily::options()), with the run's values.
  FamilyOptions family;
};

/// This rank's share of a validation grid.
struct ValidationImages {
  /// float32 in [0, 1]: images [k, H, W, C] or clips [k, F, H, W, C] (an image is one frame;
  /// the trainer's grid shows a clip as a row of its frames).
  torch::Tensor images;
};

/// One model family's side of a training run. The Trainer calls, in order: build() on every
/// rank, then loss() for every micro-batch, render_validation() when validating,
/// write_to_checkpoint() inside each save, and export_to() at the end.
class TrainingTask {
 public:
  virtual ~TrainingTask() = default;

  /// Short name for logs ("unconditional", "text-to-image").
  virtual std::string name() const = 0;

  /// Builds or loads the models on acc.device() (frozen ones in bf16 under bf16 mixed
  /// precision), the dataset, and what trains (the UNet, or LoRA adapters). Every rank calls it;
  /// it may use collectives (e.g. to split class-image generation). Throws difftrain::Error for
  /// bad input.
  /// `output_dir` is the run's folder (caches default to a folder under it).
  virtual void build(accel::Accelerator& acc, const std::string& output_dir) = 0;

  /// The training examples (each carries "index" and the tensors loss() reads).
  virtual std::shared_ptr<data::Dataset> dataset() const = 0;
  /// The order of the dataset in epoch e when it is not a plain shuffle (aspect-ratio buckets:
  /// every global batch from one bucket); empty = torch's randperm from seed + e. It must be a
  /// function of e alone (every rank, every resume).
  virtual std::function<std::vector<int64_t>(int64_t)> sampler() const { return {}; }
  /// Sets the augmentation epoch of the dataset.
  virtual void set_epoch(int64_t epoch) = 0;
  /// Labels of the dataset (0: unlabelled); for the run header.
  virtual int64_t num_classes() const { return 0; }

  /// What is trained, prepared by the Accelerator, optimised and checkpointed.
  virtual std::shared_ptr<torch::nn::Module> trainable() const = 0;
  /// The run header's parameter count, e.g. "parameters 1234 (trainable 56, LoRA)".
  virtual std::string parameter_summary() const = 0;
  /// Bytes held by frozen weights the Accelerator does not prepare (run_info.json).
  virtual int64_t frozen_bytes() const = 0;
  /// The denoiser's block swap (--blocks_to_swap, models/block_swap.h), or nullptr: its bytes
  /// go to run_info.json.
  virtual const models::BlockSwap* block_swap() const { return nullptr; }

  /// The loss of one micro-batch (a scalar), under the Accelerator's autocast. `epoch` keys the
  /// per-sample random streams.
  virtual torch::Tensor loss(const data::Batch& batch, int64_t epoch, torch::Device device) = 0;

  /// Why this run cannot render validation images ("" when it can).
  virtual std::string validation_unavailable() const { return ""; }
  /// Called after each sampler step of a validation render with (step, steps): progress lines,
  /// and abandoning the render for a checkpoint when the run is asked to stop (it throws).
  using SamplerStepCallback = std::function<void(int64_t, int64_t)>;
  /// Renders images `mine` (indices into 0..K-1; `begin` is the first index of this rank's
  /// range) with the current weights, calling `on_step` after every sampler step. Every rank
  /// calls it with its share.
  virtual ValidationImages render_validation(const std::vector<int64_t>& mine, int64_t begin,
                                             const SamplerStepCallback& on_step) = 0;
  /// Labels of the K images of a validation grid, and its columns (0: about square).
  virtual std::vector<std::string> validation_labels(int64_t K) const = 0;
  virtual int64_t validation_columns() const { return 0; }
  /// What the validation log line adds after "validation samples" (e.g. the prompt).
  virtual std::string validation_note() const { return ""; }
  /// Clips: the frame rate of the MP4s written beside the grid (the model's training rate).
  virtual double validation_fps() const { return 16.0; }
  /// Whether the run asked for validation renders itself (a text-to-image --validation_prompt):
  /// `--final_validation auto` then renders them even after a run shorter than
  /// --validation_steps.
  virtual bool validation_requested() const { return false; }

  /// Adds the task's files (e.g. config.json) to a checkpoint being written in `dir`; called on
  /// the main rank inside Accelerator::save_state.
  virtual void write_to_checkpoint(const std::filesystem::path& dir) const = 0;
  /// Writes the final artefact (a Diffusers pipeline folder or a LoRA file) into `out_dir`,
  /// weights already holding the EMA average when EMA is used. Main rank only.
  virtual void export_to(const std::filesystem::path& out_dir) = 0;
  /// The family's part of the README.md model card written beside the export (model_card.h):
  /// title, description, base model, licence, tags, the Diffusers pipeline class and how to
  /// load and sample it, and add_task_details()'s rows. The Trainer adds the run's part and the
  /// validation images. Called on the main rank after export_to(). The default: a card with
  /// the task's name, licence "other" and the generic DiffusionPipeline.
  virtual ModelCard model_card() const;
};

/// Bytes held by the parameters of `m` that do not require grad and by its 8-bit frozen weights
/// (models/quantized_weight.h): a task's frozen_bytes().
int64_t frozen_parameter_bytes(const torch::nn::Module& m);

/// --base_weights_dtype: stores the frozen Linear/Conv weights of `modules` (a LoRA run's base
/// and its text encoders, adapters attached or not) in 8 bits (models/quantized_weight.h) and
/// prints what it saved on the main rank; "none" does nothing.
void quantize_frozen_base(accel::Accelerator& acc, const std::string& base_weights_dtype,
                          const std::vector<torch::nn::Module*>& modules);

/// The run header's count, "parameters N (trainable T[, LoRA])", of `model` trained through
/// `trainable`: the model itself, or (lora) adapters held outside it, added to the total.
std::string parameter_summary(const torch::nn::Module& model, const torch::nn::Module& trainable,
                              bool lora);

}  // namespace difftrain::train
