// make_text_to_image_task: the Stable-Diffusion text-to-image task (text_to_image_task.h).
#include "text_to_image_task.h"

namespace difftrain::families::stable_diffusion {
using namespace difftrain::train;
using namespace difftrain::diffusion;
using namespace difftrain::families::unet;

void TextToImageTask::build(accel::Accelerator& acc, const std::string& output_dir) {
  const auto& t = o_.text;
  TextImageData::check_options(o_, o_.model.pretrained_model_name_or_path);
  folder_ = families::stable_diffusion::resolve_stable_diffusion_folder(
      o_.model.pretrained_model_name_or_path);
  for (const auto& note : folder_.notes) acc.print("{}", note);
  load_text_models(acc);
  if (!o_.model.vae.empty()) acc.print("VAE from {}", o_.model.vae);
  TextImageData::Parts parts;
  parts.vae_dir = o_.model.vae.empty() ? folder_.vae_dir : o_.model.vae;
  parts.vae_variant = o_.model.vae.empty() ? o_.model.variant : "";
  vae_ = models::load_autoencoder_kl(parts.vae_dir, parts.vae_variant);
  unet_ = models::load_unet(folder_.unet_dir, o_.model.variant);
  families::stable_diffusion::check_unet_fits(folder_, unet_, text_);
  for (auto& p : vae_->parameters()) p.set_requires_grad(false);
  vae_->to(acc.device());
  vae_->eval();
  parts.vae = image_vae(vae_);
  parts.text = &text_;
  parts.clip_skip = skip_;
  parts.size_multiple = vae_->config().downsample_factor();
  // DreamBooth's class images come from the pretrained pipeline with the class prompt.
  auto class_images = [this](int64_t count, uint64_t seed) {
    families::stable_diffusion::StableDiffusion pipe =
        as_pipeline(diffusion::SchedulerConfig::load(folder_.scheduler_config), "ddim");
    diffusion::GenerateRequest r = render_request(o_.text.class_prompt);
    r.num_images = count;
    r.seed = seed;
    r.on_step = [](int64_t, int64_t) { core::note_progress(); };
    return pipe.generate(r).images;
  };
  parts.text_cache_reason = "--cache_latents caches the captions' embeddings too; train without it";
  data_.build(acc, output_dir, parts, class_images, t.cache_latents);
  dataset_ = data_.dataset();
  set_epoch_ = [this](int64_t e) { data_.set_epoch(e); };
  if (o_.model.gradient_checkpointing) unet_->set_gradient_checkpointing(true);
  build_noise_scheduler();
  const auto encoders = text_.modules();
  build_trainable(acc, encoders[0], encoders.size() > 1 ? encoders[1] : nullptr);
}

torch::Tensor TextToImageTask::loss(const data::Batch& batch, int64_t epoch, torch::Device device) {
  const auto index = batch.at("index").to(torch::kCPU);
  std::vector<int64_t> keys(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
  auto inst = encode_batch(batch, "", keys, epoch, device);
  if (!data_.prior()) {
    const diffusion::Conditioning cond = {{"encoder_hidden_states", inst.embeds},
                                          {"text_embeds", inst.pooled},
                                          {"time_ids", inst.time_ids}};
    return denoising_losses(inst.latents, keys, epoch, device, cond, inst.loss_mask).mean();
  }
  std::vector<int64_t> class_keys;
  for (int64_t k : keys) class_keys.push_back(class_key(k));
  auto cls = encode_batch(batch, "class_", class_keys, epoch, device);
  std::vector<int64_t> all = keys;
  all.insert(all.end(), class_keys.begin(), class_keys.end());
  diffusion::Conditioning cond = {{"encoder_hidden_states", torch::cat({inst.embeds, cls.embeds})}};
  if (inst.pooled.defined()) cond["text_embeds"] = torch::cat({inst.pooled, cls.pooled});
  if (inst.time_ids.defined()) cond["time_ids"] = torch::cat({inst.time_ids, cls.time_ids});
  const auto mask =
      inst.loss_mask.defined()
          ? torch::cat({inst.loss_mask, torch::ones_like(inst.loss_mask)})  // class rows: whole
          : torch::Tensor();
  auto losses =
      denoising_losses(torch::cat({inst.latents, cls.latents}), all, epoch, device, cond, mask);
  const int64_t B = static_cast<int64_t>(keys.size());
  return losses.narrow(0, 0, B).mean() + o_.text.prior_loss_weight * losses.narrow(0, B, B).mean();
}

ValidationImages TextToImageTask::render_validation(const std::vector<int64_t>& mine,
                                                    int64_t /*begin*/,
                                                    const SamplerStepCallback& on_step) {
  const auto& v = o_.validation;
  if (mine.empty()) return {torch::zeros({0, o_.data.height(), o_.data.width(), 3})};
  families::stable_diffusion::StableDiffusion pipe =
      as_pipeline(noise_scheduler_->config(), v.scheduler);
  diffusion::GenerateRequest r = render_request(v.prompt);
  r.negative_prompts = {v.negative_prompt};
  r.num_images = static_cast<int64_t>(mine.size());
  r.seed = v.seed + static_cast<uint64_t>(mine.front());
  r.on_step = on_step;
  return {pipe.generate(r).images};
}

void TextToImageTask::export_to(const fs::path& out) {
  if (o_.lora.enabled) {
    export_lora(out);
    return;
  }
  models::save_unet(*unet_, (out / "unet").string());
  // The frozen parts and the scheduler as they came, and the source's model_index.json.
  std::vector<std::string> parts = {"vae", "scheduler"};
  for (const auto& c : text_.components()) parts.push_back(c);
  copy_pipeline_parts(folder_.root, out, parts);
  log::info("pipeline folder ({}): {}", folder_.pipeline_class, out.string());
}

ModelCard TextToImageTask::model_card() const {
  ModelCard card;
  const bool lora = o_.lora.enabled, dreambooth = !o_.text.instance_prompt.empty();
  card.base_model = o_.model.pretrained_model_name_or_path;
  card.title = std::string("Stable Diffusion ") + (dreambooth ? "DreamBooth " : "") +
               (lora ? "LoRA" : "fine-tune");
  const std::string what = lora ? std::string("LoRA adapters on the UNet") +
                                      (o_.lora.train_text_encoder ? " and the text encoder(s)" : "")
                                : std::string("the whole UNet");
  card.description = "A text-to-image " + std::string(dreambooth ? "DreamBooth " : "") +
                     "fine-tune of `" + card.base_model + "` (" + what + "), trained with " +
                     "`difftrain train` (Diffusers' " +
                     (dreambooth ? "train_dreambooth" : "train_text_to_image") +
                     (lora ? "_lora" : "") + ".py) on " +
                     (o_.data.train_data_dir.empty() ? std::string("its dataset")
                                                     : "`" + o_.data.train_data_dir + "`") +
                     ".";
  card.license = "creativeml-openrail-m";
  card.tags = {"text-to-image", "stable-diffusion", "stable-diffusion-diffusers"};
  card.pipeline_class =
      folder_.pipeline_class.empty() ? "StableDiffusionPipeline" : folder_.pipeline_class;
  card.torch_dtype = "torch.float16";
  card.lora = lora;
  card.lora_weight_name = "pytorch_lora_weights.safetensors";
  add_task_details(card, o_);
  card.sample_flags = {"--prompt", card_prompt(o_),
                       "--height", std::to_string(o_.data.height()),
                       "--width",  std::to_string(o_.data.width())};
  return card;
}

void TextToImageTask::load_text_models(accel::Accelerator& acc) {
  // The family's folders are its extension's (SDXL's list text_encoder_2), or plain ones.
  const auto want = extension();
  const auto& have = folder_.extension;
  if (have != want) {
    const auto first_component = [](const PipelineExtension& e) {
      const auto c = e.components();
      return c.empty() ? std::string("its components") : c.front().first;
    };
    throw Error(folder_.root +
                (want ? ": not an " + want->display_name() + " folder (model_index.json lists no " +
                            first_component(*want) + ")"
                      : ": an " + have->display_name() + " folder (model_index.json lists " +
                            first_component(*have) + "); train it as " + have->display_name()));
  }
  text_ = families::stable_diffusion::load_text_encoders(folder_, o_.model.variant);
  skip_ = text_.clip_skip_from_kohya(o_.text.clip_skip);
  text_.freeze();
  text_.to(acc.device());
}

families::stable_diffusion::StableDiffusion TextToImageTask::as_pipeline(
    const diffusion::SchedulerConfig& scheduler, const std::string& sampler) {
  families::stable_diffusion::StableDiffusion sd;
  sd.folder = folder_;
  sd.text_encoders = text_;
  sd.vae = vae_;
  sd.unet = unet_;
  sd.scheduler = diffusion::make_sampler(scheduler.to_json(), sampler, "the training scheduler");
  return sd;
}

diffusion::GenerateRequest TextToImageTask::render_request(const std::string& prompt) const {
  const auto& v = o_.validation;
  diffusion::GenerateRequest r;
  r.prompts = {prompt};
  r.num_inference_steps = v.inference_steps;
  r.guidance_scale = v.guidance_scale > 1 ? v.guidance_scale : default_guidance();
  r.height = o_.data.height();
  r.width = o_.data.width();
  r.clip_skip = skip_;
  r.seeding = diffusion::Seeding::kPerImage;
  return r;
}

EncodedBatch TextToImageTask::encode_batch(const data::Batch& batch, const std::string& prefix,
                                           const std::vector<int64_t>& keys, int64_t epoch,
                                           torch::Device device) {
  EncodedBatch out = data_.encode(batch, prefix, keys, epoch, device);
  out.time_ids = time_ids(batch, prefix, out.latents);
  if (out.time_ids.defined()) out.time_ids = out.time_ids.to(device);
  return out;
}

std::unique_ptr<TrainingTask> make_text_to_image_task(TaskOptions options) {
  return std::make_unique<TextToImageTask>(std::move(options));
}

}  // namespace difftrain::families::stable_diffusion
