#pragma once
// `difftrain train`: the ready-made trainer (Diffusers' train_unconditional.py and
// train_text_to_image_lora.py on the Accelerator). The Trainer owns the loop (prepare -> resume ->
// for each update: accumulate, step, log, checkpoint, validate -> export); a TrainingTask
// (training_task.h) supplies what is specific to a model family. See docs/TRAINING.md and
// docs/ARCHITECTURE.md.
#include "difftrain/accel/sharding.h"
#include "difftrain/train/output_folder.h"
#include "difftrain/train/train_config.h"
#include "difftrain/train/training_task.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::train {

/// The loop's settings: made once from a TrainConfig by trainer_options().
struct TrainerOptions {
  // Accelerator
  std::string mixed_precision;  ///< "" = the launcher's / environment's
  int64_t gradient_accumulation_steps = 1;
  uint64_t seed = 0;
  std::optional<accel::ShardingOptions> sharding;  ///< unset: from `difftrain launch`
  // data loader
  int64_t train_batch_size = 16;  ///< per process
  int64_t dataloader_num_workers = 0;
  // optimizer and schedule
  double learning_rate = 1e-3;
  bool scale_lr = false;            ///< times accumulation x batch x processes
  std::string optimizer = "adamw";  ///< adamw | prodigy (any case)
  bool use_8bit_adam = false;
  std::optional<double> prodigy_beta3;
  bool prodigy_decouple = true, prodigy_use_bias_correction = true, prodigy_safeguard_warmup = true;
  double adam_beta1 = 0.95, adam_beta2 = 0.999, adam_weight_decay = 1e-6, adam_epsilon = 1e-8;
  double max_grad_norm = 1.0;  ///< <= 0: no clipping (the norm is still logged)
  std::string lr_scheduler = "cosine";
  int64_t lr_warmup_steps = 100;
  double lr_num_cycles = 1.0;
  double lr_power = 1.0;
  int64_t max_train_steps = 1200;  ///< 0 = num_train_epochs decides
  int64_t num_train_epochs = 1;
  // EMA (Diffusers' EMAModel with warmup)
  bool use_ema = true;
  double ema_max_decay = 0.9999, ema_inv_gamma = 1.0, ema_power = 0.75;
  // outputs
  std::string output_dir;             ///< "" = runs/<UTC time>
  bool overwrite_output_dir = false;  ///< clear a non-empty output_dir first (else refused)
  /// Entries of output_dir that --overwrite_output_dir keeps (the default cache folder, whose
  /// files are keyed by their content); the rest is cleared once every input has been read.
  std::vector<std::string> keep_on_overwrite;
  /// The folders and files the run reads: output_dir may be none of them, hold none of them and
  /// lie inside none of them (check_output_dir_against_inputs).
  std::vector<RunInput> inputs;
  std::string logging_dir = "logs";
  std::string report_to = "all";
  int64_t logging_steps = 20;
  int64_t checkpointing_steps = 400;  ///< 0 = only at the end
  std::optional<int64_t> checkpoints_total_limit;
  std::string resume_from_checkpoint;  ///< a checkpoint folder or "latest"
  /// After every N-th epoch (1-based; not the last, whose save is the run's end): the task's
  /// export in `epoch-<epoch:06d>/` plus checkpoint-<step> (kohya's --save_every_n_epochs). 0: off.
  int64_t save_every_n_epochs = 0;
  /// Keep the newest N epoch saves (and the checkpoints they made); 0: all (kohya's
  /// --save_last_n_epochs).
  int64_t save_last_n_epochs = 0;
  int64_t validation_steps = 400;  ///< 0 = only at the end
  /// Validate after epoch e (0-based) when e % N == 0 (Diffusers' --validation_epochs). 0: off.
  int64_t validation_epochs = 0;
  int64_t num_validation_images = 20;
  std::string final_validation = "auto";  ///< auto | always | never (TrainConfig)
  /// The resolved run configuration: printed first, stored in run_info and every checkpoint.
  nlohmann::json config;
  /// `config` without the options that do not apply to the family (TrainConfig::shown_json()):
  /// what the run header and the model card show ("" = config).
  nlohmann::json shown_config;
  /// The Diffusers script whose defaults the run started from ("" = difftrain's own).
  std::string defaults_from;
  /// Keys of `config` a resume must not change (refused), and keys whose change only breaks
  /// bit-exact continuation (a warning).
  std::vector<std::string> structural_keys, exactness_keys;
  std::vector<std::string> warnings;  ///< printed at start
};

/// What a finished run produced.
struct TrainResult {
  std::string output_dir;
  int64_t global_step = 0;  ///< optimizer updates done
  double last_loss = 0.0;   ///< mean loss of the last update over every rank
};

/// The loop's settings from a validated TrainConfig (the one place flags become options).
TrainerOptions trainer_options(const TrainConfig& config);
/// The task's settings from a validated TrainConfig.
TaskOptions task_options(const TrainConfig& config);

/// Runs a training job: every rank constructs one and calls run().
class Trainer {
 public:
  Trainer(TrainerOptions options, std::unique_ptr<TrainingTask> task);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  /// Builds the Accelerator and the task, prepares, resumes if asked, trains to max_train_steps
  /// (or num_train_epochs), checkpoints, validates, logs, and exports. Throws difftrain::Error
  /// for bad input (before any training where it can be known) and when interrupted by
  /// SIGINT/SIGTERM (after writing a checkpoint).
  TrainResult run();

 private:
  struct State;
  std::unique_ptr<State> s_;
};

/// The newest complete checkpoint-<step> folder under `output_dir` that verifies against its
/// checksums.json (accel::verify_checkpoint), or "" if there is none. Unfinished
/// `checkpoint-<step>.tmp` folders are never chosen; a newer damaged checkpoint is skipped with
/// a warning naming it and the reason.
std::string latest_checkpoint(const std::string& output_dir);

/// Removes the `checkpoint-<step>.tmp` folders an interrupted save left under `output_dir`
/// (logging each). The trainer's main rank calls it at start.
void remove_unfinished_checkpoints(const std::string& output_dir);

}  // namespace difftrain::train
