#pragma once
// Stable Diffusion 1.x/2.x folders (Diffusers' StableDiffusionPipeline layout: model_index.json,
// unet/, vae/, text_encoder/, tokenizer/, scheduler/) and SDXL folders
// (StableDiffusionXLPipeline: text_encoder_2/ and tokenizer_2/ too), and text-to-image sampling
// with each pipeline's order of operations, so the same seed gives Diffusers' images.

#include "difftrain/diffusion/generate.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/unets/unet.h"

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::families::stable_diffusion {

/// Where a Stable Diffusion folder keeps its parts, as read from model_index.json.
struct StableDiffusionFolder {
  std::string root;
  std::string pipeline_class;  ///< model_index.json's _class_name
  std::string unet_dir, vae_dir, text_encoder_dir, tokenizer_dir;
  /// SDXL (StableDiffusionXLPipeline): text_encoder_2 (CLIPTextModelWithProjection) and
  /// tokenizer_2; empty for SD-1.x/2.x.
  std::string text_encoder_2_dir, tokenizer_2_dir;
  /// model_index.json lists text_encoder_2 and tokenizer_2.
  bool xl = false;
  /// SDXL's force_zeros_for_empty_prompt (model_index.json; Diffusers' default true): with no
  /// negative prompt, the negative embeddings are zeros instead of the encoding of "".
  bool force_zeros_for_empty_prompt = true;
  std::string scheduler_config;  ///< scheduler/scheduler_config.json
  std::string scheduler_class;   ///< model_index.json's scheduler class, e.g. "PNDMScheduler"
  /// One line per listed component that is present but not used (safety_checker,
  /// feature_extractor, image_encoder), for the caller to log.
  std::vector<std::string> notes;
};

/// Whether `dir` has a model_index.json that lists a text_encoder (a text-to-image pipeline).
bool is_stable_diffusion_folder(const std::string& dir);

/// Reads `dir`/model_index.json and checks every component it lists: unet
/// (UNet2DConditionModel), vae (AutoencoderKL), text_encoder (CLIPTextModel), tokenizer
/// (CLIPTokenizer / CLIPTokenizerFast with vocab.json + merges.txt) and scheduler are required;
/// SDXL's text_encoder_2 (CLIPTextModelWithProjection) and tokenizer_2 come together;
/// safety_checker, feature_extractor and image_encoder are ignored with a note; anything else
/// (an unknown component or class) throws difftrain::Error naming the component, its class and
/// what is supported. Missing sub-folders are errors naming the path.
StableDiffusionFolder resolve_stable_diffusion_folder(const std::string& dir);

/// The component checks of resolve_stable_diffusion_folder() on model_index.json text already in
/// memory (`source` names it in errors): fills pipeline_class, scheduler_class and notes, leaves
/// the folder paths empty.
StableDiffusionFolder parse_model_index(const std::string& json_text, const std::string& source);

/// Options of load_stable_diffusion() (every field applies).
using StableDiffusionLoadOptions = diffusion::PipelineLoadOptions;

/// The loaded parts of a Stable Diffusion pipeline (float32, CPU when loaded): the Pipeline of
/// StableDiffusionPipeline / StableDiffusionXLPipeline folders. generate() runs text_to_image().
struct StableDiffusion : diffusion::Pipeline {
  StableDiffusionFolder folder;
  /// tokenizer + text_encoder (last_hidden_state()), SDXL: and tokenizer_2 + text_encoder_2
  /// (concatenated_hidden_states()).
  diffusion::TextEncoderStack text_encoders;
  models::AutoencoderKL vae{nullptr};
  models::UNet unet{nullptr};
  std::unique_ptr<diffusion::Sampler> scheduler;
  /// Whether it is SDXL (two text encoders).
  bool is_xl() const { return text_encoders.size() == 2; }

  /// The folder's pipeline class; "StableDiffusionPipeline" / "StableDiffusionXLPipeline" when
  /// assembled in memory (training).
  std::string class_name() const override;
  void to(const torch::Device& device, std::optional<torch::Dtype> dtype = std::nullopt) override;
  /// Defaults: one image per prompt, 50 steps, guidance 7.5 (SDXL 5).
  diffusion::GenerateRequest resolve(diffusion::GenerateRequest request) const override;
  diffusion::GenerateResult generate(const diffusion::GenerateRequest& request) override;
};

/// Loads every part of the folder (see resolve_stable_diffusion_folder) and merges the LoRA.
/// Each tokenizer's model_max_length is capped at its text encoder's max_position_embeddings.
StableDiffusion load_stable_diffusion(const std::string& dir,
                                      const StableDiffusionLoadOptions& options = {});

/// The folder's text encoders and tokenizers: one CLIP (text_encoder, tokenizer) or, for SDXL,
/// two (and text_encoder_2 with its projection, tokenizer_2); safetensors `variant`.
diffusion::TextEncoderStack load_text_encoders(const StableDiffusionFolder& folder,
                                               const std::string& variant = "");

/// SDXL's micro-conditioning: [original_size (h, w), crops_coords_top_left (top, left),
/// target_size (h, w)] as one row [1, 6] float32 (`_get_add_time_ids`).
torch::Tensor xl_time_ids(const std::vector<int64_t>& original_size,
                          const std::vector<int64_t>& crops_coords_top_left,
                          const std::vector<int64_t>& target_size);

/// Diffusers' rescale_noise_cfg (Lin et al., "Common Diffusion Noise Schedules and Sample Steps
/// are Flawed", 3.4): noise_cfg rescaled to the per-sample std of noise_pred_text, mixed with
/// the unrescaled one by guidance_rescale in [0, 1].
torch::Tensor rescale_noise_cfg(const torch::Tensor& noise_cfg,
                                const torch::Tensor& noise_pred_text, double guidance_rescale);

/// Settings of one text-to-image run (StableDiffusionPipeline.__call__ arguments).
struct TextToImageOptions {
  std::vector<std::string> prompts;
  /// One per prompt, or one for all, or empty ("" for every prompt, as Diffusers).
  std::vector<std::string> negative_prompts;
  /// > 1 enables classifier-free guidance against the negative prompt.
  double guidance_scale = 7.5;
  int64_t num_inference_steps = 50;
  /// Image size in pixels, multiples of the VAE's downsample factor; 0 = unet sample_size x
  /// that factor.
  int64_t height = 0, width = 0;
  int64_t num_images_per_prompt = 1;
  uint64_t seed = 0;
  /// Diffusers' clip_skip: text embeddings from that many layers before the last (0 = last).
  int64_t clip_skip = 0;
  /// Diffusers' guidance_rescale (0 = off): see rescale_noise_cfg.
  double guidance_rescale = 0.0;
  /// SDXL micro-conditioning, each a pair (h, w) / (top, left); empty = Diffusers' default
  /// ((height, width), (0, 0), (height, width)). The negative_* ones default to the positive
  /// ones.
  std::vector<int64_t> original_size, crops_coords_top_left, target_size;
  std::vector<int64_t> negative_original_size, negative_crops_coords_top_left, negative_target_size;
  /// Initial latents [N * num_images_per_prompt, C, h, w] instead of drawing them (tests).
  torch::Tensor latents;
  /// Called after each step with (step index from 1, number of steps).
  std::function<void(int64_t, int64_t)> on_step;
};

/// What a text-to-image run produced.
struct TextToImageResult {
  /// [N * K, H, W, 3] float32 in [0, 1] (output_type "np"), prompt-major: prompt 0's K images
  /// first.
  torch::Tensor images;
  torch::Tensor latents;        ///< final latents [N * K, C, h, w]
  torch::Tensor prompt_embeds;  ///< [2 N K, L, D] with CFG (negative rows first), else [N K, L, D]
  /// SDXL only: the pooled embeddings [2 N K, P] and time ids [2 N K, 6], in prompt_embeds' order.
  torch::Tensor pooled_prompt_embeds, add_time_ids;
};

/// StableDiffusionPipeline.__call__'s order of operations: encode prompt and negative prompt,
/// draw latents from a CPU generator seeded with `seed` (randn, float32) times
/// init_noise_sigma, then per timestep the UNet on cat([x, x]) with cat([negative, prompt])
/// embeddings, guidance eps_u + g (eps_c - eps_u), the scheduler step (DDIM with eta and the same
/// generator), and finally vae.decode(latents / scaling_factor) mapped to [0, 1]. For SDXL,
/// StableDiffusionXLPipeline.__call__'s: encode_prompt with both encoders (zero negatives when
/// force_zeros_for_empty_prompt and no negative prompt), add_time_ids, text_embeds and time_ids
/// passed to the UNet, guidance_rescale, and a VAE decode in float32 when force_upcast and the
/// VAE is float16. Models run in eval mode under no-grad. Throws difftrain::Error for sizes the
/// models cannot take.
TextToImageResult text_to_image(StableDiffusion& sd, const TextToImageOptions& options);

}  // namespace difftrain::families::stable_diffusion
