// The UNet family: unconditional and class-conditional UNets (Diffusers' DDPMPipeline /
// DDIMPipeline folders, or a bare UNet2DModel / UNet2DConditionModel folder with its
// scheduler_config.json), trained as train_unconditional.py does (unet_task.cpp). The default
// family: a run without a pretrained folder builds its UNet from a config.
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/families/unet/pipeline.h"
#include "difftrain/families/unet/unet_based_family.h"
#include "unet_task.h"

#include <fmt/format.h>

#include <sstream>

namespace difftrain::families {
namespace {

std::vector<int64_t> parse_labels(const std::string& text) {
  std::vector<int64_t> out;
  std::stringstream ss(text);
  std::string item;
  while (std::getline(ss, item, ',')) {
    if (item.empty()) continue;
    try {
      size_t used = 0;
      out.push_back(std::stoll(item, &used));
      if (used != item.size()) throw std::invalid_argument(item);
    } catch (const std::exception&) {
      throw Error("--class_labels: \"" + item + "\" is not an integer; expected e.g. 0,3,7");
    }
  }
  return out;
}

class UNetFamily : public UNetBasedFamily {
 public:
  std::string name() const override { return "unet"; }
  std::vector<std::string> pipeline_classes() const override {
    return {"DDPMPipeline", "DDIMPipeline"};
  }
  std::vector<std::string> model_classes() const override {
    return {"UNet2DModel", "UNet2DConditionModel"};
  }
  bool matches_components(const nlohmann::json& index) const override {
    return index.contains("unet");
  }
  bool is_default() const override { return true; }
  std::vector<std::string> lora_components() const override { return {"unet"}; }
  std::unique_ptr<diffusion::Pipeline> load_pipeline(
      const std::string& dir, const diffusion::PipelineLoadOptions& options) const override {
    return std::make_unique<diffusion::UNetPipeline>(diffusion::load_unet_pipeline(dir, options));
  }
  std::unique_ptr<train::TrainingTask> make_training_task(
      const train::TaskOptions& options) const override {
    return train::make_unet_task(options);
  }

  diffusion::GenerateResult sample(const SampleOptions& a) const override {
    if (!a.prompts.empty() || !a.prompt_file.empty()) {
      throw Error(a.model +
                  " is not a text-to-image pipeline (no text_encoder in model_index.json); "
                  "--prompt needs a Stable Diffusion folder");
    }
    diffusion::UNetPipeline pipeline = diffusion::load_unet_pipeline(a.model, a);
    const std::string scheduler_class = pipeline.sampler->class_name();

    diffusion::GenerateRequest request;
    request.class_labels = parse_labels(a.class_labels);
    request.num_images = a.num_images;
    request.num_inference_steps = a.num_inference_steps;
    request.guidance_scale = a.guidance_scale;
    request.seed = a.seed;
    const bool ddim = scheduler_class == "DDIMScheduler";
    if (!ddim && a.eta != 0.0) {
      log::warn("--eta applies to DDIM only; ignored for {}", scheduler_class);
    }

    const torch::Device device = parse_sample_device(a.device);
    const std::string unet_class = pipeline.unet->config().class_name();
    if (a.dtype) {
      throw Error("--dtype is for text-to-image folders (Stable Diffusion, SDXL, FLUX.1); " +
                  a.model + " is a UNet pipeline: leave --dtype out");
    }
    pipeline.to(device);
    const auto o = pipeline.resolve(request);
    log::info(
        "difftrain sample: model {} ({}) on {}, scheduler {}, {} steps{}, {} images, seed {}{}{}",
        a.model, unet_class, device.str(), scheduler_class, o.num_inference_steps,
        ddim ? fmt::format(" (eta {})", a.eta) : std::string(), o.num_images, a.seed,
        a.guidance_scale > 1 ? fmt::format(", guidance {}", a.guidance_scale) : std::string(),
        a.lora.empty() ? std::string() : fmt::format(", LoRA {} x{}", a.lora, a.lora_scale));
    request.on_step = a.on_step;
    if (a.on_start) a.on_start();
    return pipeline.generate(request);
  }
};

}  // namespace

DIFFTRAIN_BUILTIN_FAMILY(unet, UNetFamily)

}  // namespace difftrain::families
