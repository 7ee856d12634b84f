#pragma once
// Stable Diffusion 1.x/2.x folders (Diffusers' StableDiffusionPipeline layout: model_index.json,
// unet/, vae/, text_encoder/, tokenizer/, scheduler/), and text-to-image sampling with the
// pipeline's order of operations, so the same seed gives Diffusers' images. A family built on
// this pipeline (SDXL, src/families/sdxl/) brings what it adds as a PipelineExtension: more
// components and text encoders, the UNet's added conditioning, its defaults.

#include "difftrain/diffusion/generate.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/unets/unet.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::families::stable_diffusion {

class PipelineExtension;

/// Where a Stable Diffusion folder keeps its parts, as read from model_index.json.
struct StableDiffusionFolder {
  std::string root;
  std::string pipeline_class;  ///< model_index.json's _class_name
  std::string unet_dir, vae_dir, text_encoder_dir, tokenizer_dir;
  /// The pipeline extension whose components model_index.json lists (SDXL's text_encoder_2 and
  /// tokenizer_2); null for StableDiffusionPipeline folders.
  std::shared_ptr<const PipelineExtension> extension;
  /// The extension's components: name -> folder (e.g. "text_encoder_2" -> ROOT/text_encoder_2).
  std::map<std::string, std::string> extension_dirs;
  /// model_index.json's force_zeros_for_empty_prompt (Diffusers' default true; SDXL's pipelines
  /// register it): with no negative prompt, an extension may take zero negative embeddings
  /// instead of the encoding of "".
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
/// a registered extension's components (SDXL's text_encoder_2 and tokenizer_2) come together and
/// make the folder that extension's; safety_checker, feature_extractor and image_encoder are
/// ignored with a note; anything else (an unknown component or class) throws difftrain::Error
/// naming the component, its class and what is supported. Missing sub-folders are errors naming the
/// path.
StableDiffusionFolder resolve_stable_diffusion_folder(const std::string& dir);

/// The component checks of resolve_stable_diffusion_folder() on model_index.json text already in
/// memory (`source` names it in errors): fills pipeline_class, scheduler_class and notes, leaves
/// the folder paths empty.
StableDiffusionFolder parse_model_index(const std::string& json_text, const std::string& source);

/// Options of load_stable_diffusion() (every field applies).
using StableDiffusionLoadOptions = diffusion::PipelineLoadOptions;

struct TextToImageOptions;

/// The loaded parts of a Stable Diffusion pipeline (float32, CPU when loaded): the Pipeline of
/// StableDiffusionPipeline folders and of the extensions' (StableDiffusionXLPipeline).
/// generate() runs text_to_image().
struct StableDiffusion : diffusion::Pipeline {
  StableDiffusionFolder folder;
  /// tokenizer + text_encoder (last_hidden_state()), or the extension's stack.
  diffusion::TextEncoderStack text_encoders;
  models::AutoencoderKL vae{nullptr};
  models::UNet unet{nullptr};
  std::unique_ptr<diffusion::Sampler> scheduler;

