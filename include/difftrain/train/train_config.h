#pragma once
// The configuration of `difftrain train`: every trainer option under the name Diffusers' training
// scripts give it (train_unconditional.py, train_text_to_image_lora.py), read from a YAML file and
// then from command-line flags that override it, and the options of the run's family
// (TrainConfig::family: the objective's, e.g. train/ddpm_options.h, and the family's own). See
// docs/TRAINING.md for the table.
#include "difftrain/settings/sharding_options.h"
#include "difftrain/train/option_spec.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace difftrain::train {

/// Every option of the trainer, with its default. Optional fields are "not given".
struct TrainConfig {
  // -- model
  /// config.json of a fresh model of the default family ("" = built-in)
  std::string model_config_name_or_path;
  std::string pretrained_model_name_or_path;  ///< a local Diffusers folder to start from
  std::string variant;
  /// An AutoencoderKL folder used instead of the pipeline's vae/ (Diffusers'
  /// --pretrained_vae_model_name_or_path; SDXL's fp16-safe VAE).
  std::string pretrained_vae_model_name_or_path;  ///< weights variant, e.g. fp16
  // -- data
  std::string dataset = "fashion_mnist";  ///< fashion_mnist | mnist | imagefolder
  std::string train_data_dir;             ///< dataset folder ("" = the dataset's default)
  int64_t resolution = 32;
  /// `--resolution W,H` (kohya's width,height) with W != H: fixed W x H crops, or with
  /// --resolution_buckets buckets of about W x H pixels (resolution becomes round(sqrt(W H)), as
  /// kohya's bucket area). 0 = square. Shown in the configuration as "W,H".
  int64_t resolution_width = 0, resolution_height = 0;
  bool center_crop = false;
  /// Aspect-ratio buckets (data/buckets.h) instead of square crops: each image is trained at
  /// the bucket of about resolution x resolution pixels nearest its shape.
  bool resolution_buckets = false;
  int64_t bucket_step = 64;     ///< bucket sides are multiples of this
  int64_t bucket_min_side = 0;  ///< 0 = resolution / 2
  int64_t bucket_max_side = 0;  ///< 0 = 2 x resolution
  bool random_flip = false;
  int64_t max_train_samples = 0;  ///< 0 = all
  /// Each image used this many times per epoch (kohya's --dataset_repeats, Diffusers' --repeats;
  /// both names are read), on top of kohya `<N>_<name>` folders' N.
  int64_t dataset_repeats = 1;
  bool skip_bad_images = false;
  int64_t dataloader_num_workers = 0;
  // -- schedule of the run
  int64_t train_batch_size = 16;  ///< per process
  int64_t num_train_epochs = 1;
  /// Optimizer updates; 0 = num_train_epochs decides. The default 1200 applies only when neither
  /// is given: --num_train_epochs alone sets this to 0, as Diffusers derives the steps from it.
  int64_t max_train_steps = 1200;
  int64_t gradient_accumulation_steps = 1;
  bool gradient_checkpointing = false;
  // -- optimizer
  double learning_rate = 1e-3;
  bool scale_lr = false;
  std::string lr_scheduler = "cosine";
  int64_t lr_warmup_steps = 100;
  double lr_num_cycles = 1.0;
  double lr_power = 1.0;
  /// adamw | prodigy (Diffusers' --optimizer, any case); use_8bit_adam makes AdamW 8-bit.
  std::string optimizer = "adamw";
  bool use_8bit_adam = false;
  /// Prodigy's settings (Diffusers' FLUX/SD3 scripts' flags); null beta3: sqrt(adam_beta2).
  std::optional<double> prodigy_beta3;
  bool prodigy_decouple = true;
  bool prodigy_use_bias_correction = true;
  bool prodigy_safeguard_warmup = true;
  double adam_beta1 = 0.95;
  double adam_beta2 = 0.999;
  double adam_weight_decay = 1e-6;
  double adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;
  /// no | bf16 | fp16; "" = what `difftrain launch --mixed_precision` set, else no.
  std::string mixed_precision;
  // -- EMA
  bool use_ema = true;
  std::optional<double> ema_decay;  ///< alias of ema_max_decay
  double ema_inv_gamma = 1.0;
  double ema_power = 0.75;
  double ema_max_decay = 0.9999;
  // -- checkpoints
  int64_t checkpointing_steps = 400;  ///< 0 = only at the end
  std::optional<int64_t> checkpoints_total_limit;
  std::string resume_from_checkpoint;  ///< a checkpoint folder or "latest"
  /// kohya's --save_every_n_epochs: after every N-th epoch (1-based, not the last) the export
  /// in epoch-<epoch:06d>/ and a checkpoint; given alone, checkpointing_steps' default is 0.
  std::optional<int64_t> save_every_n_epochs;
  /// kohya's --save_last_n_epochs: keep the newest N epoch saves (needs save_every_n_epochs).
  std::optional<int64_t> save_last_n_epochs;
  // -- validation and logging
  int64_t validation_steps = 400;  ///< 0 = only at the end
  /// Diffusers' --validation_epochs: validate after epoch e (0-based) when e % N == 0; given
  /// alone, validation_steps' default is 0.
  std::optional<int64_t> validation_epochs;
  int64_t num_validation_images = 20;
  /// Validation after the last update: "auto" renders it when the run trained at least
  /// validation_steps updates, validation_steps is 0, or a validation prompt was given (a short
  /// smoke run skips it and says so); "always"; "never".
  std::string final_validation = "auto";
  /// Validation guidance (unset: the pipeline's own, e.g. UNet 1, SD 7.5, SDXL 5); a family whose
  /// model embeds the guidance also trains with it (unset: its script's default). A fresh UNet
  /// needs a null class to guide against (the UNet family's --class_dropout_prob).
  std::optional<double> guidance_scale;
  int64_t validation_inference_steps = 50;  ///< sampler steps of validation sampling
  /// The validation sampler: a diffusion::sampler_names() name or Diffusers scheduler class, built
  /// from the training noise scheduler's config; "" = that config's own class (DDPMScheduler).
  std::string validation_scheduler = "ddim";
  int64_t logging_steps = 20;  ///< progress line every N updates
  uint64_t seed = 0;
  std::string output_dir;  ///< "" = runs/<timestamp>
  /// Clear an output_dir that already holds files (another run's) before training, as
  /// Transformers' --overwrite_output_dir; without it such a folder is refused unless resumed.
  bool overwrite_output_dir = false;
  std::string logging_dir = "logs";  ///< relative to output_dir
  std::string report_to = "all";     ///< tensorboard | jsonl | all | none
  // -- LoRA
  bool lora = false;
  int64_t rank = 4;
  std::optional<double> lora_alpha;  ///< default: rank
  double lora_dropout = 0.0;
  std::vector<std::string> lora_target_modules = {"to_q", "to_k", "to_v", "to_out.0"};
  /// diffusers | peft | kohya | comfyui (the families whose runs write it:
  /// ModelFamily::lora_export_formats)
  std::string lora_format = "diffusers";
  /// LoRA: the frozen base's Linear/Conv weights in 8 bits (kohya's --fp8_base): none | int8 |
  /// fp8_e4m3 (LibTorch 2.1+).
  std::string base_weights_dtype = "none";
  /// Diffusers' FLUX/SD3 --lora_layers: comma-separated module names (suffixes) of the
  /// transformer; "" = lora_target_modules when changed from its default, else the family's
  /// default list.
  std::string lora_layers;
  /// Where a run keeps what it caches (VAE latents, text embeddings): "" = <output_dir>/cache,
  /// which --overwrite_output_dir keeps.
  std::string cache_dir;
  // The text-to-image families' options (captions, DreamBooth, --cache_latents, the text
  // encoder's LoRA, clip_skip, the validation prompt) are theirs, a group they declare:
  // train/text_image_options.h.
  // -- sharding (docs/SHARDING.md; Accelerate's FSDP plugin / DeepSpeed ZeRO stages)
  /// NO_SHARD | SHARD_OPTIMIZER | SHARD_GRAD_OP | FULL_SHARD (also FSDP numbers 1-3 and
  /// zero0..zero3); stored as the canonical name after parsing.
  std::string sharding_strategy = "NO_SHARD";
  /// TRANSFORMER_BASED_WRAP | SIZE_BASED_WRAP | NO_WRAP (Accelerate's fsdp_auto_wrap_policy).
  std::string fsdp_auto_wrap_policy = "TRANSFORMER_BASED_WRAP";
  /// Comma-separated class names to wrap ("" = ResnetBlock2D, Transformer2DModel, Attention).
  std::string fsdp_transformer_layer_cls_to_wrap;
  int64_t fsdp_min_num_params = 100000000;  ///< SIZE_BASED_WRAP threshold
  bool fsdp_forward_prefetch = true;
  bool fsdp_backward_prefetch = true;  ///< BACKWARD_PRE when true, NO_PREFETCH when false
  bool sync_each_batch = false;        ///< reduce-scatter every micro-step under accumulation
  /// none | cpu: ZeRO-Offload of the fp32 master shards, their gradients and the optimizer state
  /// to host memory, the step on the CPU (Accelerate's --offload_optimizer_device; needs a
  /// sharding strategy, or one process).
  std::string offload_optimizer_device = "none";
  /// none | cpu: FULL_SHARD's parameter shards in host memory too (--offload_param_device).
  std::string offload_param_device = "none";
  /// A DeepSpeed JSON config whose ZeRO stage, fp16/bf16, gradient_accumulation_steps,
  /// gradient_clipping and train_micro_batch_size_per_gpu fill the options not set explicitly.
  std::string deepspeed_config;
  /// An Accelerate config YAML (FSDP or DEEPSPEED) read the same way (Accelerate's
  /// --config_file of `accelerate launch`).
  std::string accelerate_config_file;

