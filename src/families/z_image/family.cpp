// The Z-Image family: ZImagePipeline folders (Z-Image-Turbo, sampled without guidance in 8 steps,
// and Z-Image Base with classifier-free guidance) and bare ZImageTransformer2DModel folders.
// Sampling in z_image_pipeline.cpp, LoRA layouts in lora.cpp, `difftrain forward` in forward.cpp.
#include "difftrain/families/family.h"
#include "../dit_lora.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/lora_merge.h"
#include "difftrain/train/block_swap_option.h"
#include "difftrain/train/ddpm_options.h"
#include "difftrain/train/flow_matching_options.h"
#include "difftrain/train/text_image_options.h"
#include "z_image_pipeline.h"
#include "z_image_task.h"

#include <fmt/format.h>

#include <torch/torch.h>

#include <cmath>

namespace difftrain::families {
namespace {

// ZImagePipeline's cfg_normalization: a bool or a number k (the CFG prediction's norm is clipped
// to k |pos|); false = 0, true = 1.
double cfg_normalization_value(const nlohmann::json& v, const std::string& where) {
  const std::string text = v.get<std::string>();
  if (text == "false" || text == "False" || text == "0") return 0.0;
  if (text == "true" || text == "True") return 1.0;
  try {
    size_t used = 0;
    const double k = std::stod(text, &used);
    if (used == text.size() && std::isfinite(k) && k >= 0) return k;
  } catch (const std::exception&) {
  }
  throw Error(where + " is \"" + text +
              "\": expected true, false or a number k >= 0 (the CFG prediction's norm is kept "
              "within k x the conditional one's)");
}

bool z_image_has_component(const nlohmann::json& index, const char* name) {
  return index.contains(name) && index[name].is_array() && index[name].size() == 2 &&
         !index[name][0].is_null();
}

class ZImageFamily : public ModelFamily {
 public:
  std::string name() const override { return "z-image"; }
  std::vector<std::string> pipeline_classes() const override { return {"ZImagePipeline"}; }
  std::vector<std::string> model_classes() const override { return {"ZImageTransformer2DModel"}; }
  bool matches_components(const nlohmann::json& index) const override {
    // A transformer conditioned by a decoder LLM (Qwen3Model), without a second text encoder.
    return z_image_has_component(index, "transformer") &&
           z_image_has_component(index, "text_encoder") &&
           index["text_encoder"][1] == "Qwen3Model" && !index.contains("text_encoder_2");
  }
  int component_match_rank() const override { return 4; }
  std::vector<std::string> lora_components() const override { return {"transformer"}; }
  std::vector<std::string> lora_export_formats() const override {
    return {"diffusers", "peft", "kohya", "comfyui"};
  }
  std::vector<io::LoraKeyLayout> lora_key_layouts() const override {
    return {z_image::z_image_lora_key_layout()};
  }
  void adapt_lora(io::LoraWeights& lora, const std::string& dir,
                  io::LoraFormat format) const override {
    z_image::adapt_z_image_lora(lora, dir, format);
  }
  models::LoraFolderMergeSummary merge_lora(
      const std::string& dir, const std::string& lora, const std::string& output_dir,
      const models::LoraFolderMergeOptions& options) const override {
    return merge_dit_lora("Z-Image", z_image::read_z_image_lora, dir, lora, output_dir, options);
  }
  std::map<std::string, torch::Tensor> forward_outputs(
      const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
      const std::string& source, const std::string& lora, double lora_scale) const override {
    return z_image::forward_z_image(dir, inputs, source, lora, lora_scale);
  }
  std::vector<train::MemoryEstimate> estimate_memory(
      const std::string& model_path, const train::MemoryEstimateOptions& options,
      const std::vector<accel::ShardingStrategy>& strategies) const override {
    return z_image::estimate_z_image_memory(model_path, options, strategies);
  }
  std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string& dir, const diffusion::PipelineLoadOptions& options) const override {
    return std::make_unique<z_image::ZImagePipeline>(z_image::load_z_image_pipeline(dir, options));
  }
  std::vector<train::OptionSpec> sample_options() const override {
    train::OptionSpec normalization{
        "cfg_normalization", "string", "false",
        "ZImagePipeline's cfg_normalization: true keeps the guided prediction's norm within the "
        "conditional one's (a number k: within k x it); default false",
        [](const nlohmann::json& v, const std::string& where) {
          cfg_normalization_value(v, where);
        }};
    train::OptionSpec truncation{
        "cfg_truncation", "float", 1.0,
        "ZImagePipeline's cfg_truncation: steps past this fraction of the schedule run without "
        "guidance (default 1: never)",
        train::range_check(0, 1e9)};
    train::OptionSpec length{"max_sequence_length", "int?", nullptr,
                             "text tokens per prompt, the chat template's included, padded or "
                             "cut (default 512)",
                             train::range_check(1, 1 << 20)};
    return {std::move(normalization), std::move(truncation), std::move(length)};
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const override {
    return z_image::make_z_image_training_task(options);
  }
  std::optional<train::ScriptDefaults> training_defaults(
      const train::TrainConfig& /*config*/) const override {
    // train_dreambooth_lora_z_image.py (its full fine-tuning is the same run without --lora).
    train::ScriptDefaults d;
    d.script = "train_dreambooth_lora_z_image.py";
    d.resolution = 512;
    d.train_batch_size = 4;
    d.num_train_epochs = 1;
    d.learning_rate = 1e-4;
    d.adam_weight_decay = 1e-4;
    d.lora_target_modules = z_image::default_z_image_lora_targets();
    d.not_applicable = {"validation_scheduler"};
    return d;
  }
  std::string instead_of_option(const std::string& name) const override {
    if (name == "clip_skip") {
      return "Z-Image takes its Qwen3's hidden_states[-2], so there is no CLIP layer to skip";
    }
    for (const auto& spec : train::ddpm_option_specs()) {
      if (spec.name == name) {
        return "Z-Image trains with flow matching: weigh it with --weighting_scheme (none, "
               "logit_normal, mode, cosmap, sigma_sqrt) or --timestep_sampling";
      }
    }
    return "";
  }
  std::map<std::string, std::string> other_tools_options() const override {
    auto table = train::text_image_other_tools_options();
    table.emplace("unet_lr", "--learning_rate");
    table.emplace("min_snr_gamma",
                  "!Z-Image trains with flow matching: weigh it with --weighting_scheme (none, "
                  "logit_normal, mode, cosmap, sigma_sqrt) or --timestep_sampling");
    return table;
  }
  std::vector<train::OptionSpec> options() const override {
    auto specs = train::flow_matching_option_specs();
    for (auto& spec : train::text_image_option_specs()) specs.push_back(std::move(spec));
    train::OptionSpec length{"max_sequence_length", "int", 512,
                             "Qwen3 tokens of each caption, the chat template's included "
                             "(train_dreambooth_lora_z_image.py's flag)",
                             train::range_check(1, 1 << 20)};
    length.structural = true;  // the cached text embeddings
    specs.push_back(std::move(length));
    specs.push_back(train::block_swap_option_spec());
    return specs;
  }
  diffusion::GenerateResult sample(const SampleOptions& a) const override {
    const train::FamilyOptions own =
        a.family.specs.empty() ? parse_family_flags(name(), sample_options(), {}) : a.family;
    diffusion::GenerateRequest request;
    request.prompts = sample_prompts(a, "Z-Image");
    if (!a.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
    if (!a.negative_prompt.empty()) request.negative_prompts = {a.negative_prompt};
    if (a.clip_skip != 1) {
      throw Error("--clip_skip does not apply to Z-Image (it takes its Qwen3's hidden_states[-2])");
    }
    if (a.guidance_rescale != 0) throw Error("--guidance_rescale does not apply to Z-Image");
    if (a.guidance_given) request.guidance_scale = a.guidance_scale;
    request.num_inference_steps = a.num_inference_steps;
    request.height = a.height;
    request.width = a.width;
    const auto& length = own.at("max_sequence_length");
    request.max_sequence_length = length.is_null() ? 0 : length.get<int64_t>();
    request.options["cfg_normalization"] =
        cfg_normalization_value(own.at("cfg_normalization"), "--cfg_normalization");
    request.options["cfg_truncation"] = own.at("cfg_truncation").get<double>();
    request.num_images = a.num_images > 0 ? a.num_images : a.num_images_per_prompt;
    request.seed = a.seed;
    const torch::Device device = parse_sample_device(a.device);
    z_image::ZImagePipeline pipe = z_image::load_z_image_pipeline(a.model, a);
    pipe.to(device);
    const auto o = pipe.resolve(request);
    log::info(
        "difftrain sample: {} (ZImagePipeline) on {}, {} steps, {}, max_sequence_length {}, {} "
        "prompt(s) x {} image(s), {}x{}, seed {}{}",
        a.model, device.str(), o.num_inference_steps,
        *o.guidance_scale > 0 ? fmt::format("guidance {}", *o.guidance_scale)
                              : std::string("no guidance"),
        o.max_sequence_length, o.prompts.size(), o.num_images, o.height, o.width, a.seed,
        a.lora.empty() ? std::string() : fmt::format(", LoRA {} x{}", a.lora, a.lora_scale));
    request.on_step = a.on_step;
    if (a.on_start) a.on_start();
    return pipe.generate(request);
  }
};

}  // namespace

DIFFTRAIN_BUILTIN_FAMILY(z_image, ZImageFamily)

}  // namespace difftrain::families
