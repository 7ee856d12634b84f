#pragma once
// Model families: what difftrain knows about one kind of model, each in its own folder
// (src/families/<name>/, registered by DIFFTRAIN_BUILTIN_FAMILY in its family.cpp) or in a
// program of its own (register_family() before difftrain's command line runs). A family says how to
// recognise its folders (model_index.json's
// `_class_name`, or a bare model's config.json), makes its training task, samples from its
// pipeline, and names the pipeline components a LoRA file adapts. `difftrain train` and
// `difftrain sample` ask the registry which family a folder belongs to; a `_class_name` that no
// family claims is refused in one line that lists the known ones.
//
// docs/ARCHITECTURE.md, "Adding a model family", walks through a new one.

#include "difftrain/diffusion/generate.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/lora_layout.h"
#include "difftrain/models/lora/lora_folder.h"
#include "difftrain/train/memory_estimate.h"
#include "difftrain/train/train_config.h"
#include "difftrain/train/trainer.h"
#include "difftrain/train/training_task.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
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

/// `difftrain sample`'s request, as the flags give it (docs/COMMANDS.md, "difftrain sample"); the
/// base holds how to load the pipeline (scheduler, eta, lora, lora_scale, variant, vae).
struct SampleOptions : diffusion::PipelineLoadOptions {
  std::string model;
  int64_t num_inference_steps = 0;
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
  int64_t clip_skip = 1;        ///< kohya numbering: 1 = the last layer
  std::string device = "auto";  ///< auto | cpu | cuda | cuda:N
  double guidance_rescale = 0.0;
  /// The family options given as flags (ModelFamily::sample_options()): name -> the texts, one
  /// per value as the command line split them. families::sample() parses them for the model's
  /// family into `family`, and refuses another family's, naming it.
  std::map<std::string, std::vector<std::string>> family_flags;
  /// The model's family's sample options with their values (given, else the defaults).
  train::FamilyOptions family;
  /// Called once the pipeline is loaded, right before the first denoising step.
  std::function<void()> on_start;
  /// Called after each denoising step with (step, steps).
  std::function<void(int64_t, int64_t)> on_step;
};

