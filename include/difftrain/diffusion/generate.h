#pragma once
// Generating images from a loaded pipeline of either family, with one request and one call:
//
//     diffusion::Pipeline pipe = diffusion::load_stable_diffusion("tiny_sd");   // or a
//     //   UNetPipeline{folder, load_unet_with_lora(folder.unet_dir),
//     load_pipeline_sampler(folder)} diffusion::GenerateRequest req; req.prompts = {"a photo of a
//     cat"}; req.seed = 42; auto out = diffusion::generate(pipe, req);       // out.images [K, H,
//     W, 3] in [0, 1] io::save_image_grid("grid.png", out.images, out.labels);
//
// `difftrain sample`, the trainer's validation renders and DreamBooth's class images all go
// through generate(); it runs sample_images() (DDPMPipeline / DDIMPipeline) or text_to_image()
// (StableDiffusionPipeline), so its numbers are theirs.

#include "difftrain/diffusion/pipeline.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/sd_pipeline.h"
#include "difftrain/models/unet.h"

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <variant>
#include <vector>

namespace difftrain::diffusion {

/// An unconditional or class-conditional UNet pipeline (Diffusers' DDPMPipeline /
/// DDIMPipeline): the UNet and the sampler it runs with.
struct UNetPipeline {
  PipelineFolder folder;  ///< where it came from (empty when assembled in memory, e.g. training)
  models::UNet unet{nullptr};
  std::unique_ptr<Sampler> sampler;
};

/// A loaded pipeline of either family: a UNet pipeline or a Stable Diffusion pipeline
/// (tokenizer, text encoder, VAE, UNet, sampler).
using Pipeline = std::variant<UNetPipeline, StableDiffusion>;

/// The sampler of the pipeline folder `folder` with `difftrain sample`'s defaults: `scheduler`
/// (a name of sampler_names() or a Diffusers class) or, when empty, the folder's scheduler
/// class, except that a DDIMPipeline folder runs "ddim" (DDIMPipeline turns whatever scheduler it
/// is given into a DDIMScheduler); `eta` is DDIM's (the other samplers ignore it).
std::unique_ptr<Sampler> load_pipeline_sampler(const PipelineFolder& folder,
                                               const std::string& scheduler = "", double eta = 0.0);

/// Moves the pipeline's models (UNet; text encoder and VAE too) to `device` (Diffusers'
/// `pipe.to(device)`). The noise still comes from the CPU generator, so a seed gives the same
/// images on any device.
void pipeline_to(Pipeline& pipeline, const torch::Device& device);

/// How the images of one request draw their noise.
enum class Seeding {
  /// Diffusers' pipelines: one CPU generator seeded `seed` for the whole batch (the images
  /// depend on how many are drawn together). `difftrain sample`, the UNet trainer's validation.
  kBatch,
  /// Image i (counted over the whole request, prompt-major) is its own run with a CPU generator
  /// seeded `seed + i`, one image at a time: the same image whatever the batch. Stable
  /// Diffusion validation renders and DreamBooth class images.
  kPerImage,
};

/// What to generate (the arguments of DDPMPipeline / StableDiffusionPipeline `__call__`).
struct GenerateRequest {
  /// Text-to-image only: the prompts (at least one) and negative prompts (one for all, one per
  /// prompt, or none = "").
  std::vector<std::string> prompts;
  std::vector<std::string> negative_prompts;
  /// UNet pipelines only: one class id per image for class-conditional UNets, empty otherwise.
  std::vector<int64_t> class_labels;
  /// UNet pipelines: the number of images (0 = one per class label, or 1). Text-to-image: images
  /// per prompt (0 = 1), so K = prompts x num_images.
  int64_t num_images = 0;
  /// Denoising steps; 0 = the pipeline's default (UNet: DDPMScheduler 1000, every other sampler
  /// 50; text-to-image 50).
  int64_t num_inference_steps = 0;
  /// Classifier-free guidance scale (> 1 guides); unset = the default (SD 7.5, SDXL 5, UNet
  /// pipelines 1, i.e. none). UNet guidance is against the null class (num_class_embeds - 1).
  std::optional<double> guidance_scale;
  /// Image size in pixels; 0 = the model's (UNet sample_size, times the VAE factor for SD).
  int64_t height = 0, width = 0;
  /// Text-to-image: Diffusers' clip_skip, embeddings from that many layers before the last (0 =
  /// last; kohya's and `difftrain sample --clip_skip`'s N is this + 1).
  int64_t clip_skip = 0;
  /// Text-to-image: Diffusers' guidance_rescale (0 = off).
  double guidance_rescale = 0.0;
  /// SDXL only (see TextToImageOptions): micro-conditioning pairs, empty = the defaults.
  std::vector<int64_t> original_size, crops_coords_top_left, target_size;
  std::vector<int64_t> negative_original_size, negative_crops_coords_top_left, negative_target_size;
  uint64_t seed = 0;
  Seeding seeding = Seeding::kBatch;
  /// Called after each denoising step with (step from 1, number of steps); with kPerImage, once
  /// per step of each image's run.
  std::function<void(int64_t, int64_t)> on_step;
};

/// What generate() produced.
struct GenerateResult {
  /// [K, H, W, C] float32 in [0, 1] on the CPU (Diffusers' output_type "np"); text-to-image
  /// prompt-major (prompt 0's images first).
  torch::Tensor images;
  /// Text-to-image only (undefined for UNet pipelines): the final latents [K, c, h, w] and the
  /// prompt embeddings, [2K, L, D] with guidance (negative rows first), else [K, L, D]; with
  /// kPerImage, each image's run's rows one after the other.
  torch::Tensor latents, prompt_embeds;
  /// One grid caption per image: UNet "class L" (class-conditional) or "seed S #i" (kBatch) /
  /// "seed S+i" (kPerImage); text-to-image the prompt's first 28 characters ("..." when cut),
  /// with " #k" when a prompt has several images.
  std::vector<std::string> labels;

  /// The tensors `difftrain sample --save_tensors` writes: "images", plus "latents" and
  /// "prompt_embeds" when defined.
  std::map<std::string, torch::Tensor> tensors() const;
};

/// `request` with every default filled in for `pipeline` (num_images, num_inference_steps,
/// guidance_scale), as generate() will run it; for logging the settings before a run.
GenerateRequest resolve_request(const Pipeline& pipeline, GenerateRequest request);

/// Generates the request's images with the pipeline: sample_images() for a UNetPipeline,
/// text_to_image() for a StableDiffusion, once (kBatch) or once per image (kPerImage), so the
/// numbers are exactly those functions'. Models run in eval mode under no-grad on their device.
/// Throws difftrain::Error for requests the pipeline cannot take (prompts for a UNet pipeline,
/// class labels for text-to-image, and the errors of sample_images / text_to_image).
GenerateResult generate(Pipeline& pipeline, const GenerateRequest& request);

}  // namespace difftrain::diffusion
