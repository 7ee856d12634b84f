// The SDXL text-to-image task (Diffusers' train_text_to_image_lora_sdxl.py,
// train_dreambooth_lora_sdxl.py, train_text_to_image_sdxl.py): the Stable-Diffusion task with
// SDXL's text side: the two-CLIP TextEncoderStack (CLIPTextModel and
// CLIPTextModelWithProjection: prompt embeddings from both encoders' hidden_states[-(skip + 2)],
// the pooled embedding from the second), and per-image time ids (original size, crop corner,
// trained size) as the UNet's added conditioning; LoRA on both encoders with --train_text_encoder;
// the cache holds both embeddings; a full fine-tune exports a whole SDXL folder.
#include "../stable_diffusion/text_to_image_task.h"
#include "sdxl.h"

namespace difftrain::families::sdxl {
using namespace difftrain::train;
using namespace difftrain::diffusion;
using namespace difftrain::families::unet;
using namespace difftrain::families::stable_diffusion;

namespace {

class SdxlTask final : public families::stable_diffusion::TextToImageTask {
 public:
  using TextToImageTask::TextToImageTask;

  std::string name() const override { return "sdxl"; }

  // As Diffusers' _sdxl scripts: openrail++, the stable-diffusion-xl tags.
  ModelCard model_card() const override {
    ModelCard card = TextToImageTask::model_card();
    card.title.replace(0, std::string("Stable Diffusion").size(), "SDXL");
    if (const auto at = card.description.find(".py)"); at != std::string::npos) {
      card.description.insert(at, "_sdxl");  // train_text_to_image_lora_sdxl.py, ...
    }
    card.license = "openrail++";
    card.tags = {"text-to-image", "stable-diffusion-xl", "stable-diffusion-xl-diffusers"};
    if (folder_.pipeline_class.empty()) card.pipeline_class = "StableDiffusionXLPipeline";
    return card;
  }

 protected:
  std::shared_ptr<const PipelineExtension> extension() const override {
    return sdxl::pipeline_extension();
  }

  // add_time_ids per image: original (h, w), crop (top, left), target (h, w) = the trained size
  // (Diffusers' compute_time_ids with target_size = the resolution; the bucket's with buckets).
  torch::Tensor time_ids(const data::Batch& batch, const std::string& prefix,
                         const torch::Tensor& latents) const override {
    const int64_t factor = vae_->config().downsample_factor();
    const auto target =
        torch::tensor({latents.size(2) * factor, latents.size(3) * factor}, torch::kInt64)
            .expand({latents.size(0), 2});
    return torch::cat({batch.at(prefix + "original_size").to(torch::kCPU),
                       batch.at(prefix + "crop_top_left").to(torch::kCPU), target},
                      1)
        .to(torch::kFloat32);
  }
};

}  // namespace

std::unique_ptr<TrainingTask> make_sdxl_task(TaskOptions options) {
  return std::make_unique<SdxlTask>(std::move(options));
}

}  // namespace difftrain::families::sdxl
