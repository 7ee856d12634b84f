// The SDXL family: StableDiffusionXLPipeline folders (two text encoders, pooled embeddings and
// micro-conditioning: the extension of Stable Diffusion's pipeline in pipeline.cpp, sampling
// through it; training in sdxl_task.cpp).
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "difftrain/families/stable_diffusion/text_to_image.h"
#include "difftrain/families/unet/unet_based_family.h"
#include "sdxl.h"

namespace difftrain::families {
namespace {

class SdxlFamily : public unet::UNetBasedFamily {
 public:
  // Stable Diffusion's folders, loading and sampling read SDXL's through its extension.
  SdxlFamily() { stable_diffusion::register_pipeline_extension(sdxl::pipeline_extension()); }

  std::string name() const override { return "sdxl"; }
  std::vector<std::string> pipeline_classes() const override {
    return sdxl::pipeline_extension()->pipeline_classes();
  }
  bool matches_components(const nlohmann::json& index) const override {
    return index.contains("text_encoder_2") && index["text_encoder_2"].is_array() &&
           !index["text_encoder_2"].empty() && !index["text_encoder_2"][0].is_null();
  }
  int component_match_rank() const override { return 2; }  // two CLIPs, above one
  std::vector<std::string> lora_components() const override {
    return {"unet", "text_encoder", "text_encoder_2"};
  }
  std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string& dir, const diffusion::PipelineLoadOptions& options) const override {
    return std::make_unique<families::stable_diffusion::StableDiffusion>(
        families::stable_diffusion::load_stable_diffusion(dir, options));
  }
  std::optional<train::ScriptDefaults> training_defaults(
      const train::TrainConfig& config) const override {
    // Stable Diffusion's scripts at SDXL's resolution, and what the _sdxl scripts change:
    // train_text_to_image[_lora]_sdxl.py, train_dreambooth_lora_sdxl.py (full SDXL DreamBooth,
    // which Diffusers has no script for, takes train_dreambooth.py's).
    train::ScriptDefaults d = stable_diffusion::text_to_image_script_defaults(config);
    d.resolution = 1024;
    if (!stable_diffusion::dreambooth(config)) {
      d.script = std::string("train_text_to_image") + (config.lora ? "_lora" : "") + "_sdxl.py";
    } else if (config.lora) {
      d.script = "train_dreambooth_lora_sdxl.py";
      d.learning_rate = 1e-4;
      d.adam_weight_decay = 1e-4;
    }
    return d;
  }
  std::vector<train::OptionSpec> options() const override {
    return stable_diffusion::text_to_image_option_specs();
  }
  std::map<std::string, std::string> other_tools_options() const override {
    return stable_diffusion::text_to_image_other_tools_options();
  }
  /// StableDiffusionXLPipeline's micro-conditioning (`_get_add_time_ids`), each a pair.
  std::vector<train::OptionSpec> sample_options() const override {
    return sdxl::micro_conditioning_options();
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const override {
    return families::sdxl::make_sdxl_task(options);
  }
  diffusion::GenerateResult sample(const SampleOptions& options) const override {
    return stable_diffusion::sample_text_to_image(options);
  }
};

}  // namespace

DIFFTRAIN_BUILTIN_FAMILY(sdxl, SdxlFamily)

}  // namespace difftrain::families
