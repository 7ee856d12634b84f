#pragma once
// Z-Image text-to-image (Diffusers' ZImagePipeline): each prompt wrapped in Qwen3's chat template,
// padded to max_sequence_length, its Qwen3 hidden_states[-2] at the real tokens (a list: one
// length per prompt) conditions a ZImageTransformer2DModel; Z-Image's sigmas through
// FlowMatchEulerDiscreteScheduler (denoise.h); the FLUX.1-layout 16-channel AutoencoderKL decodes
// with the folder's scaling and shift factors. Private to src/families/z_image.

#include "../pipeline_folder.h"
#include "difftrain/diffusion/generate.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/lora_layout.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/transformers/z_image_transformer.h"

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::families::z_image {

/// Where a ZImagePipeline folder keeps its parts (model_index.json's components).
using ZImageFolder = TransformerFolder;

/// Resolves the ZImagePipeline folder `dir`; throws difftrain::Error naming the first missing part.
ZImageFolder resolve_z_image_folder(const std::string& dir);
/// The transformer folder of `dir`: its transformer/ when `dir` is a pipeline folder, else `dir`.
std::string z_image_transformer_dir(const std::string& dir);

/// ZImagePipeline's vae_scale_factor: 2^(len(block_out_channels) - 1) (8); sizes must be
/// multiples of twice it.
int64_t z_image_vae_scale_factor(const models::AutoencoderKLConfig& vae);

/// ZImagePipeline's prompt embeddings: one decoder LLM's hidden_states[-2] (its last layer
/// skipped), with the tokens' mask kept; real_token_embeds() cuts each row to its real tokens.
std::shared_ptr<const diffusion::PromptComposition> llm_penultimate_hidden_state();
/// Row i of `embeds` at its real tokens (attention_mask 1): ZImagePipeline's list of [L_i, D].
std::vector<torch::Tensor> real_token_embeds(const diffusion::PromptEmbeds& embeds);

/// ZImagePipeline's text side: Qwen3Model (text_encoder) with its Qwen2Tokenizer (tokenizer), the
/// chat template applied with enable_thinking, 512 tokens until set_max_sequence_length(); read
/// on the CPU in `dtype`, file by file.
diffusion::TextEncoderStack load_z_image_text_encoders(const ZImageFolder& f,
                                                       const std::string& variant,
                                                       torch::Dtype dtype);

/// A loaded Z-Image pipeline.
class ZImagePipeline : public diffusion::Pipeline {
 public:
  ZImagePipeline() = default;
  ZImagePipeline(ZImagePipeline&&) = default;
  ZImagePipeline& operator=(ZImagePipeline&&) = default;

  ZImageFolder folder;
  diffusion::TextEncoderStack text_encoders;  ///< Qwen3, hidden_states[-2]
  models::ZImageTransformer2DModel transformer{nullptr};
  models::AutoencoderKL vae{nullptr};
  std::unique_ptr<diffusion::Sampler> scheduler;

  std::string class_name() const override { return "ZImagePipeline"; }
  void to(const torch::Device& device, std::optional<torch::Dtype> dtype = std::nullopt) override;
  /// ZImagePipeline's defaults: 1 image per prompt, 50 steps, guidance 5, max_sequence_length
  /// 512, 1024 x 1024; options "cfg_normalization" (false) and "cfg_truncation" (1).
  diffusion::GenerateRequest resolve(diffusion::GenerateRequest request) const override;
  /// ZImagePipeline.__call__: CFG when guidance_scale > 0 (negative prompts default to ""),
  /// noise randn([K, 16, 2 (H / 16), 2 (W / 16)]) from the CPU generator in float32, the
  /// denoising loop, the VAE decode. Result: images [K, H, W, 3], latents [K, 16, h, w],
  /// prompt_embeds [K, L, D] (each prompt's embeddings, zero-padded to the longest).
  diffusion::GenerateResult generate(const diffusion::GenerateRequest& request) override;
};

/// Throws difftrain::Error when the parts of folder `f` do not fit together: the transformer's
/// in_channels against the VAE's latent channels, cap_feat_dim against the text encoder's width.
void check_z_image_parts(const ZImageFolder& f,
                         const models::ZImageTransformer2DModelImpl& transformer,
                         const models::AutoencoderKLImpl& vae,
                         const diffusion::TextEncoderStack& text);

/// Loads the folder (float32 on the CPU, or options.dtype): text encoder and tokenizer,
/// transformer, VAE and scheduler, with options.lora merged into the transformer.
ZImagePipeline load_z_image_pipeline(const std::string& dir,
                                     const diffusion::PipelineLoadOptions& options = {});

/// A LoRA file for the Z-Image folder `dir` (any layout Diffusers' ZImageLoraLoaderMixin reads:
/// Diffusers / PEFT `transformer.` keys, ComfyUI / musubi-tuner `diffusion_model.` keys, kohya
/// `lora_unet_` names resolved against the transformer's modules), its targets under
/// "transformer".
io::LoraWeights read_z_image_lora(const std::string& path, const std::string& dir,
                                  const io::LoraReadOptions& options = {});
/// ModelFamily::adapt_lora: kohya names resolved; for kKohya, the targets under kohya's
/// `lora_unet_` prefix, as musubi-tuner and Diffusers' converter name them.
void adapt_z_image_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat format);
/// The ComfyUI / musubi-tuner key layout (`diffusion_model.<module>.lora_down.weight`,
/// `.lora_up.weight`, `.alpha`; also with lora_A / lora_B), read as `transformer.` keys.
io::LoraKeyLayout z_image_lora_key_layout();

/// `difftrain forward`: ZImageTransformer2DModel on `x.<i>`, `t`, `cap_feats.<i>`; out.<i>.
std::map<std::string, torch::Tensor> forward_z_image(
    const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
    const std::string& source, const std::string& lora, double lora_scale);

}  // namespace difftrain::families::z_image
