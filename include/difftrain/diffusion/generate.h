#pragma once
// Pipelines: a loaded model of any family behind one interface (Diffusers' DiffusionPipeline):
// move it with to(device, dtype), generate images with generate(request). Each family's pipeline
// implements it in its family's folder (UNetPipeline in families/unet/pipeline.h for
// DDPMPipeline / DDIMPipeline, StableDiffusion in families/stable_diffusion/pipeline.h for
// StableDiffusion(XL)Pipeline, FluxPipeline in src/families/flux/; families::load_pipeline in
// families/family.h loads any of them):
//
//     families::stable_diffusion::StableDiffusion pipe =
//     families::stable_diffusion::load_stable_diffusion("tiny_sd"); pipe.to(torch::kCUDA);
//     diffusion::GenerateRequest req;
//     req.prompts = {"a photo of a cat"};
//     req.seed = 42;
//     auto out = pipe.generate(req);  // out.images [K, H, W, 3] in [0, 1]
//     io::save_image_grid("grid.png", out.images, out.labels);
//
// `difftrain sample`, the trainer's validation renders and DreamBooth's class images all go
// through Pipeline::generate(); the UNet pipeline runs sample_images() (DDPMPipeline /
// DDIMPipeline) and the Stable Diffusion one text_to_image() (StableDiffusionPipeline), so its
// numbers are theirs.

#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::diffusion {

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
  /// The prompts for the second text encoder (Diffusers' `prompt_2`; FLUX.1's T5): one per
  /// prompt, one for all, or none (= the prompts), for pipelines that take them.
  std::vector<std::string> prompts_2;
  /// The token count a pipeline with a chosen text length pads or cuts prompts to (Diffusers'
  /// `max_sequence_length`; FLUX.1's T5); 0 = the pipeline's default.
  int64_t max_sequence_length = 0;
  /// The prompts' embeddings made beforehand, one row per prompt (Diffusers' prompt_embeds
  /// [P, L, D] and pooled_prompt_embeds [P, Pd]), for pipelines that take them (FLUX.1); when
  /// defined the text encoders are not called (a training run that released them renders
  /// validation images with these).
  torch::Tensor prompt_embeds, pooled_prompt_embeds;
  /// For pipelines whose prompts' embeddings differ in length (a decoder LLM's real tokens:
  /// Z-Image): prompt_embeds' mask [P, L] (1 = a real token; undefined = every token real), and
  /// the negative prompts' embeddings made beforehand [P, L', D] with their mask, used with
  /// guidance (undefined: the pipeline encodes the negative prompts).
  torch::Tensor prompt_attention_mask, negative_prompt_embeds, negative_attention_mask;
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
  /// A family's own `__call__` arguments by their Diffusers names, as its sample options
  /// (ModelFamily::sample_options) declare them (e.g. SDXL's "original_size": [H, W]); absent or
  /// null = the pipeline's default. The family's pipeline reads them; the others get none.
  nlohmann::json options = nlohmann::json::object();
  uint64_t seed = 0;
  Seeding seeding = Seeding::kBatch;
  /// Called after each denoising step with (step from 1, number of steps); with kPerImage, once
  /// per step of each image's run.
  std::function<void(int64_t, int64_t)> on_step;
};

/// What Pipeline::generate() produced.
struct GenerateResult {
  /// The media, float32 in [0, 1] on the CPU (Diffusers' output_type "np"): images
  /// [K, H, W, C], clips [K, F, H, W, C] (a video pipeline's `frames`); an image is one frame
  /// (frames()). Text-to-image prompt-major (prompt 0's first).
  torch::Tensor images;
  /// Text-to-image only (undefined for UNet pipelines): the final latents [K, c, h, w] (clips
  /// [K, c, f, h, w]) and the prompt embeddings, [2K, L, D] with guidance (negative rows first),
  /// else [K, L, D]; with kPerImage, each image's run's rows one after the other.
  torch::Tensor latents, prompt_embeds;
  /// The pooled text embedding [K, P] where the pipeline has one (FLUX.1's CLIP pooler output).
  torch::Tensor pooled_prompt_embeds;
  /// One grid caption per image: UNet "class L" (class-conditional) or "seed S #i" (kBatch) /
  /// "seed S+i" (kPerImage); text-to-image the prompt's first 28 characters ("..." when cut),
  /// with " #k" when a prompt has several images.
  std::vector<std::string> labels;
  /// Clips: the frame rate the model was trained at (Wan 16), what a video file is written at
  /// unless --fps says otherwise; 0 for images.
  double fps = 0;