/// A command of a family's own on difftrain's command line (`difftrain NAME --flag V ...`), for
/// what only that family does (the UNet family's `eval`, which scores Fashion-MNIST models). Its
/// flags are train::OptionSpecs, given and checked as `difftrain sample`'s family options are;
/// run() receives them parsed, with the defaults of those not given, and returns what the command
/// prints on stdout as JSON (null: nothing). It throws difftrain::Error for bad input.
struct FamilyCommand {
  std::string name;  ///< the subcommand, e.g. "eval"
  std::string help;  ///< one line for `difftrain --help`
  std::vector<train::OptionSpec> options;
  std::function<nlohmann::json(const train::FamilyOptions& options)> run;
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
  /// When several families' matches_components() accept one model_index.json, the highest rank
  /// wins: a family whose components include another's ranks above it (two CLIPs above one).
  virtual int component_match_rank() const { return 0; }
  /// The family of folders no family claims (it reports what is wrong with them) and of runs
  /// without a pretrained folder. Exactly one registered family says so.
  virtual bool is_default() const { return false; }
  /// The pipeline components a LoRA file may adapt, by Diffusers' key prefix ("unet",
  /// "text_encoder", ...).
  virtual std::vector<std::string> lora_components() const = 0;
  /// The component of lora_components() whose modules Diffusers' oldest LoRA layout names bare,
  /// without the component ahead ("" = none; the UNet-based families' UNet).
  virtual std::string lora_bare_component() const { return ""; }
  /// The --lora_format values its training runs export (diffusers, peft, kohya by default; a
  /// family that writes ComfyUI's diffusion_model. keys adds "comfyui"). parse_train_config()
  /// refuses the others in one line naming the families that write them.
  virtual std::vector<std::string> lora_export_formats() const {
    return {"diffusers", "peft", "kohya"};
  }
  /// The family's own key layouts of LoRA files (FLUX.1's ComfyUI / XLabs keys), which
  /// io::read_lora() rewrites into a generic layout once the family is registered (none by
  /// default). Its kohya or BFL module names are the family's to resolve (adapt_lora).
  virtual std::vector<io::LoraKeyLayout> lora_key_layouts() const { return {}; }
  /// Prepares `lora` for writing in `format` for the model folder `dir` (`difftrain lora
  /// convert --model`): resolves kohya module names against the folder's weight names (read from
  /// the safetensors headers only) and applies the family's foreign key layout (SDXL: kohya names
  /// the UNet's modules in SGM form).
  virtual void adapt_lora(io::LoraWeights& lora, const std::string& dir,
                          io::LoraFormat format) const = 0;
  /// `difftrain lora merge`: a copy of the model folder `dir` with the LoRA file folded into the
  /// components it adapts, written to `output_dir` (atomically; models/lora_folder.h).
  virtual models::LoraFolderMergeSummary merge_lora(
      const std::string& dir, const std::string& lora, const std::string& output_dir,
      const models::LoraFolderMergeOptions& options) const = 0;
  /// `difftrain forward`: one forward of the family's denoiser in `dir` (with `lora` merged at
  /// `lora_scale` when given) on named tensors read from `source`, in eval mode under no-grad.
  /// The default throws difftrain::Error: a family overrides this or forward_outputs().
  virtual torch::Tensor forward(const std::string& dir,
                                const std::map<std::string, torch::Tensor>& inputs,
                                const std::string& source, const std::string& lora,
                                double lora_scale) const;
  /// `difftrain forward`'s named outputs: {"out": forward(...)} by default; a denoiser that takes
  /// and returns lists (Z-Image: one latent per sample) gives "out.<i>" instead.
  virtual std::map<std::string, torch::Tensor> forward_outputs(
      const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
      const std::string& source, const std::string& lora, double lora_scale) const {
    return {{"out", forward(dir, inputs, source, lora, lora_scale)}};
  }
  /// `difftrain estimate-memory`: the per-rank memory of training the model of `model_path` (a
  /// folder, or a bare model's config.json) under each of `strategies`, in that order.
  virtual std::vector<train::MemoryEstimate> estimate_memory(
      const std::string& model_path, const train::MemoryEstimateOptions& options,
      const std::vector<accel::ShardingStrategy>& strategies) const = 0;
  /// Loads the pipeline folder `dir` (float32, on the CPU): the family's Pipeline, with
  /// options.lora merged. Throws difftrain::Error naming what is wrong with the folder.
  virtual std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string& dir, const diffusion::PipelineLoadOptions& options) const = 0;
  /// The defaults of the Diffusers training script that a run of `config` on this family follows
  /// (by --lora and --instance_prompt: LoRA or full, DreamBooth or captioned images), applied by
  /// parse_train_config() to the options not given (with ScriptDefaults::family_options, the
  /// family's own); nullopt keeps TrainConfig's own (train_unconditional.py's, the UNet family).
  virtual std::optional<train::ScriptDefaults> training_defaults(
      const train::TrainConfig& /*config*/) const {
    return std::nullopt;
  }
  /// The `difftrain train` options of this family's runs beyond the trainer's (train::OptionSpec:
  /// name, type, default, help, check), its own and those of the components it composes (e.g.
  /// train::flow_matching_option_specs()). A run receives them parsed in TrainConfig::family and
  /// TaskOptions::family; another family's run refuses them, naming this family.
  virtual std::vector<train::OptionSpec> options() const { return {}; }
  /// Called by parse_train_config() once the flags, the files and training_defaults() are read
  /// (a run without --pretrained_model_name_or_path: on the default family): sets what depends
  /// on the run itself (the UNet family's recipe for the built-in job), for the options not given
  /// (config.given), and refuses combinations of the family's options with the trainer's in one
  /// line (difftrain::Error). The config is completed and validated again afterwards.
  virtual void configure_training(train::TrainConfig& /*config*/) const {}
  /// What a run of this family does instead of another family's training option `name` (a
  /// flow-matching family for the DDPM objective's: its weighting), appended to the refusal of
  /// that option; "" = nothing to add.
  virtual std::string instead_of_option(const std::string& /*name*/) const { return ""; }
  /// The `difftrain sample` options of this family's pipelines beyond the common ones (prompts,
  /// steps, guidance, size, seed, scheduler, LoRA, dtype, device): Diffusers' `__call__` names,
  /// with OptionSpec::values for flags that take several (e.g. `--original_size H W`). sample()
  /// receives them parsed in SampleOptions::family; another family's folder refuses them.
  virtual std::vector<train::OptionSpec> sample_options() const { return {}; }
  /// Commands of the family's own on difftrain's command line (none by default).
  virtual std::vector<FamilyCommand> commands() const { return {}; }
  /// Other tools' training flags for what the family has (kohya's `--t5xxl_max_token_length`):
  /// flag name without dashes -> difftrain's option and how to use it (or, after a '!', what to
  /// do instead). `difftrain train` refuses such a flag in one line that points there.
  virtual std::map<std::string, std::string> other_tools_options() const { return {}; }
  /// The training task for `options` (nothing is loaded until build()).
  virtual std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const = 0;
  /// Loads the pipeline `options.model` (load_pipeline), checks the request against it, moves it
  /// to options.device and generates (`difftrain sample`), logging one line of what it runs.
  /// Throws difftrain::Error for bad input.
  virtual diffusion::GenerateResult sample(const SampleOptions& options) const = 0;
};

