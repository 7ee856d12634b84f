#include "difftrain/diffusion/generate.h"

#include "difftrain/core/log.h"
#include "difftrain/diffusion/pipeline.h"
#include "difftrain/diffusion/sd_pipeline.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>

namespace difftrain::diffusion {

namespace {

GenerateResult generate_unet(UNetPipeline& p, const GenerateRequest& r) {
  if (!p.unet || !p.sampler) throw Error("generate: the UNet pipeline has no UNet or no sampler");
  if (!r.prompts.empty() || !r.negative_prompts.empty()) {
    throw Error(
        "generate: prompts given, but this is a UNet pipeline without a text encoder; "
        "text-to-image needs a Stable Diffusion folder");
  }
  const int64_t k = r.num_images;
  SampleOptions o;
  o.num_images = k;
  o.num_inference_steps = r.num_inference_steps;
  o.class_labels = r.class_labels;
  o.guidance_scale = *r.guidance_scale;
  o.seed = r.seed;
  o.height = r.height;
  o.width = r.width;
  o.on_step = r.on_step;
  GenerateResult out;
  if (r.seeding == Seeding::kBatch) {
    out.images = sample_images(*p.unet, *p.sampler, o);
  } else {
    if (k < 1) throw Error("--num_images must be >= 1, got " + std::to_string(k));
    if (!r.class_labels.empty() && static_cast<int64_t>(r.class_labels.size()) != k) {
      throw Error("--class_labels has " + std::to_string(r.class_labels.size()) + " entries for " +
                  std::to_string(k) + " images; give one label per image");
    }
    std::vector<torch::Tensor> images;
    for (int64_t i = 0; i < k; ++i) {
      o.num_images = 1;
      o.seed = r.seed + static_cast<uint64_t>(i);
      if (!r.class_labels.empty()) o.class_labels = {r.class_labels[static_cast<size_t>(i)]};
      images.push_back(sample_images(*p.unet, *p.sampler, o));
    }
    out.images = torch::cat(images);
  }
  for (int64_t i = 0; i < k; ++i) {
    if (!r.class_labels.empty()) {
      out.labels.push_back(fmt::format("class {}", r.class_labels[static_cast<size_t>(i)]));
    } else if (r.seeding == Seeding::kBatch) {
      out.labels.push_back(fmt::format("seed {} #{}", r.seed, i));
    } else {
      out.labels.push_back(fmt::format("seed {}", r.seed + static_cast<uint64_t>(i)));
    }
  }
  return out;
}

GenerateResult generate_text_to_image(StableDiffusion& sd, const GenerateRequest& r) {
  if (!r.class_labels.empty()) throw Error("--class_labels is for class-conditional UNets");
  const int64_t k = r.num_images;
  TextToImageOptions o;
  o.prompts = r.prompts;
  o.negative_prompts = r.negative_prompts;
  o.guidance_scale = *r.guidance_scale;
  o.num_inference_steps = r.num_inference_steps;
  o.height = r.height;
  o.width = r.width;
  o.num_images_per_prompt = k;
  o.seed = r.seed;
  o.clip_skip = r.clip_skip;
  o.guidance_rescale = r.guidance_rescale;
  o.original_size = r.original_size;
  o.crops_coords_top_left = r.crops_coords_top_left;
  o.target_size = r.target_size;
  o.negative_original_size = r.negative_original_size;
  o.negative_crops_coords_top_left = r.negative_crops_coords_top_left;
  o.negative_target_size = r.negative_target_size;
  o.on_step = r.on_step;
  GenerateResult out;
  if (r.seeding == Seeding::kBatch) {
    auto t = text_to_image(sd, o);
    out.images = t.images;
    out.latents = t.latents;
    out.prompt_embeds = t.prompt_embeds;
  } else {
    // text_to_image's own checks, up front, before the first image's run.
    const size_t n = r.prompts.size();
    if (n == 0) throw Error("text-to-image needs at least one prompt (--prompt)");
    if (k < 1) throw Error("--num_images_per_prompt must be >= 1, got " + std::to_string(k));
    const size_t negatives = r.negative_prompts.size();
    if (negatives > 1 && negatives != n) {
      throw Error("got " + std::to_string(negatives) + " negative prompts for " +
                  std::to_string(n) + " prompts; give one, or one per prompt");
    }
    std::vector<torch::Tensor> images, latents, embeds;
    o.num_images_per_prompt = 1;
    for (size_t p = 0; p < n; ++p) {
      o.prompts = {r.prompts[p]};
      if (negatives > 0) o.negative_prompts = {r.negative_prompts[negatives == 1 ? 0 : p]};
      for (int64_t j = 0; j < k; ++j) {
        o.seed = r.seed + static_cast<uint64_t>(static_cast<int64_t>(p) * k + j);
        auto t = text_to_image(sd, o);
        images.push_back(t.images);
        latents.push_back(t.latents);
        embeds.push_back(t.prompt_embeds);
      }
    }
    out.images = torch::cat(images);
    out.latents = torch::cat(latents);
    out.prompt_embeds = torch::cat(embeds);
  }
  for (const auto& prompt : r.prompts) {
    for (int64_t j = 0; j < k; ++j) {
      std::string text = prompt.substr(0, 28);
      if (prompt.size() > 28) text += "...";
      out.labels.push_back(k > 1 ? fmt::format("{} #{}", text, j) : text);
    }
  }
  return out;
}

}  // namespace

std::unique_ptr<Sampler> load_pipeline_sampler(const PipelineFolder& folder,
                                               const std::string& scheduler, double eta) {
  std::string kind = scheduler;
  // DDIMPipeline turns whatever scheduler it is given into a DDIMScheduler.
  if (kind.empty() && folder.pipeline_class == "DDIMPipeline") kind = "ddim";
  SamplerOptions options;
  options.eta = eta;
  return load_sampler(folder.scheduler_config, kind, options);
}

std::map<std::string, torch::Tensor> GenerateResult::tensors() const {
  std::map<std::string, torch::Tensor> out = {{"images", images}};
  if (latents.defined()) out["latents"] = latents;
  if (prompt_embeds.defined()) out["prompt_embeds"] = prompt_embeds;
  if (pooled_prompt_embeds.defined()) out["pooled_prompt_embeds"] = pooled_prompt_embeds;
  return out;
}

UNetPipeline::UNetPipeline(models::UNet unet_, std::unique_ptr<Sampler> sampler_,
                           PipelineFolder folder_)
    : folder(std::move(folder_)), unet(std::move(unet_)), sampler(std::move(sampler_)) {}

std::string UNetPipeline::class_name() const {
  if (!folder.pipeline_class.empty()) return folder.pipeline_class;
  return sampler && sampler->class_name() == "DDIMScheduler" ? "DDIMPipeline" : "DDPMPipeline";
}

void UNetPipeline::to(const torch::Device& device, std::optional<torch::Dtype> dtype) {
  if (!unet) throw Error("UNetPipeline::to: the pipeline has no UNet");
  if (dtype) {
    unet->to(device, *dtype);
  } else {
    unet->to(device);
  }
}

GenerateRequest UNetPipeline::resolve(GenerateRequest r) const {
  if (r.num_images == 0) {
    r.num_images = std::max<int64_t>(1, static_cast<int64_t>(r.class_labels.size()));
  }
  // DDPMPipeline's default is 1000 steps, DDIMPipeline's (and every other sampler's) 50.
  if (r.num_inference_steps == 0) {
    const bool ddpm = sampler && sampler->class_name() == "DDPMScheduler";
    r.num_inference_steps = ddpm ? 1000 : 50;
  }
  if (!r.guidance_scale) r.guidance_scale = 1.0;
  return r;
}

GenerateResult UNetPipeline::generate(const GenerateRequest& request) {
  return generate_unet(*this, resolve(request));
}

UNetPipeline load_unet_pipeline(const std::string& dir, const PipelineLoadOptions& options) {
  if (!options.variant.empty() || !options.vae.empty()) {
    log::warn("{} is a UNet pipeline: --variant and --vae apply to text-to-image folders; ignored",
              dir);
  }
  PipelineFolder folder = resolve_pipeline_folder(dir);
  auto sampler = load_pipeline_sampler(folder, options.scheduler, options.eta);
  auto unet = load_unet_with_lora(folder.unet_dir, options.lora, options.lora_scale);
  return UNetPipeline(std::move(unet), std::move(sampler), std::move(folder));
}

std::string StableDiffusion::class_name() const {
  if (!folder.pipeline_class.empty()) return folder.pipeline_class;
  return is_xl() ? "StableDiffusionXLPipeline" : "StableDiffusionPipeline";
}

void StableDiffusion::to(const torch::Device& device, std::optional<torch::Dtype> dtype) {
  const auto move = [&](torch::nn::Module& m) {
    if (dtype) {
      m.to(device, *dtype);
    } else {
      m.to(device);
    }
  };
  if (text_encoders.empty() || !vae || !unet) {
    throw Error("StableDiffusion::to: the pipeline is missing its text encoder, VAE or UNet");
  }
  text_encoders.to(device, dtype);
  move(*vae);
  move(*unet);
}

GenerateRequest StableDiffusion::resolve(GenerateRequest r) const {
  if (r.num_images == 0) r.num_images = 1;
  if (r.num_inference_steps == 0) r.num_inference_steps = 50;
  // StableDiffusionPipeline's default guidance is 7.5, StableDiffusionXLPipeline's 5.
  if (!r.guidance_scale) r.guidance_scale = is_xl() ? 5.0 : 7.5;
  return r;
}

GenerateResult StableDiffusion::generate(const GenerateRequest& request) {
  return generate_text_to_image(*this, resolve(request));
}

}  // namespace difftrain::diffusion