  /// The options the run's family declares (ModelFamily::options()), with their values: given,
  /// else the family's defaults. Shown and saved with the trainer's (to_json()).
  FamilyOptions family;

  /// Not an option: what parse_train_config() could not honour in deepspeed_config /
  /// accelerate_config_file, and explicit options that won over them; one line each, printed by
  /// the trainer on the main rank.
  std::vector<std::string> warnings;

  /// Not an option: the names of the options the YAML file or a flag set (parse_train_config());
  /// a family's script defaults (apply_script_defaults()) fill only the others.
  std::set<std::string> given;
  /// Not an option: the Diffusers script whose defaults the run started from ("" = difftrain's
  /// own: the built-in job, train_unconditional.py's for a UNet); the run header names it.
  std::string defaults_from;
  /// Not an option: trainer options that do not apply to the run's family (the UNet validation
  /// sampler for a flow-matching model, EMA settings without EMA, LoRA settings without LoRA):
  /// left out of the configuration the run header and the model card show.
  std::set<std::string> not_applicable;

  /// The sharding options of the fields above (classes split on commas); include
  /// difftrain/accel/sharding.h to call it.
  settings::ShardingOptions sharding_options() const;

  /// Every option as JSON (unset optionals as null), the family's included.
  nlohmann::json to_json() const;
  /// to_json() without the options in not_applicable: what the run header and model card show.
  nlohmann::json shown_json() const;
  /// Throws difftrain::Error (one line) for impossible values and combinations.
  void validate() const;
};

