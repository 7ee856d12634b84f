// The Qwen-Image family: QwenImagePipeline folders (a QwenImageTransformer2DModel conditioned by
// Qwen2.5-VL's language model, the causal AutoencoderKLQwenImage) and bare transformer folders.
// Sampling in qwen_image_pipeline.cpp, `difftrain forward` in forward.cpp, estimate-memory in
// memory.cpp, training in qwen_image_task.cpp. The Edit pipelines are not here yet.
#include "difftrain/families/family.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/lora_merge.h"
#include "difftrain/train/block_swap_option.h"
#include "difftrain/train/ddpm_options.h"
#include "difftrain/train/flow_matching_options.h"
#include "difftrain/train/text_image_options.h"
#include "qwen_image_pipeline.h"

#include <fmt/format.h>

#include <torch/torch.h>

namespace difftrain::families {
namespace {

bool qwen_has_component(const nlohmann::json& index, const char* name) {
  return index.contains(name) && index[name].is_array() && index[name].size() == 2 &&
         !index[name][0].is_null();
}

class QwenImageFamily : public ModelFamily {
 public:
  std::string name() const override { return "qwen-image"; }
  std::vector<std::string> pipeline_classes() const override {
    return {"QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"};
  }
  std::vector<std::string> model_classes() const override {
    return {"QwenImageTransformer2DModel"};
  }
  bool matches_components(const nlohmann::json& index) const override {
    return qwen_has_component(index, "transformer") && qwen_has_component(index, "text_encoder") &&
           index["text_encoder"][1] == "Qwen2_5_VLForConditionalGeneration" &&
           !index.contains("processor");
  }
  int component_match_rank() const override { return 4; }
  std::vector<std::string> lora_components() const override { return {"transformer"}; }
  std::vector<std::string> lora_export_formats() const override {
    return {"diffusers", "peft", "kohya", "comfyui"};
  }
  std::vector<io::LoraKeyLayout> lora_key_layouts() const override {
    return {dit_comfyui_key_layout(qwen_image::qwen_image_lora_layout())};
  }
  void adapt_lora(io::LoraWeights& lora, const std::string& dir,
                  io::LoraFormat format) const override {
    adapt_dit_lora(qwen_image::qwen_image_lora_layout(), lora, dir, format);
  }
  models::LoraFolderMergeSummary merge_lora(
      const std::string& dir, const std::string& lora, const std::string& output_dir,
      const models::LoraFolderMergeOptions& options) const override {
    return merge_dit_lora("Qwen-Image", qwen_image::read_qwen_image_lora, dir, lora, output_dir,
                          options);
  }
  std::map<std::string, torch::Tensor> forward_outputs(
      const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
      const std::string& source, const std::string& lora, double lora_scale) const override {
    return qwen_image::forward_qwen_image(dir, inputs, source, lora, lora_scale);
  }
  std::vector<train::MemoryEstimate> estimate_memory(
      const std::string& model_path, const train::MemoryEstimateOptions& options,
      const std::vector<accel::ShardingStrategy>& strategies) const override {
    return qwen_image::estimate_qwen_image_memory(model_path, options, strategies);
  }
  std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string& dir, const diffusion::PipelineLoadOptions& options) const override {
    return std::make_unique<qwen_image::QwenImagePipeline>(
        qwen_image::load_qwen_image_pipeline(dir, options));
  }
  std::vector<train::OptionSpec> sample_options() const override {
    train::OptionSpec true_cfg{
        "true_cfg_scale", "float", 4.0,
        "QwenImagePipeline's true_cfg_scale: classifier-free guidance when > 1 and a "
        "--negative_prompt is given (the guided prediction is rescaled to the conditional one's "
        "norm); default 4",
        train::range_check(0, 1e9)};
    train::OptionSpec length{"max_sequence_length", "int?", nullptr,
                             "text tokens per prompt after the system template's, at most 1024 "
                             "(default 512)",
                             train::range_check(1, 1024)};
    train::OptionSpec image{"image",
                            "string",
                            nullptr,
                            "an input image: Qwen-Image-Edit's reference (repeat the flag for "
                            "several: QwenImageEditPlusPipeline), Wan image to video's first frame",
                            {}};
    image.values = -1;
    image.input_path = true;
    train::OptionSpec pipeline{
        "pipeline", "string?", nullptr,
        "the pipeline class to run (default: the folder's model_index.json): QwenImagePipeline, "
        "QwenImageEditPipeline or QwenImageEditPlusPipeline",
        train::one_of_check(
            {"QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"})};
    return {std::move(true_cfg), std::move(length), std::move(image), std::move(pipeline)};
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const override {
    return qwen_image::make_qwen_image_training_task(options);
  }
  std::optional<train::ScriptDefaults> training_defaults(
      const train::TrainConfig& /*config*/) const override {
    // train_dreambooth_lora_qwen_image.py (its full fine-tuning is the same run without --lora).
    train::ScriptDefaults d;
    d.script = "train_dreambooth_lora_qwen_image.py";
    d.resolution = 512;
    d.train_batch_size = 4;
    d.num_train_epochs = 1;
    d.learning_rate = 1e-4;
    d.adam_weight_decay = 1e-4;
    d.lora_target_modules = qwen_image::default_qwen_image_lora_targets();
    d.not_applicable = {"validation_scheduler"};
    return d;
  }
  std::string instead_of_option(const std::string& name) const override {
    if (name == "clip_skip") {
      return "Qwen-Image takes its Qwen2.5-VL's last hidden state, so there is no CLIP layer to "
             "skip";
    }
    for (const auto& spec : train::ddpm_option_specs()) {
      if (spec.name == name) {
        return "Qwen-Image trains with flow matching: weigh it with --weighting_scheme (none, "
               "logit_normal, mode, cosmap, sigma_sqrt) or --timestep_sampling";
      }
    }
    return "";
  }
  std::map<std::string, std::string> other_tools_options() const override {
    auto table = train::text_image_other_tools_options();
    table.emplace("unet_lr", "--learning_rate");
    table.emplace("min_snr_gamma",
                  "!Qwen-Image trains with flow matching: weigh it with --weighting_scheme (none, "
                  "logit_normal, mode, cosmap, sigma_sqrt) or --timestep_sampling");
    return table;
  }
  std::vector<train::OptionSpec> options() const override {
    auto specs = train::flow_matching_option_specs();
    for (auto& spec : train::text_image_option_specs()) specs.push_back(std::move(spec));
    train::OptionSpec length{"max_sequence_length", "int", 512,
                             "Qwen2.5-VL tokens of each caption after the system template's "
                             "(train_dreambooth_lora_qwen_image.py's flag)",
                             train::range_check(1, 1024)};
    length.structural = true;  // the cached text embeddings
    specs.push_back(std::move(length));
    train::OptionSpec pipeline{
        "pipeline", "string?", nullptr,
        "QwenImageEditPipeline / QwenImageEditPlusPipeline: train an Edit model on (control, "
        "target, instruction) pairs (default: the folder's model_index.json class)",
        train::one_of_check(
            {"QwenImagePipeline", "QwenImageEditPipeline", "QwenImageEditPlusPipeline"})};
    pipeline.structural = true;
    specs.push_back(std::move(pipeline));
    train::OptionSpec validation_image{
        "validation_image",
        "list",
        nlohmann::json::array(),
        "Edit runs: the reference image(s) of the validation renders (default: the first "
        "pair's control images)",
        {}};
    validation_image.input_path = true;
    specs.push_back(std::move(validation_image));
    specs.push_back(train::block_swap_option_spec());
    return specs;
  }
  diffusion::GenerateResult sample(const SampleOptions& a) const override {
    const train::FamilyOptions own =
        a.family.specs.empty() ? parse_family_flags(name(), sample_options(), {}) : a.family;
    diffusion::GenerateRequest request;
    request.prompts = sample_prompts(a, "Qwen-Image");
    if (!a.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
    if (!a.negative_prompt.empty()) request.negative_prompts = {a.negative_prompt};
    if (a.clip_skip != 1) {
      throw Error(
          "--clip_skip does not apply to Qwen-Image (it takes its Qwen2.5-VL's last hidden "
          "state)");
    }
    if (a.guidance_rescale != 0) throw Error("--guidance_rescale does not apply to Qwen-Image");
    if (a.guidance_given) request.guidance_scale = a.guidance_scale;
    request.num_inference_steps = a.num_inference_steps;
    request.height = a.height;
    request.width = a.width;
    const auto& length = own.at("max_sequence_length");
    request.max_sequence_length = length.is_null() ? 0 : length.get<int64_t>();
    request.options["true_cfg_scale"] = own.at("true_cfg_scale").get<double>();
    request.num_images = a.num_images > 0 ? a.num_images : a.num_images_per_prompt;
    request.seed = a.seed;
    const auto& images = own.at("image");
    if (images.is_array() && !images.empty()) request.options["image"] = images;
    const torch::Device device = parse_sample_device(a.device);
    const auto& pipeline = own.at("pipeline");
    qwen_image::QwenImagePipeline pipe = qwen_image::load_qwen_image_pipeline(
        a.model, a, pipeline.is_null() ? std::string() : pipeline.get<std::string>());
    pipe.to(device);
    const auto o = pipe.resolve(request);
    const double true_cfg = o.options.at("true_cfg_scale").get<double>();
    log::info(
        "difftrain sample: {} ({}{}) on {}, {} steps, {}, max_sequence_length {}, "
        "{} prompt(s) x {} image(s), {}, seed {}{}",
        a.model, pipe.class_name(),
        request.options.contains("image")
            ? fmt::format(", {} reference image(s)", request.options["image"].size())
            : std::string(),
        device.str(), o.num_inference_steps,
        true_cfg > 1 && !o.negative_prompts.empty() ? fmt::format("true CFG {}", true_cfg)
                                                    : std::string("no guidance"),
        o.max_sequence_length, o.prompts.size(), o.num_images,
        pipe.edit != qwen_image::EditKind::kNone && (a.height == 0 || a.width == 0)
            ? std::string("the reference's size near 1024x1024")
            : fmt::format("{}x{}", o.height, o.width),
        a.seed,
        a.lora.empty() ? std::string() : fmt::format(", LoRA {} x{}", a.lora, a.lora_scale));
    request.on_step = a.on_step;
    if (a.on_start) a.on_start();
    return pipe.generate(request);
  }
};

}  // namespace

DIFFTRAIN_BUILTIN_FAMILY(qwen_image, QwenImageFamily)

}  // namespace difftrain::families