  /// The tensors `difftrain sample --save_tensors` writes: "images", plus "latents",
  /// "prompt_embeds" and "pooled_prompt_embeds" when defined.
  std::map<std::string, torch::Tensor> tensors() const;
  /// Frames per item: 1 for images, F for clips.
  int64_t num_frames() const;
  /// The media with their frame axis, [K, F, H, W, C] (images as [K, 1, H, W, C]).
  torch::Tensor frames() const;
};

/// `media` ([K, H, W, C] images or [K, F, H, W, C] clips) as [K, F, H, W, C]; throws
/// difftrain::Error naming `what` for another rank.
torch::Tensor media_frames(const torch::Tensor& media, const std::string& what);

/// The grid captions of text-to-image results (GenerateResult::labels): for each prompt, its
/// first 28 characters ("..." when cut), with " #j" for each of its images when it has several.
std::vector<std::string> prompt_labels(const std::vector<std::string>& prompts,
                                       int64_t images_per_prompt);

/// How to load a pipeline folder (`difftrain sample`'s flags; each family takes what applies).
struct PipelineLoadOptions {
  /// The dtype the models are loaded in (Diffusers' `torch_dtype`); unset = float32. FLUX.1
  /// folders read each weight file straight into it (a 12 B transformer in bf16 never exists in
  /// float32); the other pipelines are cast after loading.
  std::optional<torch::Dtype> dtype;
  /// A name of sampler_names() ("euler", "dpmpp_2m_karras", ...) or a Diffusers scheduler class
  /// to run the folder's scheduler config with that sampler (as
  /// `EulerDiscreteScheduler.from_config(pipe.scheduler.config)`); "" = the folder's own class.
  std::string scheduler;
  /// DDIMScheduler's eta (other samplers ignore it).
  double eta = 0.0;
  /// A LoRA file (Diffusers, PEFT or kohya keys) merged into the denoiser and, for its text
  /// encoder targets, into the text encoders, with lora_scale (Diffusers: load_lora_weights +
  /// fuse_lora(lora_scale)).
  std::string lora;
  double lora_scale = 1.0;
  /// Weights variant ("fp16" reads *.fp16.safetensors), "" = default (text-to-image folders).
  std::string variant;
  /// A separate AutoencoderKL folder used instead of the pipeline's vae/ (Diffusers'
  /// --pretrained_vae_model_name_or_path, e.g. SDXL's fp16-safe VAE); "" = vae/.
  std::string vae;
};

/// A loaded pipeline (Diffusers' DiffusionPipeline): its models, its sampler and the order of
/// operations of its `__call__`. Move-only; each family's pipeline implements it.
class Pipeline {
 public:
  virtual ~Pipeline() = default;
  /// The Diffusers pipeline class it runs as ("DDPMPipeline", "StableDiffusionXLPipeline", ...).
  virtual std::string class_name() const = 0;
  /// Moves every model to `device` and, when given, casts it to `dtype` (Diffusers'
  /// `pipe.to(device, dtype)`). The noise still comes from the CPU generator in float32, so a seed
  /// gives the same images on any device.
  virtual void to(const torch::Device& device,
                  std::optional<torch::Dtype> dtype = std::nullopt) = 0;
  /// `request` with every default filled in for this pipeline (num_images, num_inference_steps,
  /// guidance_scale), as generate() will run it; for logging the settings before a run.
  virtual GenerateRequest resolve(GenerateRequest request) const = 0;
  /// Generates the request's images, once (kBatch) or once per image (kPerImage), with exactly
  /// the numbers of the pipeline's sampling function. Models run in eval mode under no-grad on
  /// their device. Throws difftrain::Error for requests the pipeline cannot take (prompts for a
  /// UNet pipeline, class labels for text-to-image, sizes the models cannot take).
  virtual GenerateResult generate(const GenerateRequest& request) = 0;

 protected:
  Pipeline() = default;
  Pipeline(Pipeline&&) = default;
  Pipeline& operator=(Pipeline&&) = default;
  Pipeline(const Pipeline&) = delete;
  Pipeline& operator=(const Pipeline&) = delete;
};

}  // namespace difftrain::diffusion