/// Adds `family` to the registry. The built-in families are registered by their folders
/// (DIFFTRAIN_BUILTIN_FAMILY); a program that brings its own family calls this before
/// difftrain's command line (cli/main.h: difftrain::cli::run) or the library's entry points.
/// Throws difftrain::Error when a registered family has the same name, claims one of its
/// pipeline or model classes, or is also the default.
void register_family(std::unique_ptr<ModelFamily> family);

/// Every registered family: the built-in ones (by folder name), then those register_family()
/// added, in that order.
const std::vector<const ModelFamily*>& families();
/// The registered family named `name`, or nullptr.
const ModelFamily* find_family(const std::string& name);
/// The family of the folder `dir`: by model_index.json's `_class_name`, by the bare model's
/// config.json, by the components of a model_index.json without `_class_name`, and the UNet
/// family for anything else (which then reports what is wrong with the folder). Throws
/// difftrain::Error naming the class and every known one when no family claims `_class_name`.
const ModelFamily& family_of(const std::string& dir);
/// The family trained when there is no pretrained folder (ModelFamily::is_default()).
const ModelFamily& default_family();

/// The task `options` describe: its pretrained folder's family, else the default family's.
std::unique_ptr<train::TrainingTask> make_training_task(const train::TaskOptions& options);
/// Refuses a LoRA file made for another kind of model: when `lora` has no target for the
/// denoiser of the model folder `model`'s family (its first lora_components() entry) but has
/// targets for a component that family does not have (an SD UNet LoRA given to FLUX.1), throws
/// difftrain::Error naming the families whose denoiser it targets. A LoRA with denoiser targets,
/// or with targets only for the family's own text encoders, passes (unmatched components are
/// warned about where it is merged).
void check_lora_fits_family(const io::LoraWeights& lora, const std::string& lora_path,
                            const std::string& model);

/// What convert_lora() did.
struct LoraConversion {
  io::LoraFormat read_format = io::LoraFormat::kDiffusers;  ///< the input's layout
  std::string read_label;  ///< the input's layout as named to users (io::format_label)
  std::map<std::string, size_t> targets;  ///< targets written, by component
};

/// `difftrain lora convert`: reads the LoRA file `input` (any layout io::read_lora takes) and
/// writes it to `output` in `format`; with a model folder `model`, its family adapts the names
/// first (ModelFamily::adapt_lora). Throws difftrain::Error for a bad file or folder.
LoraConversion convert_lora(const std::string& input, const std::string& output,
                            io::LoraFormat format, const std::string& model = "");

/// The family options of a `difftrain sample` of `model` (a folder of `family`): the flags in
/// `flags` parsed against family.sample_options(), the rest their defaults. Throws
/// difftrain::Error for a flag the family does not take, naming the families that do, or a bad
/// value.
train::FamilyOptions sample_family_options(
    const ModelFamily& family, const std::map<std::string, std::vector<std::string>>& flags,
    const std::string& model);

