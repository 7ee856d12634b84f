// `difftrain sample` for Stable Diffusion 1.x/2.x folders and those of the pipelines built on
// StableDiffusionPipeline (the SDXL family calls it too): the pipeline's semantics.
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "difftrain/families/stable_diffusion/text_to_image.h"
#include "difftrain/families/unet/pipeline.h"

#include <fmt/format.h>

namespace difftrain::families::stable_diffusion {
using namespace difftrain::diffusion;
using namespace difftrain::train;
using namespace difftrain::families::unet;

diffusion::GenerateResult sample_text_to_image(const families::SampleOptions& a) {
  diffusion::GenerateRequest request;
  request.prompts = sample_prompts(a, "Stable Diffusion");
  if (!a.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
  if (!a.negative_prompt.empty()) request.negative_prompts = {a.negative_prompt};
  if (a.guidance_given) request.guidance_scale = a.guidance_scale;
  request.num_inference_steps = a.num_inference_steps;
  request.height = a.height;
  request.width = a.width;
  request.num_images = a.num_images > 0 ? a.num_images : a.num_images_per_prompt;
  request.seed = a.seed;
  request.clip_skip = a.clip_skip - 1;
  request.guidance_rescale = a.guidance_rescale;
  // The family's own sample options (its pipeline extension's) go to the pipeline by name.
  for (const auto& [name, value] : a.family.values.items()) {
    if (!value.is_null()) request.options[name] = value;
  }
  const torch::Device device = parse_sample_device(a.device);
  families::stable_diffusion::StableDiffusion sd =
      families::stable_diffusion::load_stable_diffusion(a.model, a);
  sd.to(device, a.dtype);
  if (request.clip_skip > sd.text_encoders.max_clip_skip()) {
    throw Error("--clip_skip " + std::to_string(a.clip_skip) + " is more than the text encoder's " +
                std::to_string(sd.text_encoders.max_clip_skip() + 1) + " layers");
  }
  const auto o = sd.resolve(request);
  log::info(
      "difftrain sample: {} ({}) on {}, scheduler {}, {} steps, guidance {}, {} prompt(s) x {} "
      "image(s), seed {}{}",
      a.model, sd.class_name(), device.str(), sd.scheduler->class_name(), o.num_inference_steps,
      *o.guidance_scale, o.prompts.size(), o.num_images, a.seed,
      a.lora.empty() ? std::string() : fmt::format(", LoRA {} x{}", a.lora, a.lora_scale));
  for (size_t i = 0; i < o.prompts.size(); ++i) {
    const auto& tokenizer = sd.text_encoders.as<diffusion::ClipTextEncoder>(0).tokenizer();
    const auto enc = tokenizer.encode(o.prompts[i]);
    if (enc.truncated) {
      log::warn("prompt {} has {} tokens; only the first {} are used", i, enc.num_tokens,
                tokenizer.model_max_length() - 2);
    }
  }
  request.on_step = a.on_step;
  if (a.on_start) a.on_start();
  return sd.generate(request);
}

}  // namespace difftrain::families::stable_diffusion
