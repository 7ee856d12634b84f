#pragma once
// FLUX.1 text-to-image (Diffusers' FluxPipeline, v0.31): CLIP's pooled output and T5's per-token
// embeddings condition a FluxTransformer2DModel that predicts the flow-matching velocity of packed
// 2x2 latent patches; FlowMatchEulerDiscreteScheduler steps it (dynamic shifting from the image's
// sequence length); a 16-channel AutoencoderKL with shift_factor decodes. No classifier-free
// guidance: FLUX.1-dev embeds the guidance scale, FLUX.1-schnell takes none. Private to
// src/families/flux; `difftrain sample` and (issue 41) training validation call it.

#include "difftrain/diffusion/generate.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/transformers/flux_transformer.h"

#include <torch/types.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>

namespace difftrain::families::flux {

/// Where a FluxPipeline folder keeps its parts (model_index.json's components).
struct FluxFolder {
  std::string dir;
  std::string pipeline_class;  ///< model_index.json's _class_name
  std::string transformer_dir, vae_dir, text_encoder_dir, tokenizer_dir, text_encoder_2_dir,
      tokenizer_2_dir;
  std::string scheduler_config;  ///< scheduler/scheduler_config.json
};

/// Resolves the FluxPipeline folder `dir`; throws difftrain::Error naming the first missing part.
FluxFolder resolve_flux_folder(const std::string& dir);

/// FluxPipeline's vae_scale_factor: 2^len(block_out_channels) (16 for FLUX.1's 4-level VAE).
int64_t flux_vae_scale_factor(const models::AutoencoderKLConfig& vae);

/// A loaded FLUX.1 pipeline.
class FluxPipeline : public diffusion::Pipeline {
 public:
  FluxPipeline() = default;
  FluxPipeline(FluxPipeline&&) = default;
  FluxPipeline& operator=(FluxPipeline&&) = default;

  FluxFolder folder;
  diffusion::TextEncoderStack text_encoders;  ///< CLIP pooled + T5 per token
  models::FluxTransformer2DModel transformer{nullptr};
  models::AutoencoderKL vae{nullptr};
  std::unique_ptr<diffusion::Sampler> scheduler;

  std::string class_name() const override { return "FluxPipeline"; }
  void to(const torch::Device& device, std::optional<torch::Dtype> dtype = std::nullopt) override;
  /// FluxPipeline's defaults: 1 image per prompt, 28 steps, guidance 3.5, max_sequence_length
  /// 512, height and width 128 x vae_scale_factor.
  diffusion::GenerateRequest resolve(diffusion::GenerateRequest request) const override;
  /// FluxPipeline.__call__'s order of operations (see flux_pipeline.cpp). Kinds of seeding as
  /// diffusion::Seeding says. Result: images [K, H, W, 3], latents (the final packed latents
  /// unpacked, [K, 16, h, w]), prompt_embeds [K, L, D], pooled_prompt_embeds [K, P].
  diffusion::GenerateResult generate(const diffusion::GenerateRequest& request) override;
};

/// FluxPipeline's text side: CLIPTextModel (text_encoder, tokenizer) for the pooled embedding and
/// T5EncoderModel (text_encoder_2, tokenizer_2) per token, 512 tokens until
/// set_max_sequence_length(); read on the CPU in `dtype` (T5 file by file).
diffusion::TextEncoderStack load_flux_text_encoders(const FluxFolder& f, const std::string& variant,
                                                    torch::Dtype dtype);

/// Throws difftrain::Error when the parts of folder `f` do not fit together: the transformer's
/// in_channels against 4 x the VAE's latent channels, joint_attention_dim against T5's d_model,
/// pooled_projection_dim against CLIP's width (naming the file and the sizes).
void check_flux_parts(const FluxFolder& f, const models::FluxTransformer2DModelImpl& transformer,
                      const models::AutoencoderKLImpl& vae,
                      const diffusion::TextEncoderStack& text);

/// Loads the folder (float32 on the CPU, or `dtype`): both text encoders and tokenizers, the
/// transformer, the VAE and the scheduler (options.scheduler: another flow-matching class name
/// is taken, a DDPM-family sampler is refused), with options.lora merged into the transformer and
/// the CLIP text encoder. Throws difftrain::Error when a part is missing or the parts do not fit
/// together (naming the file and the sizes).
FluxPipeline load_flux_pipeline(const std::string& dir,
                                const diffusion::PipelineLoadOptions& options = {},
                                torch::Dtype dtype = torch::kFloat32);

}  // namespace difftrain::families::flux
