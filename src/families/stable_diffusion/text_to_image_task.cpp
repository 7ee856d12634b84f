// make_text_to_image_task: the Stable-Diffusion text-to-image task (text_to_image_task.h).
#include "text_to_image_task.h"

namespace difftrain::train {

namespace t2i {

void TextToImageTask::build(accel::Accelerator& acc, const std::string& output_dir) {
  const auto& d = o_.data;
  const auto& t = o_.text;
  if (d.dataset != "imagefolder") {
    throw Error(o_.model.pretrained_model_name_or_path +
                " is a text-to-image pipeline: train it on captioned images with --dataset "
                "imagefolder --train_data_dir DIR (metadata.jsonl captions or --instance_prompt)");
  }
  if (t.cache_latents && (!d.center_crop || d.random_flip)) {
    throw Error(
        "--cache_latents encodes each image once, so it needs the same pixels every epoch: add "
        "--center_crop and drop --random_flip (or train without --cache_latents)");
  }
  if (d.resolution_buckets && t.with_prior_preservation) {
    throw Error(
        "--resolution_buckets with --with_prior_preservation is not supported: a batch holds "
        "instance and class images together, so they would need one size; train DreamBooth "
        "with square crops");
  }
  folder_ = diffusion::resolve_stable_diffusion_folder(o_.model.pretrained_model_name_or_path);
  for (const auto& note : folder_.notes) acc.print("{}", note);
  load_text_models(acc);
  if (!o_.model.vae.empty()) acc.print("VAE from {}", o_.model.vae);
  vae_dir_ = o_.model.vae.empty() ? folder_.vae_dir : o_.model.vae;
  vae_variant_ = o_.model.vae.empty() ? o_.model.variant : "";
  vae_ = models::load_autoencoder_kl(vae_dir_, vae_variant_);
  unet_ = models::load_unet(folder_.unet_dir, o_.model.variant);
  if (!unet_->needs_encoder_hidden_states()) {
    throw Error(folder_.unet_dir +
                ": the UNet has no cross-attention; a text-to-image "
                "pipeline needs a UNet2DConditionModel");
  }
  check_unet();
  for (auto& p : vae_->parameters()) p.set_requires_grad(false);
  vae_->to(acc.device());
  vae_->eval();
  const int64_t factor = vae_->config().downsample_factor();
  if (d.resolution % factor != 0) {
    const int64_t below = d.resolution / factor * factor;
    throw Error("--resolution " + std::to_string(d.resolution) + " is not a multiple of " +
                std::to_string(factor) + " (the VAE's downsampling factor); use " +
                (below >= 8 ? std::to_string(below) + " or " : "") +
                std::to_string(below + factor));
  }
  build_dataset(acc, output_dir);
  if (o_.model.gradient_checkpointing) unet_->set_gradient_checkpointing(true);
  build_noise_scheduler();
  const auto encoders = text_.modules();
  build_trainable(acc, encoders[0], encoders.size() > 1 ? encoders[1] : nullptr);
}

torch::Tensor TextToImageTask::loss(const data::Batch& batch, int64_t epoch, torch::Device device) {
  const auto index = batch.at("index").to(torch::kCPU);
  std::vector<int64_t> keys(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
  auto inst = encode_batch(batch, "", keys, epoch, device);
  if (!prior_) {
    const diffusion::Conditioning cond = {{"encoder_hidden_states", inst.embeds},
                                          {"text_embeds", inst.pooled},
                                          {"time_ids", inst.time_ids}};
    return denoising_losses(inst.latents, keys, epoch, device, cond).mean();
  }
  std::vector<int64_t> class_keys;
  for (int64_t k : keys) class_keys.push_back(class_key(k));
  auto cls = encode_batch(batch, "class_", class_keys, epoch, device);
  std::vector<int64_t> all = keys;
  all.insert(all.end(), class_keys.begin(), class_keys.end());
  diffusion::Conditioning cond = {{"encoder_hidden_states", torch::cat({inst.embeds, cls.embeds})}};
  if (inst.pooled.defined()) cond["text_embeds"] = torch::cat({inst.pooled, cls.pooled});
  if (inst.time_ids.defined()) cond["time_ids"] = torch::cat({inst.time_ids, cls.time_ids});
  auto losses = denoising_losses(torch::cat({inst.latents, cls.latents}), all, epoch, device, cond);
  const int64_t B = static_cast<int64_t>(keys.size());
  return losses.narrow(0, 0, B).mean() + o_.text.prior_loss_weight * losses.narrow(0, B, B).mean();
}

ValidationImages TextToImageTask::render_validation(const std::vector<int64_t>& mine,
                                                    int64_t /*begin*/,
                                                    const SamplerStepCallback& on_step) {
  const auto& v = o_.validation;
  const int64_t R = o_.data.resolution;
  if (mine.empty()) return {torch::zeros({0, R, R, 3})};
  diffusion::StableDiffusion pipe = as_pipeline(noise_scheduler_->config(), v.scheduler);
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
  const fs::path src(folder_.root);
  std::vector<std::string> parts = {"vae", "scheduler"};
  for (const auto& c : text_.components()) parts.push_back(c);
  for (const auto& part : parts) {
    std::error_code ec;
    fs::remove_all(out / part, ec);
    fs::copy(src / part, out / part, fs::copy_options::recursive, ec);
    if (ec) {
      throw Error("cannot copy " + (src / part).string() + " to " + (out / part).string() + ": " +
                  ec.message());
    }
  }
  io::write_file_atomic((out / "model_index.json").string(),
                        io::read_file((src / "model_index.json").string()));
  log::info("pipeline folder ({}): {}", folder_.pipeline_class, out.string());
}

void TextToImageTask::load_text_models(accel::Accelerator& acc) {
  using Layout = diffusion::TextEncoderStack::Layout;
  const bool xl = text_layout() == Layout::kDualClip;
  if (folder_.xl != xl) {
    throw Error(folder_.root + (xl ? ": not an SDXL folder (model_index.json lists no "
                                     "text_encoder_2)"
                                   : ": an SDXL folder (model_index.json lists text_encoder_2); "
                                     "train it as SDXL"));
  }
  text_ = diffusion::load_text_encoders(folder_, o_.model.variant);
  skip_ = text_.clip_skip_from_kohya(o_.text.clip_skip);
  text_.freeze();
  text_.to(acc.device());
}

CaptionIds TextToImageTask::caption_ids() const {
  auto text = text_;
  return [text](data::Example& ex, const std::string& prefix, const std::string& caption) {
    for (auto& [key, ids] : text.tokenize(caption)) ex[prefix + key] = ids;
  };
}

diffusion::PromptEmbeds TextToImageTask::encode_ids(const data::Batch& batch,
                                                    const std::string& prefix) {
  std::vector<torch::Tensor> ids;
  for (size_t i = 0; i < text_.size(); ++i) {
    ids.push_back(batch.at(prefix + diffusion::TextEncoderStack::ids_key(i)));
  }
  std::optional<torch::NoGradGuard> no_grad;
  if (!o_.lora.train_text_encoder) no_grad.emplace();
  return text_.encode_ids(ids, skip_);
}

std::map<std::string, torch::Tensor> TextToImageTask::encode_captions(
    const std::vector<std::string>& captions) {
  const auto e = text_.encode(captions, skip_);
  std::map<std::string, torch::Tensor> out = {
      {"prompt_embeds", e.embeds.to(torch::kCPU, torch::kFloat32)}};
  if (e.pooled.defined()) out["pooled_prompt_embeds"] = e.pooled.to(torch::kCPU, torch::kFloat32);
  return out;
}

std::string TextToImageTask::text_cache_key() const {
  // The first encoder's config, files and clip_skip, then each further encoder's files (the
  // names caches written before the stack had).
  std::string key = io::read_file(text_[0].model_dir + "/config.json") +
                    folder_stamp(text_[0].model_dir) + folder_stamp(text_[0].tokenizer_dir) +
                    std::to_string(skip_);
  for (size_t i = 1; i < text_.size(); ++i) {
    key += (i == 1 ? "xl;" : ";") + folder_stamp(text_[i].model_dir) +
           folder_stamp(text_[i].tokenizer_dir);
  }
  return key;
}

diffusion::StableDiffusion TextToImageTask::as_pipeline(const diffusion::SchedulerConfig& scheduler,
                                                        const std::string& sampler) {
  diffusion::StableDiffusion sd;
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
  r.height = r.width = o_.data.resolution;
  r.clip_skip = skip_;
  r.seeding = diffusion::Seeding::kPerImage;
  return r;
}

void TextToImageTask::build_dataset(accel::Accelerator& acc, const std::string& output_dir) {
  const auto& d = o_.data;
  const auto& t = o_.text;
  TextImageDataset::Half inst = captioned_images(d, d.train_data_dir, t.instance_prompt);
  if (d.max_train_samples > 0 && d.max_train_samples < inst.images->size()) {
    acc.warn("--max_train_samples is not applied to text-to-image data");
  }

  std::optional<TextImageDataset::Half> cls;
  if (t.with_prior_preservation) {
    prior_ = true;
    generate_class_images(acc);
    cls = captioned_images(d, t.class_data_dir, t.class_prompt);
  }

  std::shared_ptr<data::ImageFolderDataset> instance_images = inst.images;
  auto ds = std::make_shared<TextImageDataset>(std::move(inst), std::move(cls), caption_ids());
  if (d.resolution_buckets) assign_buckets(acc, *instance_images, *ds);
  if (t.cache_latents) fill_cache(acc, *ds, output_dir);
  set_epoch_ = [ds](int64_t e) { ds->set_epoch(e); };
  dataset_ = ds;
}

void TextToImageTask::assign_buckets(accel::Accelerator& acc, data::ImageFolderDataset& images,
                                     TextImageDataset& ds) {
  const auto& d = o_.data;
  const int64_t factor = vae_->config().downsample_factor();
  if (d.bucket_step % factor != 0) {
    throw Error("--bucket_step " + std::to_string(d.bucket_step) + " is not a multiple of " +
                std::to_string(factor) + " (the VAE's downsampling factor)");
  }
  data::BucketOptions bo;
  bo.resolution = d.resolution;
  bo.step = d.bucket_step;
  bo.min_side = d.bucket_min_side;
  bo.max_side = d.bucket_max_side;
  std::vector<std::array<int64_t, 2>> sizes;
  for (int64_t i = 0; i < images.size(); ++i) sizes.push_back(io::image_size(images.file(i)));
  const int64_t group = acc.options().split_batches
                            ? d.train_batch_size
                            : d.train_batch_size * static_cast<int64_t>(acc.num_processes());
  buckets_ = std::make_shared<data::BucketLayout>(data::make_buckets(bo), sizes, group);
  images.set_target_sizes(buckets_->image_targets());
  std::vector<int64_t> slots;
  for (int64_t k = 0; k < buckets_->num_slots(); ++k) slots.push_back(buckets_->image_of_slot(k));
  ds.set_slots(std::move(slots));
  std::string lines;
  for (const auto& line : buckets_->summary()) lines += (lines.empty() ? "" : ", ") + line;
  acc.print("aspect-ratio buckets: {} image(s) in {} slot(s) ({}), batches of one bucket",
            images.size(), buckets_->num_slots(), lines);
}

void TextToImageTask::generate_class_images(accel::Accelerator& acc) {
  const auto& t = o_.text;
  train::generate_class_images(
      acc, {t.class_data_dir, t.class_prompt, t.num_class_images, o_.data.seed},
      [this](int64_t count, uint64_t seed) {
        diffusion::StableDiffusion pipe =
            as_pipeline(diffusion::SchedulerConfig::load(folder_.scheduler_config), "ddim");
        diffusion::GenerateRequest r = render_request(o_.text.class_prompt);
        r.num_images = count;
        r.seed = seed;
        r.on_step = [](int64_t, int64_t) { core::note_progress(); };
        return pipe.generate(r).images;
      });
}

void TextToImageTask::fill_cache(accel::Accelerator& acc, TextImageDataset& ds,
                                 const std::string& output_dir) {
  const auto& d = o_.data;
  const auto& t = o_.text;
  const fs::path dir = t.cache_dir.empty() ? fs::path(output_dir) / "cache" : fs::path(t.cache_dir);
  if (acc.is_main_process()) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    if (ec) throw Error("cannot create cache_dir " + dir.string() + ": " + ec.message());
  }
  acc.wait_for_everyone();
  // The key changes when the VAE, the images or their preprocessing change.
  const std::string vae_key =
      "latents-v2;" + io::read_file(vae_dir_ + "/config.json") +
      file_stamp(models::weights_path(vae_dir_, vae_variant_)) + std::to_string(d.resolution) +
      ";" + std::to_string(d.center_crop) + ";" +
      (d.resolution_buckets
           ? fmt::format("buckets {} {} {};", d.bucket_step, d.bucket_min_side, d.bucket_max_side)
           : std::string());
  auto cache_half = [&](TextImageDataset::Half& half, const std::string& name,
                        const std::string& data_dir) {
    const fs::path file =
        dir / (name + "-" + cache_key(vae_key + folder_stamp(data_dir)) + ".safetensors");
    std::tie(half.mean, half.logvar) =
        cached_latents(acc, *half.images, file, *vae_, o_.encode_batch_size);
    // The cache needs centre crops without flips: each image's geometry is fixed.
    half.geometry = centre_crop_geometry(*half.images);
  };
  cache_half(ds.instance(), "latents", d.train_data_dir);
  if (ds.class_half()) cache_half(*ds.class_half(), "class-latents", t.class_data_dir);

  if (o_.lora.train_text_encoder) return;
  std::set<std::string> unique(ds.instance().captions.begin(), ds.instance().captions.end());
  if (ds.class_half()) unique.insert(t.class_prompt);
  std::string key = "embeds-v2;" + text_cache_key();
  for (const auto& s : unique) key += "\n" + s;
  const fs::path file = dir / ("text-embeddings-" + cache_key(key) + ".safetensors");
  const std::vector<std::string> captions(unique.begin(), unique.end());
  if (!fs::exists(file)) {
    build_text_embedding_cache(acc, captions, file, [this](const std::vector<std::string>& c) {
      return encode_captions(c);
    });
  }
  acc.wait_for_everyone();
  ds.cached_text = load_text_embedding_cache(file);
}

EncodedBatch TextToImageTask::encode_batch(const data::Batch& batch, const std::string& prefix,
                                           const std::vector<int64_t>& keys, int64_t epoch,
                                           torch::Device device) {
  EncodedBatch out;
  torch::Tensor mean, logvar;
  if (batch.count(prefix + "latent_mean")) {
    mean = batch.at(prefix + "latent_mean").to(torch::kCPU, torch::kFloat32);
    logvar = batch.at(prefix + "latent_logvar").to(torch::kCPU, torch::kFloat32);
  } else {
    torch::NoGradGuard no_grad;
    const auto& px = batch.at(prefix + "pixel_values");
    auto post = vae_->encode(px.to(module_device(*vae_), module_dtype(*vae_)));
    mean = post.mean.to(torch::kCPU, torch::kFloat32);
    logvar = post.logvar.to(torch::kCPU, torch::kFloat32);
  }
  // Each sample's posterior draw comes from its own stream (cached or not, the same numbers).
  std::vector<torch::Tensor> z;
  const auto shape = mean.sizes().slice(1).vec();
  for (size_t i = 0; i < keys.size(); ++i) {
    auto g = data::sample_generator(o_.noise.seed, epoch, keys[i], data::SampleStream::kLatent);
    const auto k = static_cast<int64_t>(i);
    z.push_back(mean[k] + (0.5 * logvar[k]).exp() * torch::randn(shape, g, torch::kFloat32));
  }
  out.latents = vae_->scale_latents(torch::stack(z)).to(device);
  out.time_ids = time_ids(batch, prefix, out.latents);
  if (out.time_ids.defined()) out.time_ids = out.time_ids.to(device);
  if (batch.count(prefix + "prompt_embeds")) {
    out.embeds = batch.at(prefix + "prompt_embeds").to(device, torch::kFloat32);
    if (batch.count(prefix + "pooled_prompt_embeds")) {
      out.pooled = batch.at(prefix + "pooled_prompt_embeds").to(device, torch::kFloat32);
    }
  } else {
    auto text = encode_ids(batch, prefix);
    out.embeds = text.embeds.to(device);
    if (text.pooled.defined()) out.pooled = text.pooled.to(device);
  }
  return out;
}

}  // namespace t2i

std::unique_ptr<TrainingTask> make_text_to_image_task(TaskOptions options) {
  return std::make_unique<t2i::TextToImageTask>(std::move(options));
}

}  // namespace difftrain::train