/// The argparse defaults of the Diffusers training script a family's run follows
/// (train_dreambooth_lora_flux.py, train_text_to_image_lora_sdxl.py, ...), for the options a run
/// was not given. Diffusers' `--max_train_steps None` is max_train_steps 0 (the epochs decide).
struct ScriptDefaults {
  std::string script;  ///< the script's file name, e.g. "train_dreambooth_lora.py"
  int64_t resolution = 512;
  int64_t train_batch_size = 4;
  int64_t num_train_epochs = 1;
  double learning_rate = 1e-4;
  std::string lr_scheduler = "constant";
  int64_t lr_warmup_steps = 500;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.999;
  double adam_weight_decay = 1e-2;
  double adam_epsilon = 1e-8;
  int64_t checkpointing_steps = 500;
  int64_t num_validation_images = 4;
  bool use_ema = false;  ///< Diffusers' --use_ema is store_true where the script has it
  /// The LoRA targets the script adapts (empty: keep lora_target_modules' default); not set when
  /// --lora_layers is given.
  std::vector<std::string> lora_target_modules;
  /// Options that do not apply to the family (TrainConfig::not_applicable).
  std::vector<std::string> not_applicable;
  /// Defaults of the family's own options (TrainConfig::family) for this script, for those not
  /// given: name -> value.
  nlohmann::json family_options = nlohmann::json::object();
};

/// Sets every field of `defaults` whose option `config` was not given (config.given), records
/// the script in config.defaults_from and the family's not-applicable options, and validates
/// the result. Throws difftrain::Error as TrainConfig::validate() does.
void apply_script_defaults(TrainConfig& config, const ScriptDefaults& defaults);

/// Reads `--config FILE.yaml` (if among `args`) and then the flags in `args` (without the
/// program and command names): `--name value`, `--name=value`, bare `--flag` for booleans.
/// Names the trainer does not have are looked up in the options of the run's family
/// (`lookup.options_for(--pretrained_model_name_or_path)`, into TrainConfig::family); an option
/// another family declares is refused in one line naming that family (`lookup.owner_of`).
/// Then deepspeed_config / accelerate_config_file (if given; a DeepSpeed file wins over an
/// Accelerate one) fill the sharding options, mixed_precision, gradient_accumulation_steps,
/// max_grad_norm and train_batch_size that the YAML and flags did not set (explicit wins, with a
/// warning when they differ; "auto" in the file keeps difftrain's value).
/// Unknown names (with the closest known one suggested), wrong types and missing values throw
/// difftrain::Error before any work. The result is validated.
TrainConfig parse_train_config(const std::vector<std::string>& args,
                               const FamilyOptionLookup& lookup = {});

/// Names of every trainer option, for help text: {name, type, default as text}.
std::vector<std::vector<std::string>> train_option_table();
/// The same rows for a family's options, then its help line: {name, type, default, help}.
std::vector<std::vector<std::string>> family_option_table(const std::vector<OptionSpec>& specs);

}  // namespace difftrain::train