  /// The folder's pipeline class; "StableDiffusionPipeline" (or the extension's first class)
  /// when assembled in memory (training).
  std::string class_name() const override;
  void to(const torch::Device& device, std::optional<torch::Dtype> dtype = std::nullopt) override;
  /// Defaults: one image per prompt, 50 steps, guidance 7.5 (or the extension's).
  diffusion::GenerateRequest resolve(diffusion::GenerateRequest request) const override;
  diffusion::GenerateResult generate(const diffusion::GenerateRequest& request) override;
};

/// The prompt embeddings of a text-to-image run and the UNet's added conditioning, as
/// PipelineExtension::encode_prompts() gives them: rows [negatives; prompts] with guidance.
struct PromptConditioning {
  torch::Tensor embeds;       ///< encoder_hidden_states [R, L, D]
  torch::Tensor text_embeds;  ///< added conditioning (e.g. SDXL's pooled embeddings [R, P])
  torch::Tensor time_ids;     ///< added conditioning (e.g. SDXL's time ids [R, 6])
};

/// What a pipeline built on StableDiffusionPipeline adds to it (StableDiffusionXLPipeline, in
/// src/families/sdxl/): model_index.json components, the text encoders, the UNet's added
/// conditioning (checked at load, computed when sampling), and the pipeline's defaults. The
/// family that brings one registers it (register_pipeline_extension); a folder whose
/// model_index.json lists one of its components is that extension's.
class PipelineExtension {
 public:
  virtual ~PipelineExtension() = default;
  /// How errors name its folders ("SDXL").
  virtual std::string display_name() const = 0;
  /// Its pipeline classes; the first is a pipeline assembled in memory's class_name().
  virtual std::vector<std::string> pipeline_classes() const = 0;
  /// The model_index.json components it adds, in order, each with the classes it reads; a folder
  /// lists all of them or none.
  virtual std::vector<std::pair<std::string, std::vector<std::string>>> components() const = 0;
  /// The pipeline's default guidance scale.
  virtual double default_guidance() const = 0;
  /// The folder's tokenizers and text encoders (the base's tokenizer + text_encoder and the
  /// extension's), safetensors `variant`.
  virtual diffusion::TextEncoderStack load_text_encoders(const StableDiffusionFolder& folder,
                                                         const std::string& variant) const = 0;
  /// Checks that the UNet's added conditioning fits the text encoders; throws difftrain::Error
  /// (one line naming folder.unet_dir) when the folder mixes models.
  virtual void check_unet(const StableDiffusionFolder& folder, const models::UNet& unet,
                          const diffusion::TextEncoderStack& text) const = 0;
  /// The text-to-image run's embeddings and added conditioning (before the move to the UNet's
  /// device): each prompt's rows repeated num_images_per_prompt times, `negatives` (one per
  /// prompt) first when `guided`. The image is height x width pixels.
  virtual PromptConditioning encode_prompts(StableDiffusion& sd, const TextToImageOptions& options,
                                            const std::vector<std::string>& negatives,
                                            int64_t height, int64_t width, bool guided) const = 0;
  /// Whether a float16 VAE whose config says force_upcast decodes in float32 (and goes back to
  /// float16 afterwards), as StableDiffusionXLPipeline's upcast_vae.
  virtual bool upcasts_vae() const { return false; }
  /// The sample options (TextToImageOptions::options) it reads; others are refused.
  virtual std::vector<std::string> option_names() const { return {}; }
};

/// Registers an extension (a family built on this pipeline calls it when it registers). Throws
/// difftrain::Error when another extension already claims one of its components.
void register_pipeline_extension(std::shared_ptr<const PipelineExtension> extension);
/// The registered extensions (the built-in families registered first).
std::vector<std::shared_ptr<const PipelineExtension>> pipeline_extensions();

/// Loads every part of the folder (see resolve_stable_diffusion_folder) and merges the LoRA.
/// Each tokenizer's model_max_length is capped at its text encoder's max_position_embeddings.
StableDiffusion load_stable_diffusion(const std::string& dir,
                                      const StableDiffusionLoadOptions& options = {});

/// The folder's text encoders and tokenizers: one CLIP (text_encoder, tokenizer), or the
/// extension's stack; safetensors `variant`.
diffusion::TextEncoderStack load_text_encoders(const StableDiffusionFolder& folder,
                                               const std::string& variant = "");

/// The checks load_stable_diffusion() makes of a UNet against the folder's text encoders:
/// cross-attention of the text width, added conditioning when and only when the folder's
/// extension gives it (PipelineExtension::check_unet). Throws one line naming folder.unet_dir.
void check_unet_fits(const StableDiffusionFolder& folder, const models::UNet& unet,
                     const diffusion::TextEncoderStack& text);

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
  /// The extension's own `__call__` arguments by their Diffusers names (SDXL's micro-
  /// conditioning: "original_size": [H, W], ...); absent or null = the pipeline's default. A
  /// name the folder's extension does not read is refused.
  nlohmann::json options = nlohmann::json::object();
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
  /// The UNet's added conditioning, when the folder's extension gives one (SDXL: the pooled
  /// embeddings [2 N K, P] and time ids [2 N K, 6]), in prompt_embeds' order.
  torch::Tensor pooled_prompt_embeds, add_time_ids;
};

/// StableDiffusionPipeline.__call__'s order of operations: encode prompt and negative prompt,
/// draw latents from a CPU generator seeded with `seed` (randn, float32) times
/// init_noise_sigma, then per timestep the UNet on cat([x, x]) with cat([negative, prompt])
/// embeddings, guidance eps_u + g (eps_c - eps_u), the scheduler step (DDIM with eta and the same
/// generator), and finally vae.decode(latents / scaling_factor) mapped to [0, 1]. A folder's
/// extension encodes the prompts and the UNet's added conditioning instead
/// (PipelineExtension::encode_prompts: StableDiffusionXLPipeline's encode_prompt and
/// add_time_ids), and may decode a float16 VAE in float32 (upcasts_vae). Models run in eval mode
/// under no-grad. Throws difftrain::Error for sizes the models cannot take.
TextToImageResult text_to_image(StableDiffusion& sd, const TextToImageOptions& options);

}  // namespace difftrain::families::stable_diffusion
