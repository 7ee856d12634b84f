#pragma once
// Model families: what difftrain knows about one kind of model (a UNet pipeline, Stable Diffusion
// 1.x/2.x, SDXL; next FLUX.1), each in its own folder (src/families/<name>/) and registered once
// in src/families/registry.cpp. A family says how to recognise its folders (model_index.json's
// `_class_name`, or a bare model's config.json), makes its training task, samples from its
// pipeline, and names the pipeline components a LoRA file adapts. `difftrain train` and
// `difftrain sample` ask the registry which family a folder belongs to; a `_class_name` that no
// family claims is refused in one line that lists the known ones.
//
// docs/ARCHITECTURE.md, "Adding a model family", walks through a new one.

#include "difftrain/diffusion/generate.h"
#include "difftrain/train/train_config.h"
#include "difftrain/train/trainer.h"
#include "difftrain/train/training_task.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::families {

/// What a model folder says about itself.
struct FolderInfo {
  std::string dir;
  bool exists = false;     ///< `dir` is a folder
  bool pipeline = false;   ///< it has a model_index.json that parses as a JSON object
  std::string class_name;  ///< model_index.json's `_class_name` ("" when absent), else the
                           ///< bare model's config.json `_class_name`
  nlohmann::json index;    ///< model_index.json (pipeline folders)
};

/// Reads `dir`'s model_index.json (or config.json). Never throws: a missing folder or an
/// unreadable file gives a FolderInfo the default family handles, with that family's messages.
FolderInfo inspect_folder(const std::string& dir);

/// `difftrain sample`'s request, as the flags give it (README, "difftrain sample").
struct SampleOptions {
  std::string model;
  std::string lora;
  double lora_scale = 1.0;
  std::string scheduler;  ///< "" = the folder's
  int64_t num_inference_steps = 0;
  double eta = 0.0;
  int64_t num_images = 0;
  std::string class_labels;  ///< comma-separated class ids
  double guidance_scale = 1.0;
  bool guidance_given = false;  ///< --guidance_scale was given (else the pipeline's default)
  uint64_t seed = 0;
  // text-to-image
  std::vector<std::string> prompts;
  std::string prompt_file;
  std::string negative_prompt;
  int64_t num_images_per_prompt = 1;
  int64_t height = 0, width = 0;
  int64_t clip_skip = 1;  ///< kohya numbering: 1 = the last layer
  std::string variant;
  std::string device = "auto";  ///< auto | cpu | cuda | cuda:N
  double guidance_rescale = 0.0;
  std::string vae;
  std::vector<int64_t> original_size, crops_coords_top_left, target_size;
  std::vector<int64_t> negative_original_size, negative_crops_coords_top_left, negative_target_size;
  /// Called once the pipeline is loaded, right before the first denoising step.
  std::function<void()> on_start;
  /// Called after each denoising step with (step, steps).
  std::function<void(int64_t, int64_t)> on_step;
};

/// One kind of model.
class ModelFamily {
 public:
  virtual ~ModelFamily() = default;
  /// Short name for logs and docs ("unet", "stable-diffusion", "sdxl").
  virtual std::string name() const = 0;
  /// The model_index.json `_class_name` values of its pipeline folders.
  virtual std::vector<std::string> pipeline_classes() const = 0;
  /// The config.json `_class_name` values of the bare model folders it takes (none by default).
  virtual std::vector<std::string> model_classes() const { return {}; }
  /// For a model_index.json without `_class_name`: whether its components look like this
  /// family's (e.g. a text_encoder_2 entry for SDXL).
  virtual bool matches_components(const nlohmann::json& index) const = 0;
  /// The pipeline components a LoRA file may adapt, by Diffusers' key prefix ("unet",
  /// "text_encoder", ...).
  virtual std::vector<std::string> lora_components() const = 0;
  /// The training task for `options` (nothing is loaded until build()).
  virtual std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const = 0;
  /// Loads the pipeline `options.model` and generates (`difftrain sample`), logging one line of
  /// what it runs. Throws difftrain::Error for bad input.
  virtual diffusion::GenerateResult sample(const SampleOptions& options) const = 0;
};

/// Every registered family, in the order folders are matched.
const std::vector<const ModelFamily*>& families();
/// The family of the folder `dir`: by model_index.json's `_class_name`, by the bare model's
/// config.json, by the components of a model_index.json without `_class_name`, and the UNet
/// family for anything else (which then reports what is wrong with the folder). Throws
/// difftrain::Error naming the class and every known one when no family claims `_class_name`.
const ModelFamily& family_of(const std::string& dir);
/// The family trained when there is no pretrained folder (a UNet built from a config).
const ModelFamily& default_family();

/// The task `options` describe: its pretrained folder's family, else the default family's.
std::unique_ptr<train::TrainingTask> make_training_task(const train::TaskOptions& options);
/// Runs the training job `config` describes (Trainer + make_training_task). Every rank calls it.
train::TrainResult run_training(train::TrainConfig config);

}  // namespace difftrain::families
