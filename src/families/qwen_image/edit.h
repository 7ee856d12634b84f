#pragma once
// Qwen-Image-Edit's inputs (QwenImageEditPipeline, QwenImageEditPlusPipeline; Diffusers 0.40):
// the reference images' two sizes (one near 1024 x 1024 pixels for the VAE, and for Edit Plus
// one near 384 x 384 for the vision tower), the instruction encoded by Qwen2.5-VL WITH the
// images in the prompt (the system template with <|vision_start|><|image_pad|><|vision_end|>,
// each <|image_pad|> expanded to the image's merged patches), and the reference latents that
// the transformer sees after the noisy ones.

#include "difftrain/diffusion/qwen3_text_encoder.h"
#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"
#include "difftrain/models/text_encoders/qwen2_5_vl_vision.h"
#include "difftrain/models/transformers/qwen_image_transformer.h"

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::families::qwen_image {

/// Which pipeline a folder (or --pipeline) asks for.
enum class EditKind { kNone, kEdit, kEditPlus };

/// "QwenImagePipeline" -> kNone, "QwenImageEditPipeline" -> kEdit, "QwenImageEditPlusPipeline"
/// -> kEditPlus; another name throws difftrain::Error naming `where` and the three.
EditKind edit_kind_of(const std::string& pipeline_class, const std::string& where);
std::string pipeline_class_of(EditKind kind);

/// The Edit pipelines' system template and how many of its tokens are dropped (64).
extern const char* const kQwenImageEditTemplate;
extern const char* const kQwenImageEditPlusTemplate;
constexpr int64_t kQwenImageEditTemplateDrop = 64;

/// calculate_dimensions(target_area, width / height): {width, height}, each sqrt-scaled to the
/// area and rounded (half to even) to a multiple of 32.
std::array<int64_t, 2> qwen_calculate_dimensions(double target_area, double ratio);

/// The reference images as the pipelines prepare them.
struct EditImages {
  /// What the vision tower sees (the processor's input): Edit: the image resized to its VAE size;
  /// Edit Plus: each image resized to ~384 x 384 pixels (PIL lanczos). uint8 [h, w, 3].
  std::vector<torch::Tensor> condition;
  /// What the VAE encodes: each image resized to ~1024 x 1024 pixels (lanczos), float32
  /// [1, 3, 1, H, W] in [-1, 1].
  std::vector<torch::Tensor> vae_pixels;
  /// The default output size: the (last) image's VAE size.
  int64_t height = 0, width = 0;
};

/// Throws difftrain::Error for no image, Edit with more than one, or a non-RGB tensor.
EditImages prepare_edit_images(const std::vector<torch::Tensor>& images, EditKind kind);

/// _get_qwen_prompt_embeds of the Edit pipelines, each prompt encoded with every condition
/// image (Diffusers' processor pairs one prompt with the images; several prompts are encoded one
/// by one, then zero-padded to the longest): {embeds [N, L, D] float32, mask int64 [N, L]}.
std::pair<torch::Tensor, torch::Tensor> encode_edit_prompts(
    const diffusion::Qwen3TextEncoder& encoder, models::Qwen2_5VisionTransformer& visual,
    const models::Qwen2VLImageProcessorOptions& processor, const std::vector<std::string>& prompts,
    const std::vector<torch::Tensor>& condition, EditKind kind);

/// The reference latents: each VAE image encoded (the posterior's mode), normalised by
/// latents_mean / latents_std, packed 2x2, then concatenated along the sequence ->
/// [1, sum of (H/16)(W/16), 4 z_dim]; `grids` gets each one's (1, H/16, W/16).
torch::Tensor encode_reference_latents(models::AutoencoderKLQwenImage& vae,
                                       const std::vector<torch::Tensor>& vae_pixels,
                                       models::QwenImageGrids* grids);

}  // namespace difftrain::families::qwen_image
