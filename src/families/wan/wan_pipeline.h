#pragma once
// WanPipeline (Diffusers 0.40): Wan 2.1 text-to-video and Wan 2.2 A14B's two experts (transformer
// for the high-noise steps, transformer_2 below boundary_ratio); UMT5 prompt embeddings trimmed to
// each prompt's tokens and zero-padded; the folder's UniPC flow scheduler; the causal VAE's decode
// of the whole clip; frames [K, F, H, W, 3] in [0, 1]. A seed gives Diffusers' frames.

#include "../dit_lora.h"
#include "difftrain/diffusion/generate.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"
#include "difftrain/models/text_encoders/clip_vision_model.h"
#include "difftrain/models/text_encoders/t5_encoder.h"
#include "difftrain/models/tokenizers/t5_tokenizer.h"
#include "difftrain/models/transformers/wan_transformer.h"

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::families::wan {

struct WanFolder {
  std::string dir, pipeline_class;
  std::string transformer_dir, transformer_2_dir;  ///< transformer_2: "" unless Wan 2.2 A14B
  std::string vae_dir, text_encoder_dir, tokenizer_dir, scheduler_config;
  std::optional<double> boundary_ratio;  ///< model_index.json's (A14B: the expert switch)
  bool expand_timesteps = false;         ///< Wan 2.2 TI2V's per-token timesteps
  /// WanImageToVideoPipeline: the first frame (and, for FLF2V, the last) conditions the clip
  /// through its VAE latents and a mask concatenated to the noise (Wan 2.2 I2V: no image encoder).
  bool image_to_video = false;
  /// Wan 2.1 image to video: the CLIP vision model (image_encoder/) and its processor's config
  /// (image_processor/preprocessor_config.json; "" = CLIPImageProcessor's defaults).
  std::string image_encoder_dir, image_processor_config;
};

/// A WanPipeline folder; one line naming the file or folder when something is missing.
WanFolder resolve_wan_folder(const std::string& dir);
/// A pipeline folder's transformer/, or `dir` itself (a bare WanTransformer3DModel folder).
std::string wan_transformer_dir(const std::string& dir);

/// WanPipeline's prompt_clean: HTML entities unescaped twice (ftfy is not applied: Diffusers
/// skips it too when ftfy is not installed), runs of Python-regex whitespace made one space,
/// stripped.
std::string wan_prompt_clean(const std::string& text);

/// _get_t5_prompt_embeds: each prompt cleaned, tokenized to `max_sequence_length` (`</s>`, pads),
/// UMT5's last hidden state with the mask, each row cut to its tokens and zero-padded back:
/// [N, max_sequence_length, d_model] float32.
torch::Tensor encode_wan_prompts(const models::T5Tokenizer& tokenizer,
                                 models::T5EncoderModel& encoder,
                                 const std::vector<std::string>& prompts,
                                 int64_t max_sequence_length,
                                 std::vector<int64_t>* lengths = nullptr);
/// Image to video's condition (WanImageToVideoPipeline.prepare_latents, musubi-tuner's `y`): the
/// pixel values of the first frame `first` [B, 3, 1, H, W] in [-1, 1] (and of the last, or
/// undefined), zeros for the other frames of a `num_frames` clip, its VAE latent mode normalised
/// (z - mean) * (1 / std), after a 4-channel mask of the given frames (the first counted 4 times,
/// as the VAE's first latent frame stands for one frame): [B, 4 + z_dim, T, h, w] float32.
torch::Tensor wan_image_condition(models::AutoencoderKLQwenImage vae, const torch::Tensor& first,
                                  const torch::Tensor& last, int64_t num_frames);

class WanPipeline : public diffusion::Pipeline {
 public:
  WanFolder folder;
  std::shared_ptr<const models::T5Tokenizer> tokenizer;
  models::T5EncoderModel text_encoder{nullptr};
  models::WanTransformer3DModel transformer{nullptr};
  models::WanTransformer3DModel transformer_2{nullptr};  ///< A14B's low-noise expert, or null
  models::AutoencoderKLQwenImage vae{nullptr};           ///< Wan 2.1's VAE (also A14B's)
  models::ClipVisionModel image_encoder{nullptr};        ///< Wan 2.1 I2V's CLIP, or null
  models::ClipImageProcessorOptions image_processor;
  std::unique_ptr<diffusion::Sampler> scheduler;
  /// Set: one model holds either expert, and the pipeline calls this (true: the high-noise one)
  /// before each step instead of switching to transformer_2 (a run training one LoRA on both).
  std::function<void(bool high)> select_expert;
  /// Image to video: the first frame (and optionally the last), uint8 [H, W, 3], used when the
  /// request names none (request.options "image" / "last_image": file paths).
  torch::Tensor image, last_image;

  std::string class_name() const override {
    return folder.image_to_video ? "WanImageToVideoPipeline" : "WanPipeline";
  }
  void to(const torch::Device& device, std::optional<torch::Dtype> dtype = std::nullopt) override;
  diffusion::GenerateRequest resolve(diffusion::GenerateRequest request) const override;
  /// request.options: "num_frames" (81), "guidance_scale_2" (A14B's low-noise guidance, default
  /// guidance_scale), "image" / "last_image" (image to video). Frames [K, F, H, W, 3].
  diffusion::GenerateResult generate(const diffusion::GenerateRequest& request) override;
};

WanPipeline load_wan_pipeline(const std::string& dir,
                              const diffusion::PipelineLoadOptions& options = {});

/// Wan's LoRA layouts: Diffusers / PEFT (`transformer.blocks.N.attn1.to_q`), the original /
/// ComfyUI / musubi-tuner names (`diffusion_model.blocks.N.self_attn.q`, lora_down / lora_up /
/// .alpha) and kohya's (`lora_unet_blocks_N_self_attn_q`), as WanLoraLoaderMixin reads them.
const DitLoraLayout& wan_lora_layout();
io::LoraWeights read_wan_lora(const std::string& path, const std::string& dir,
                              const io::LoraReadOptions& options = {});

std::map<std::string, torch::Tensor> forward_wan(const std::string& dir,
                                                 const std::map<std::string, torch::Tensor>& in,
                                                 const std::string& source,
                                                 const std::string& lora = "",
                                                 double lora_scale = 1.0);

}  // namespace difftrain::families::wan
