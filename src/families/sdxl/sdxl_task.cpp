// The SDXL text-to-image task (Diffusers' train_text_to_image_lora_sdxl.py,
// train_dreambooth_lora_sdxl.py, train_text_to_image_sdxl.py): the Stable-Diffusion task with
// SDXL's text side. Two tokenizers and text encoders (CLIPTextModel and
// CLIPTextModelWithProjection), prompt embeddings from both encoders' hidden_states[-(skip + 2)],
// the pooled embedding, and per-image time ids (original size, crop corner, trained size) as the
// UNet's added conditioning; LoRA on both encoders with --train_text_encoder; the cache holds
// both embeddings; a full fine-tune exports a whole SDXL folder.
#include "../stable_diffusion/text_to_image_task.h"

namespace difftrain::train {

namespace {

class SdxlTask final : public t2i::TextToImageTask {
 public:
  using TextToImageTask::TextToImageTask;

  std::string name() const override { return "sdxl"; }

 protected:
  std::vector<torch::nn::Module*> frozen_modules() const override {
    auto out = TextToImageTask::frozen_modules();
    out.push_back(text_encoder_2_.ptr().get());
    return out;
  }

  void load_text_models(accel::Accelerator& acc) override {
    if (!folder_.xl) {
      throw Error(folder_.root + ": not an SDXL folder (model_index.json lists no text_encoder_2)");
    }
    const auto& t = o_.text;
    tokenizer_ = models::ClipTokenizer::from_folder(folder_.tokenizer_dir);
    text_encoder_ = models::load_clip_text_model(folder_.text_encoder_dir, o_.model.variant);
    tokenizer_2_ = models::ClipTokenizer::from_folder(folder_.tokenizer_2_dir);
    text_encoder_2_ = models::load_clip_text_model(folder_.text_encoder_2_dir, o_.model.variant,
                                                   /*with_projection=*/true);
    auto cap = [](models::ClipTokenizer& tok, const models::ClipTextModel& te) {
      const int64_t positions = te->config().max_position_embeddings;
      if (tok.model_max_length() > positions) tok.set_model_max_length(positions);
    };
    cap(tokenizer_, text_encoder_);
    cap(tokenizer_2_, text_encoder_2_);
    // The prompt embedding is already the penultimate layer's output: one layer fewer can be
    // skipped than for SD-1.x.
    const int64_t layers = std::min(text_encoder_->config().num_hidden_layers,
                                    text_encoder_2_->config().num_hidden_layers);
    if (t.clip_skip >= layers) {
      throw Error("--clip_skip " + std::to_string(t.clip_skip) +
                  " is too large for SDXL, whose prompt embedding is already the penultimate "
                  "layer: at most " +
                  std::to_string(layers - 1) + " for these text encoders");
    }
    skip_ = t.clip_skip - 1;
    freeze(*text_encoder_, acc);
    freeze(*text_encoder_2_, acc);
  }

  void check_unet() const override {
    if (!unet_->needs_added_conditioning()) {
      throw Error(folder_.unet_dir +
                  ": an SDXL folder's UNet needs addition_embed_type \"text_time\"; the folder "
                  "mixes models");
    }
  }

  CaptionIds caption_ids() const override {
    auto tokenizer = tokenizer_, tokenizer_2 = tokenizer_2_;
    return [tokenizer, tokenizer_2](data::Example& ex, const std::string& prefix,
                                    const std::string& caption) {
      ex[prefix + "input_ids"] = torch::tensor(tokenizer.encode(caption).input_ids, torch::kInt64);
      ex[prefix + "input_ids_2"] =
          torch::tensor(tokenizer_2.encode(caption).input_ids, torch::kInt64);
    };
  }

  TextEmbeddings encode_ids(const data::Batch& batch, const std::string& prefix) override {
    const auto device = t2i::module_device(*text_encoder_);
    const auto ids = batch.at(prefix + "input_ids").to(device);
    const auto ids_2 = batch.at(prefix + "input_ids_2").to(device);
    std::optional<torch::NoGradGuard> no_grad;
    if (!o_.lora.train_text_encoder) no_grad.emplace();
    auto e = diffusion::encode_ids_xl(*text_encoder_, *text_encoder_2_, ids, ids_2, skip_);
    return {e.embeds, e.pooled};
  }

  std::map<std::string, torch::Tensor> encode_captions(
      const std::vector<std::string>& captions) override {
    auto e = diffusion::encode_prompts_xl(tokenizer_, *text_encoder_, tokenizer_2_,
                                          *text_encoder_2_, captions, skip_);
    return {{"prompt_embeds", e.embeds.to(torch::kCPU, torch::kFloat32)},
            {"pooled_prompt_embeds", e.pooled.to(torch::kCPU, torch::kFloat32)}};
  }

  std::string text_cache_key() const override {
    return TextToImageTask::text_cache_key() + "xl;" + folder_stamp(folder_.text_encoder_2_dir) +
           folder_stamp(folder_.tokenizer_2_dir);
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

  void add_text_models(diffusion::StableDiffusion& sd) const override {
    TextToImageTask::add_text_models(sd);
    sd.tokenizer_2 = tokenizer_2_;
    sd.text_encoder_2 = text_encoder_2_;
  }

  std::vector<std::string> copied_parts() const override {
    auto parts = TextToImageTask::copied_parts();
    parts.insert(parts.end(), {"text_encoder_2", "tokenizer_2"});
    return parts;
  }

  // StableDiffusionXLPipeline's guidance.
  double default_guidance() const override { return 5.0; }

  torch::nn::Module* second_text_encoder() const override { return text_encoder_2_.ptr().get(); }

 private:
  models::ClipTokenizer tokenizer_2_;
  models::ClipTextModel text_encoder_2_{nullptr};
};

}  // namespace

std::unique_ptr<TrainingTask> make_sdxl_task(TaskOptions options) {
  return std::make_unique<SdxlTask>(std::move(options));
}

}  // namespace difftrain::train
