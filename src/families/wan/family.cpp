// The Wan family (issue 60): WanPipeline / WanImageToVideoPipeline folders (Wan 2.1 text- and
// image-to-video with its CLIP image encoder, Wan 2.2 A14B with its two experts, Wan 2.2 image to
// video, Wan 2.2 TI2V-5B with the 48-channel VAE) and bare WanTransformer3DModel folders:
// `difftrain sample` (a video file, frame PNGs, --save_tensors), `difftrain forward`, LoRA files
// (read, convert, merge, apply), training on clips and images (musubi-tuner's semantics:
// wan_task.cpp, the video data of ../video_data.h) and estimate-memory (memory.cpp).
#include "difftrain/families/family.h"
#include "../text_image_data.h"
#include "../video_data.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/lora_merge.h"
#include "difftrain/train/block_swap_option.h"
#include "difftrain/train/flow_matching_options.h"
#include "difftrain/train/text_image_options.h"
#include "wan_pipeline.h"
#include "wan_task.h"

#include <fmt/format.h>
#include <torch/torch.h>

namespace difftrain::families {
namespace {

class WanFamily : public ModelFamily {
 public:
  std::string name() const override { return "wan"; }
  std::vector<std::string> pipeline_classes() const override {
    return {"WanPipeline", "WanImageToVideoPipeline"};
  }
  std::vector<std::string> model_classes() const override { return {"WanTransformer3DModel"}; }
  bool matches_components(const nlohmann::json& index) const override {
    return index.contains("transformer") && index.contains("text_encoder") &&
           index["text_encoder"].is_array() && index["text_encoder"].size() == 2 &&
           index["text_encoder"][1] == "UMT5EncoderModel";
  }
  int component_match_rank() const override { return 4; }
  std::vector<std::string> lora_components() const override { return {"transformer"}; }
  std::vector<std::string> lora_export_formats() const override {
    return {"diffusers", "peft", "kohya", "comfyui"};
  }
  std::vector<io::LoraKeyLayout> lora_key_layouts() const override {
    return {dit_comfyui_key_layout(wan::wan_lora_layout())};
  }
  void adapt_lora(io::LoraWeights& lora, const std::string& dir,
                  io::LoraFormat format) const override {
    adapt_dit_lora(wan::wan_lora_layout(), lora, dir, format);
  }
  models::LoraFolderMergeSummary merge_lora(
      const std::string& dir, const std::string& lora, const std::string& output_dir,
      const models::LoraFolderMergeOptions& options) const override {
    return merge_dit_lora("Wan", wan::read_wan_lora, dir, lora, output_dir, options);
  }
  std::map<std::string, torch::Tensor> forward_outputs(
      const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
      const std::string& source, const std::string& lora, double lora_scale) const override {
    return wan::forward_wan(dir, inputs, source, lora, lora_scale);
  }
  std::vector<train::MemoryEstimate> estimate_memory(
      const std::string& model_path, const train::MemoryEstimateOptions& options,
      const std::vector<accel::ShardingStrategy>& strategies) const override {
    return wan::estimate_wan_memory(model_path, options, strategies);
  }
  std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string& dir, const diffusion::PipelineLoadOptions& options) const override {
    return std::make_unique<wan::WanPipeline>(wan::load_wan_pipeline(dir, options));
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const override {
    return wan::make_wan_training_task(options);
  }
  std::vector<train::OptionSpec> options() const override {
    auto specs = train::flow_matching_option_specs();
    for (auto& spec : specs) {
      // musubi-tuner's Wan guide: --timestep_sampling shift --discrete_flow_shift 3.0.
      if (spec.name == "timestep_sampling") spec.default_value = "shift";
    }
    for (auto& spec : train::text_image_option_specs()) specs.push_back(std::move(spec));
    for (auto& spec : video_data_option_specs()) specs.push_back(std::move(spec));
    train::OptionSpec length{"max_sequence_length", "int", 512,
                             "UMT5 tokens of each caption (the transformer sees them zero-padded "
                             "to this length, as WanPipeline and musubi-tuner pad)",
                             train::range_check(1, 1024)};
    length.structural = true;
    specs.push_back(std::move(length));
    train::OptionSpec expert{"train_expert", "string?", nullptr,
                             "Wan 2.2 A14B: the expert this run trains, high (transformer, "
                             "t >= boundary), low (transformer_2) or both (one LoRA, the bases "
                             "swapped by timestep: musubi-tuner's --dit_high_noise)",
                             train::one_of_check({"high", "low", "both"})};
    expert.structural = true;
    specs.push_back(std::move(expert));
    specs.push_back({"validation_num_frames", "int", 0,
                     "frames of each validation clip (0: the longest --target_frames)",
                     train::range_check(0, 100000)});
    specs.push_back(train::block_swap_option_spec());
    return specs;
  }
  std::optional<train::ScriptDefaults> training_defaults(
      const train::TrainConfig& /*config*/) const override {
    // musubi-tuner's Wan guide (docs/wan.md): LoRA rank 32, learning rate 2e-4, batch 1.
    train::ScriptDefaults d;
    d.script = "musubi-tuner wan_train_network.py";
    d.resolution = 512;
    d.train_batch_size = 1;
    d.learning_rate = 2e-4;
    d.adam_weight_decay = 1e-2;
    // lora_target_modules left to the task: musubi-tuner's set, with the image branch's
    // add_k_proj / add_v_proj where the model has one (Wan 2.1 I2V).
    d.not_applicable = {"validation_scheduler"};
    return d;
  }
  std::vector<train::OptionSpec> sample_options() const override {
    train::OptionSpec frames{"num_frames", "int", 81,
                             "frames of each video (1 + 4k; others are rounded down as "
                             "WanPipeline rounds them); default 81",
                             train::range_check(1, 100000)};
    train::OptionSpec g2{"guidance_scale_2", "float?", nullptr,
                         "Wan 2.2 A14B: the guidance of the low-noise expert (transformer_2); "
                         "default --guidance_scale",
                         train::range_check(0, 1e9)};
    train::OptionSpec length{"max_sequence_length", "int?", nullptr,
                             "UMT5 tokens per prompt (default 512)",
                             train::range_check(1, 1 << 20)};
    // Declared as Qwen-Image's --image is (repeatable; the CLI offers one flag per name), one
    // file taken.
    train::OptionSpec image{"image",
                            "string",
                            nullptr,
                            "an input image: Qwen-Image-Edit's reference (repeat the flag for "
                            "several: QwenImageEditPlusPipeline), Wan image to video's first frame",
                            {}};
    image.values = -1;
    image.input_path = true;
    train::OptionSpec last{"last_image",
                           "string?",
                           nullptr,
                           "image to video: the last frame too (first-last-frame to video)",
                           {}};
    last.input_path = true;
    return {std::move(frames), std::move(g2), std::move(length), std::move(image), std::move(last)};
  }
  diffusion::GenerateResult sample(const SampleOptions& a) const override {
    const train::FamilyOptions own =
        a.family.specs.empty() ? parse_family_flags(name(), sample_options(), {}) : a.family;
    diffusion::GenerateRequest request;
    request.prompts = sample_prompts(a, "Wan");
    if (!a.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
    if (!a.negative_prompt.empty()) request.negative_prompts = {a.negative_prompt};
    if (a.clip_skip != 1) throw Error("--clip_skip does not apply to Wan (it takes UMT5's output)");
    if (a.guidance_rescale != 0) throw Error("--guidance_rescale does not apply to Wan");
    if (a.guidance_given) request.guidance_scale = a.guidance_scale;
    request.num_inference_steps = a.num_inference_steps;
    request.height = a.height;
    request.width = a.width;
    const auto& length = own.at("max_sequence_length");
    request.max_sequence_length = length.is_null() ? 0 : length.get<int64_t>();
    request.options["num_frames"] = own.at("num_frames").get<int64_t>();
    request.options["guidance_scale_2"] = own.at("guidance_scale_2");
    const auto& images = own.at("image");
    if (images.is_array() && images.size() > 1) {
      throw Error(
          fmt::format("Wan image to video takes one --image (the first frame; the last is "
                      "--last_image), got {}",
                      images.size()));
    }
    if (images.is_array() && !images.empty()) request.options["image"] = images[0];
    if (!own.at("last_image").is_null()) request.options["last_image"] = own.at("last_image");
    request.num_images = a.num_images > 0 ? a.num_images : a.num_images_per_prompt;
    request.seed = a.seed;
    const torch::Device device = parse_sample_device(a.device);
    wan::WanPipeline pipe = wan::load_wan_pipeline(a.model, a);
    pipe.to(device, a.dtype);
    const auto o = pipe.resolve(request);
    log::info(
        "difftrain sample: {} ({}{}) on {}, {} steps, guidance {}, {} prompt(s) x {} "
        "video(s), {} frames of {}x{}, seed {}",
        a.model, pipe.class_name(), pipe.transformer_2 ? ", two experts" : "", device.str(),
        o.num_inference_steps, *o.guidance_scale, o.prompts.size(), o.num_images,
        o.options.at("num_frames").get<int64_t>(), o.height, o.width, a.seed);
    request.on_step = a.on_step;
    if (a.on_start) a.on_start();
    return pipe.generate(request);
  }
};

}  // namespace

DIFFTRAIN_BUILTIN_FAMILY(wan, WanFamily)

}  // namespace difftrain::families
