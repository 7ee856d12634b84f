#pragma once
// QwenImagePipeline (Diffusers 0.40): a Qwen-Image folder (transformer, vae, text_encoder,
// tokenizer, scheduler) or a bare QwenImageTransformer2DModel folder; sampling as __call__ does,
// so that a seed gives Diffusers' images number for number; LoRA layouts; `difftrain forward`.

#include "../dit_lora.h"
#include "../pipeline_folder.h"
#include "difftrain/diffusion/generate.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/lora_layout.h"
#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"
#include "difftrain/models/transformers/qwen_image_transformer.h"
#include "difftrain/train/memory_estimate.h"
#include "difftrain/train/training_task.h"
#include "edit.h"

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::families::qwen_image {

using QwenImageFolder = TransformerFolder;

QwenImageFolder resolve_qwen_image_folder(const std::string& dir);
/// A pipeline folder's transformer/, or `dir` itself (a bare transformer folder).
std::string qwen_image_transformer_dir(const std::string& dir);

/// QwenImagePipeline's prompt_template_encode and prompt_template_encode_start_idx.
extern const char* const kQwenImagePromptTemplate;
constexpr int64_t kQwenImageTemplateDrop = 34;
/// tokenizer_max_length: the longest prompt (after the dropped template tokens).
constexpr int64_t kQwenImageTokenizerMaxLength = 1024;

/// The prompt embeddings of QwenImagePipeline._get_qwen_prompt_embeds: the encoder's last hidden
/// state at the real tokens, the template's first `drop` tokens dropped, zero-padded to the
/// batch's longest, with the mask of the kept tokens; with `length` > 0 each is cut to `length`
/// (encode_prompt's max_sequence_length) and padded to exactly that (a training run's cache).
std::shared_ptr<const diffusion::PromptComposition> qwen_image_prompt_composition(
    int64_t drop = kQwenImageTemplateDrop, int64_t length = 0);

/// With `visual` given, the text encoder's vision-tower tensors go there (the Edit pipelines').
diffusion::TextEncoderStack load_qwen_image_text_encoders(const QwenImageFolder& f,
                                                          const std::string& variant,
                                                          torch::Dtype dtype, int64_t length = 0,
                                                          io::TensorMap* visual = nullptr);

/// train_dreambooth_lora_qwen_image.py's LoRA targets without --lora_layers.
const std::vector<std::string>& default_qwen_image_lora_targets();

/// Packs latents [B, C, h, w] into [B, (h/2)(w/2), 4C] (2x2 patches), and back.
torch::Tensor pack_qwen_latents(const torch::Tensor& latents);
torch::Tensor unpack_qwen_latents(const torch::Tensor& packed, int64_t h, int64_t w);

class QwenImagePipeline : public diffusion::Pipeline {
 public:
  QwenImagePipeline() = default;
  QwenImagePipeline(QwenImagePipeline&&) = default;
  QwenImagePipeline& operator=(QwenImagePipeline&&) = default;

  QwenImageFolder folder;
  diffusion::TextEncoderStack text_encoders;  ///< Qwen2.5-VL, hidden_states[-1]
  models::QwenImageTransformer2DModel transformer{nullptr};
  models::AutoencoderKLQwenImage vae{nullptr};
  std::unique_ptr<diffusion::Sampler> scheduler;
  /// QwenImageEditPipeline / QwenImageEditPlusPipeline: the instruction is encoded with the
  /// reference images (Qwen2.5-VL's vision tower and image processor), whose latents the
  /// transformer sees after the noisy ones.
  EditKind edit = EditKind::kNone;
  models::Qwen2_5VisionTransformer visual{nullptr};
  models::Qwen2VLImageProcessorOptions processor;
  /// The Edit pipelines' reference images, uint8 [H, W, 3] (Diffusers' `image=`), used when the
  /// request names none (request.options["image"]: file paths).
  std::vector<torch::Tensor> images;

  std::string class_name() const override { return pipeline_class_of(edit); }
  void to(const torch::Device& device, std::optional<torch::Dtype> dtype = std::nullopt) override;
  diffusion::GenerateRequest resolve(diffusion::GenerateRequest request) const override;
  /// request.options: "true_cfg_scale" (CFG when > 1 with a negative prompt), "sigmas" (a list,
  /// optional), "image" (the Edit pipelines' reference image files). guidance_scale is refused
  /// (no Qwen-Image model embeds guidance). Edit: height / width default to the (last) reference
  /// image's size near 1024 x 1024 pixels.
  diffusion::GenerateResult generate(const diffusion::GenerateRequest& request) override;
};

/// `pipeline_class` "" takes the folder's model_index.json _class_name (QwenImagePipeline for a
/// bare transformer folder); an Edit pipeline also loads the text encoder's vision tower and the
/// processor/ folder's preprocessor_config.json (Qwen2-VL's defaults without one).
QwenImagePipeline load_qwen_image_pipeline(const std::string& dir,
                                           const diffusion::PipelineLoadOptions& options = {},
                                           const std::string& pipeline_class = "");

const DitLoraLayout& qwen_image_lora_layout();
io::LoraWeights read_qwen_image_lora(const std::string& path, const std::string& dir,
                                     const io::LoraReadOptions& options = {});

/// LoRA, DreamBooth and full fine-tuning of a QwenImagePipeline folder's transformer with flow
/// matching, as train_dreambooth_lora_qwen_image.py (qwen_image_task.cpp).
std::unique_ptr<train::TrainingTask> make_qwen_image_training_task(
    const train::TaskOptions& options);

/// `difftrain estimate-memory` of a Qwen-Image folder, transformer folder or config.json.
std::vector<train::MemoryEstimate> estimate_qwen_image_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies);

std::map<std::string, torch::Tensor> forward_qwen_image(
    const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
    const std::string& source, const std::string& lora, double lora_scale);

}  // namespace difftrain::families::qwen_image