/// `values`' flags parsed against `specs` (each flag's texts, one per value), the rest their
/// defaults, then every check: the options of a family's command or sample. Throws
/// difftrain::Error for a flag no spec has or a bad value.
train::FamilyOptions parse_family_flags(
    const std::string& family, std::vector<train::OptionSpec> specs,
    const std::map<std::string, std::vector<std::string>>& values);

/// Every registered family's sample options, by name, each with the families that declare it
/// (the union `difftrain sample` offers as flags).
std::vector<std::pair<train::OptionSpec, std::vector<std::string>>> all_sample_options();

/// `difftrain sample`: family_of(options.model).sample(options), timed from the first denoising
/// step, with a progress line (step, it/s, ETA) every two seconds and at the end. `seconds` is
/// the generation time.
diffusion::GenerateResult sample(SampleOptions options, double* seconds = nullptr);

/// Where `difftrain sample` writes its results.
struct SampleOutputs {
  /// The labelled PNG grid (a clip is a row of its frames), or, for clips, a video file by its
  /// extension (io::write_video: .mp4 .mkv .mov .webm .webp .gif; several clips as
  /// `<stem>_<k><ext>`). "" picks the default: samples.png, or samples.mp4 for clips.
  std::string grid;
  int64_t columns = 0;  ///< grid columns (0: about square)
  std::string tensors;  ///< "": none; else GenerateResult::tensors() as safetensors
  /// Clips: also every frame as a PNG under this folder (`<k>/frame_<i>.png`, k the clip); "" none.
  std::string frames_dir;
  double fps = 0;  ///< a video file's frame rate; 0: the model's (GenerateResult::fps)
};

/// sample(), then the grid (and the tensors) written, with a closing log line (images/s).
void sample_to_files(const SampleOptions& options, const SampleOutputs& outputs);

/// --device: "auto" (the first CUDA device when one is visible, else the CPU), "cpu", "cuda" or
/// "cuda:N", as in Diffusers' pipe.to(device). Throws difftrain::Error for anything else or a
/// CUDA device that is not there.
torch::Device parse_sample_device(const std::string& text);

/// The prompts of a text-to-image `difftrain sample`: --prompt (repeatable) or --prompt_file
/// (io::read_prompt_file's rules), at least one; `folder_kind` (e.g. "Stable Diffusion") names
/// the folder in the error without any.
std::vector<std::string> sample_prompts(const SampleOptions& a, const std::string& folder_kind);

/// The module names of the safetensors file `path`'s weights (its keys ending in ".weight", that
/// suffix cut), read from the header alone: what kohya names resolve against.
std::vector<std::string> safetensors_module_names(const std::string& path);

/// ModelFamily::adapt_lora's part for a text encoder: the LoRA's kohya names of `component`
/// resolved against dir/`component`/model.safetensors' weight names, when the LoRA has targets
/// for it and the folder is there.
void adapt_text_encoder_lora(io::LoraWeights& lora, const std::string& dir,
                             const std::string& component);

/// --dtype: fp32/float32 (unset), bf16/bfloat16 or fp16/float16. Throws difftrain::Error for
/// anything else.
std::optional<torch::Dtype> parse_sample_dtype(const std::string& text);

/// `difftrain train`'s options: train::parse_train_config(args), then the defaults of the
/// pretrained folder's family (ModelFamily::training_defaults) for the options not given.
/// Throws difftrain::Error for bad options or an unknown family.
train::TrainConfig parse_train_config(const std::vector<std::string>& args);

/// What train::parse_train_config() needs to read the options of a run's family from the
/// registry (ModelFamily::options()), and to name the family of an option the run's has not.
train::FamilyOptionLookup family_option_lookup();

/// Runs the training job `config` describes (Trainer + make_training_task). Every rank calls it.
train::TrainResult run_training(train::TrainConfig config);

}  // namespace difftrain::families

/// In a built-in family's family.cpp, inside namespace difftrain::families: registers `Class`
/// (default-constructed) under the folder's name, `folder` (src/families/<folder>/). The build
/// calls one register_builtin_family_<folder>() per folder that has a family.cpp (generated
/// builtin_families.cpp), so no list of families is written anywhere.
#define DIFFTRAIN_BUILTIN_FAMILY(folder, Class) \
  void register_builtin_family_##folder() { register_family(std::make_unique<Class>()); }
