// The Stable Diffusion 1.x/2.x family: StableDiffusionPipeline folders (text-to-image sampling,
// text-to-image / LoRA / DreamBooth training in text_to_image_task.h).
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "difftrain/families/stable_diffusion/text_to_image.h"
#include "difftrain/families/unet/unet_based_family.h"
#include "text_to_image_task.h"

namespace difftrain::families {
namespace {

class StableDiffusionFamily : public unet::UNetBasedFamily {
 public:
  std::string name() const override { return "stable-diffusion"; }
  std::vector<std::string> pipeline_classes() const override {
    // Img2Img folders hold the same weights.
    return {"StableDiffusionPipeline", "StableDiffusionImg2ImgPipeline"};
  }
  bool matches_components(const nlohmann::json& index) const override {
    return index.contains("text_encoder") && !index["text_encoder"].is_null() &&
           !(index["text_encoder"].is_array() && !index["text_encoder"].empty() &&
             index["text_encoder"][0].is_null());
  }
  int component_match_rank() const override { return 1; }  // a text encoder, above a UNet alone
  std::vector<std::string> lora_components() const override { return {"unet", "text_encoder"}; }
  std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string& dir, const diffusion::PipelineLoadOptions& options) const override {
    return std::make_unique<families::stable_diffusion::StableDiffusion>(
        families::stable_diffusion::load_stable_diffusion(dir, options));
  }
  std::vector<train::OptionSpec> options() const override {
    return stable_diffusion::text_to_image_option_specs();
  }
  std::map<std::string, std::string> other_tools_options() const override {
    return stable_diffusion::text_to_image_other_tools_options();
  }
  std::optional<train::ScriptDefaults> training_defaults(
      const train::TrainConfig& config) const override {
    return stable_diffusion::text_to_image_script_defaults(config);
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const override {
    return families::stable_diffusion::make_text_to_image_task(options);
  }
  diffusion::GenerateResult sample(const SampleOptions& options) const override {
    return stable_diffusion::sample_text_to_image(options);
  }
};

}  // namespace

DIFFTRAIN_BUILTIN_FAMILY(stable_diffusion, StableDiffusionFamily)

}  // namespace difftrain::families
