#pragma once
// The README.md model card `difftrain train` writes next to every export (a Diffusers pipeline
// folder or a LoRA file), in the Hugging Face Hub's format as Diffusers' training scripts'
// save_model_card() writes it (huggingface_hub's ModelCardData + load_or_create_model_card +
// populate_model_card): YAML front matter (base_model, library_name, license, tags,
// instance_prompt, widget), then a Markdown body (description, training details, how to use it
// in Diffusers and in `difftrain sample`). The validation images of the final render are written
// beside it as image_<i>.png, which the widget entries name.
//
// The model family fills its part (TrainingTask::model_card(): licence, tags, pipeline class,
// how to load and sample it), add_task_details() the rows a TaskOptions decides (LoRA, data,
// resolution), and the Trainer the run's part (model_card_run()). docs/TRAINING.md, "Model card".

#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::train {

struct TaskOptions;
struct TrainerOptions;

/// The run's side of a card: what the Trainer knows (the loop's settings and the world size).
struct ModelCardRun {
  int64_t updates = 0;          ///< optimizer updates done (Diffusers' global_step)
  int64_t per_rank_batch = 1;   ///< --train_batch_size
  int64_t ranks = 1;            ///< processes (Accelerate's num_processes)
  int64_t accumulation = 1;     ///< --gradient_accumulation_steps
  std::string mixed_precision;  ///< no | fp16 | bf16
  double learning_rate = 0.0;   ///< as given (before --scale_lr)
  bool scale_lr = false;
  std::string lr_scheduler;  ///< Diffusers' schedule name
  int64_t lr_warmup_steps = 0;
  std::string optimizer;  ///< "AdamW", "8-bit AdamW", "Prodigy"
  bool ema = false;
  uint64_t seed = 0;
  std::string command;      ///< the `difftrain train` command line ("" = unknown)
  std::string config_json;  ///< the resolved configuration (JSON), for reproduction
  std::string output_dir;   ///< where the export lies (used in the usage snippets)
};

/// A model card: the family's part, the rows of the training details and the run's part.
struct ModelCard {
  // ---- the family (TrainingTask::model_card())
  std::string title;        ///< the card's heading, e.g. "<family> LoRA text-to-image"
  std::string description;  ///< one paragraph: what was trained on what
  /// --pretrained_model_name_or_path as given (Diffusers' base_model); "" = trained from
  /// scratch: no base_model key, and the body says so.
  std::string base_model;
  std::string license;            ///< Hub licence id: mit, creativeml-openrail-m, openrail++, other
  std::string license_note;       ///< Markdown for the body's licence section ("" = none)
  std::vector<std::string> tags;  ///< task and family tags; the writer adds the common ones
  std::string pipeline_class;     ///< Diffusers class of the usage snippet (DDPMPipeline, ...)
  std::string torch_dtype;        ///< e.g. "torch.bfloat16" in the snippet ("" = default)
  bool lora = false;              ///< the export is a LoRA file (tags lora, template:sd-lora)
  std::string lora_weight_name;   ///< that file's name (pytorch_lora_weights.safetensors)
  /// The Python statement loading the LoRA into `pipeline` (default pipeline.load_lora_weights);
  /// it is called as <loader>(<folder>, weight_name=<file><lora_loader_args>).
  std::string lora_loader = "pipeline.load_lora_weights";
  std::string lora_loader_args;
  std::string instance_prompt;  ///< DreamBooth: the instance_prompt key and the trigger words
  std::string prompt;           ///< the validation prompt: every widget's text ("" = labels)
  /// The snippet's lines after loading, ending with a PIL `image` ("" = pipeline(prompt)).
  std::string python_generate;
  std::vector<std::string> sample_flags;  ///< `difftrain sample` flags besides --model/--lora
  /// Rows of the training-details table (name, value), in order: the task's, then the run's.
  std::vector<std::pair<std::string, std::string>> details;

  // ---- the run (model_card_run(), by the Trainer)
  ModelCardRun run;
  /// One text per validation image written beside the card (image_<i>.png); empty = no widget.
  std::vector<std::string> widget_texts;
};

/// Adds the rows a run's TaskOptions decides to card.details (dataset, resolution, buckets,
/// LoRA rank/alpha/targets/format, DreamBooth, validation) and card.instance_prompt / prompt.
void add_task_details(ModelCard& card, const TaskOptions& o);

/// The prompt a text-to-image card's usage snippets show: the validation prompt, else the
/// instance prompt, else "your prompt".
std::string card_prompt(const TaskOptions& o);

/// Replaces the value of the details row `name` (or adds the row).
void set_card_detail(ModelCard& card, const std::string& name, const std::string& value);

/// The run's part of a card from the Trainer's options, its world size, its resolved mixed
/// precision and the updates done; the command is core::user_command().
ModelCardRun model_card_run(const TrainerOptions& o, int64_t ranks,
                            const std::string& mixed_precision, int64_t updates);

/// The README.md text of `card`: YAML front matter (valid YAML whatever the prompts hold) and
/// the Markdown body.
std::string render_model_card(const ModelCard& card);

/// Writes `images` (float [K, H, W, C] in [0, 1], or undefined for none) as dir/image_<i>.png,
/// the widget texts (card.prompt, else labels[i], else " ", as Diffusers' scripts), and
/// dir/README.md (atomically). Main rank only.
void write_model_card(const std::filesystem::path& dir, ModelCard card,
                      const torch::Tensor& images = {},
                      const std::vector<std::string>& labels = {});

}  // namespace difftrain::train
