// The Qwen-Image training task: Diffusers' train_dreambooth_lora_qwen_image.py (LoRA on the
// transformer's image-stream attention by default, DreamBooth prior preservation) and full
// fine-tuning of the transformer of a QwenImagePipeline folder. The data side is
// families::TextImageData with the causal VAE behind families::ImageVae (one frame; a posterior
// draw normalised by latents_mean / latents_std, as the script samples it); the objective
// diffusion::FlowMatchObjective on the folder's scheduler tables (unshifted: the folder's
// scheduler shifts dynamically); the denoiser QwenImageDenoiser. Qwen2.5-VL is frozen: every
// caption's embeddings (the template's 34 tokens dropped, cut to --max_sequence_length, with
// their mask) and the validation prompt's are computed once and the text encoder released.
#include "../text_image_data.h"
#include "denoiser.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/phase.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/train/block_swap_option.h"
#include "difftrain/train/flow_matching_options.h"
#include "difftrain/train/text_image_options.h"
#include "edit_data.h"
#include "qwen_image_pipeline.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::qwen_image {
namespace {
namespace fs = std::filesystem;

class QwenImageTask : public families::TextImageTask {
 public:
  explicit QwenImageTask(train::TaskOptions options) : TextImageTask(std::move(options)) {}

  std::string name() const override {
    return edit_ == EditKind::kNone ? "Qwen-Image text-to-image" : "Qwen-Image-Edit";
  }
  // Edit runs: the pairs encoded once (edit_data.h) instead of the captioned-image data.
  std::shared_ptr<data::Dataset> dataset() const override {
    return edit_data_ ? edit_data_ : TextImageTask::dataset();
  }
  std::function<std::vector<int64_t>(int64_t)> sampler() const override {
    return edit_data_ ? nullptr : TextImageTask::sampler();
  }
  void set_epoch(int64_t epoch) override {
    if (!edit_data_) TextImageTask::set_epoch(epoch);
  }
  void build(accel::Accelerator& acc, const std::string& output_dir) override;
  std::shared_ptr<torch::nn::Module> trainable() const override { return trainable_; }
  std::string parameter_summary() const override {
    return train::parameter_summary(*transformer_, *trainable_, o_.lora.enabled);
  }
  int64_t frozen_bytes() const override {
    int64_t n = o_.lora.enabled ? train::frozen_parameter_bytes(*transformer_) : 0;
    n += train::frozen_parameter_bytes(*vae_);
    if (visual_) n += train::frozen_parameter_bytes(*visual_);
    for (const auto* m : text_.modules()) n += train::frozen_parameter_bytes(*m);
    return n;
  }
  const models::BlockSwap* block_swap() const override { return transformer_->block_swap(); }

  torch::Tensor loss(const data::Batch& batch, int64_t epoch, torch::Device device) override;
  train::ValidationImages render_validation(const std::vector<int64_t>& mine, int64_t /*begin*/,
                                            const SamplerStepCallback& on_step) override;
  void write_to_checkpoint(const fs::path& dir) const override {
    if (o_.lora.enabled) return;
    io::write_file_atomic((dir / "config.json").string(),
                          io::read_file(folder_.transformer_dir + "/config.json"));
  }
  void export_to(const fs::path& out) override;

  // As train_dreambooth_lora_qwen_image.py's save_model_card: Apache-2.0, its tags.
  train::ModelCard model_card() const override {
    return transformer_model_card(edit_ == EditKind::kNone ? "Qwen-Image" : "Qwen-Image-Edit",
                                  "train_dreambooth_lora_qwen_image.py", "qwen-image",
                                  pipeline_class_of(edit_), lora_targets());
  }

 private:
  std::vector<std::string> lora_targets() const {
    if (!o_.lora.layers.empty()) return o_.lora.layers;
    if (o_.lora.target_modules_given) return o_.lora.target_modules;
    return default_qwen_image_lora_targets();
  }
  QwenImagePipeline as_pipeline() const;
  diffusion::GenerateRequest render_request(const std::string& prompt) const;
  void build_edit_data(accel::Accelerator& acc, io::TensorMap visual_weights);

  QwenImageFolder folder_;
  diffusion::TextEncoderStack text_;
  models::AutoencoderKLQwenImage vae_{nullptr};
  models::QwenImageTransformer2DModel transformer_{nullptr};
  models::LoraLayers lora_{nullptr};
  std::shared_ptr<torch::nn::Module> trainable_;
  std::unique_ptr<diffusion::FlowMatchObjective> objective_;
  std::unique_ptr<QwenImageDenoiser> denoiser_;
  double true_cfg_ = 1.0;
  // The validation prompt's (and, with true CFG, the " " negative prompt's) embeddings and masks.
  torch::Tensor validation_embeds_, validation_mask_, negative_embeds_, negative_mask_;
  // Edit runs: the pipeline, the vision tower (released with the text encoder), the encoded
  // pairs, and the validation's reference images.
  EditKind edit_ = EditKind::kNone;
  models::Qwen2_5VisionTransformer visual_{nullptr};
  std::shared_ptr<data::TensorDataset> edit_data_;
  std::vector<torch::Tensor> validation_images_;
};

// The causal VAE as the data side's ImageVae: pixels as one frame, the posterior of that frame,
// the draw normalised per channel.
ImageVae qwen_image_vae(const models::AutoencoderKLQwenImage& vae) {
  models::AutoencoderKLQwenImage v = vae;  // a handle: the same module
  ImageVae out;
  out.module = v.ptr();
  out.encode = [v](const torch::Tensor& px) mutable {
    auto post = v->encode(px.unsqueeze(2).to(models::module_device(*v), models::module_dtype(*v)));
    post.mean = post.mean.squeeze(2);
    post.logvar = post.logvar.squeeze(2);
    post.std = post.std.squeeze(2);
    return post;
  };
  out.scale = [v](const torch::Tensor& z) { return v->normalize_latents(z); };
  return out;
}

void QwenImageTask::build(accel::Accelerator& acc, const std::string& output_dir) {
  const std::string& model = o_.model.pretrained_model_name_or_path;
  TextImageData::check_options(o_, model);
  if (o_.lora.train_text_encoder) {
    throw Error(
        "--train_text_encoder: train_dreambooth_lora_qwen_image.py trains the transformer only "
        "(Qwen2.5-VL stays frozen and its embeddings are cached); leave the flag out");
  }
  folder_ = resolve_qwen_image_folder(model);
  const auto& pipeline = o_.family.at("pipeline");
  edit_ = pipeline.is_null()
              ? edit_kind_of(folder_.pipeline_class, model + "/model_index.json's _class_name")
              : edit_kind_of(pipeline.get<std::string>(), "--pipeline");
  const auto& captions = o_.text.captions;
  if (edit_ != EditKind::kNone &&
      (captions.drops() || captions.varies() || captions.affixes() || o_.data.masked_loss)) {
    throw Error(
        "the caption options (dropout, shuffling, prefix, suffix) and --masked_loss are for "
        "text-to-image runs: a Qwen-Image-Edit run encodes each instruction with its control "
        "images once; leave them out");
  }
  const bool bf16 = acc.mixed_precision() == accel::MixedPrecision::kBf16;
  const torch::Dtype frozen = bf16 ? torch::kBFloat16 : torch::kFloat32;
  const auto& f = folder_;
  io::TensorMap visual_weights;
  text_ = load_qwen_image_text_encoders(f, o_.model.variant, frozen,
                                        o_.family.integer("max_sequence_length"),
                                        edit_ == EditKind::kNone ? nullptr : &visual_weights);
  text_.freeze();
  text_.to(acc.device());
  TextImageData::Parts parts;
  parts.vae_dir = o_.model.vae.empty() ? f.vae_dir : o_.model.vae;
  parts.vae_variant = o_.model.vae.empty() ? o_.model.variant : "";
  if (!o_.model.vae.empty()) acc.print("VAE from {}", o_.model.vae);
  vae_ = models::load_autoencoder_kl_qwen_image(parts.vae_dir, torch::kFloat32, parts.vae_variant);
  for (auto& p : vae_->parameters()) p.set_requires_grad(false);
  vae_->to(acc.device(), frozen);
  vae_->eval();
  transformer_ = models::load_qwen_image_transformer(
      f.transformer_dir, o_.lora.enabled ? frozen : torch::kFloat32, o_.model.variant);
  transformer_->to(acc.device());
  if (transformer_->options().joint_attention_dim != text_.embed_dim() ||
      transformer_->options().in_channels != 4 * vae_->config().z_dim) {
    throw Error(
        fmt::format("{}: the transformer (joint_attention_dim {}, in_channels {}) does not "
                    "fit the text encoder (hidden_size {}) and VAE (z_dim {}); the "
                    "folder mixes models",
                    f.dir, transformer_->options().joint_attention_dim,
                    transformer_->options().in_channels, text_.embed_dim(), vae_->config().z_dim));
  }
  // Validation runs QwenImagePipeline with true CFG only when a scale > 1 is asked for.
  true_cfg_ = o_.validation.guidance_scale_given.value_or(1.0);

  const diffusion::FlowMatchOptions fo = train::flow_matching_options(o_.family, o_.noise.seed);
  nlohmann::json scheduler;
  try {
    scheduler = nlohmann::json::parse(io::read_file(f.scheduler_config));
  } catch (const nlohmann::json::exception& e) {
    throw Error(f.scheduler_config + ": not valid JSON (" + e.what() + ")");
  }
  objective_ = std::make_unique<diffusion::FlowMatchObjective>(scheduler, f.scheduler_config, fo);
  acc.print("objective: {}; validation true_cfg_scale {}", objective_->name(), true_cfg_);

  parts.vae = qwen_image_vae(vae_);
  parts.text = &text_;
  parts.size_multiple = 2 * vae_->config().spatial_compression_ratio();
  parts.size_reason = "Qwen-Image's VAE factor times 2, for its 2x2 patches";
  parts.latent_mode = false;  // the script samples the posterior
  auto class_images = [this](int64_t count, uint64_t seed) {
    QwenImagePipeline pipe = as_pipeline();
    diffusion::GenerateRequest r = render_request(o_.text.class_prompt);
    r.num_images = count;
    r.seed = seed;
    r.on_step = [](int64_t, int64_t) { core::note_progress(); };
    return pipe.generate(r).images;
  };
  if (edit_ != EditKind::kNone) {
    build_edit_data(acc, std::move(visual_weights));
  } else {
    parts.text_cache_reason = "Qwen-Image's Qwen2.5-VL is released once every caption is encoded";
    data_.build(acc, output_dir, parts, class_images, /*cache_text=*/true);
  }
  if (edit_ == EditKind::kNone && !o_.validation.prompt.empty()) {
    const auto e = data_.encode_captions({o_.validation.prompt});
    validation_embeds_ = e.at("prompt_embeds");
    validation_mask_ = e.at("prompt_attention_mask");
    if (true_cfg_ > 1) {
      const auto n = data_.encode_captions({" "});
      negative_embeds_ = n.at("prompt_embeds");
      negative_mask_ = n.at("prompt_attention_mask");
    }
  }
  // Every embedding the run needs is cached: Qwen2.5-VL goes (the tokenizer stays).
  text_ = text_.tokenizers_only();
  visual_ = nullptr;
  acc.print("text encoder released: the captions' Qwen2.5-VL embeddings are cached");
  if (o_.model.gradient_checkpointing) transformer_->set_gradient_checkpointing(true);
  if (!o_.lora.enabled) {
    // The last block's text-stream output feeds nothing (the model returns the image tokens), so
    // its to_add_out and txt_mlp never get a gradient (Diffusers' optimizer skips their None
    // gradients): they stay frozen.
    const std::string last =
        "transformer_blocks." + std::to_string(transformer_->options().num_layers - 1) + ".";
    int64_t frozen_count = 0;
    for (auto& p : transformer_->named_parameters()) {
      if (p.key().rfind(last + "attn.to_add_out.", 0) == 0 ||
          p.key().rfind(last + "txt_mlp.", 0) == 0) {
        p.value().set_requires_grad(false);
        ++frozen_count;
      }
    }
    if (frozen_count > 0) {
      acc.print(
          "{} parameter(s) of the last block's text stream stay frozen (its output is not "
          "used)",
          frozen_count);
    }
    trainable_ = transformer_.ptr();
  } else {
    for (auto& p : transformer_->parameters()) p.set_requires_grad(false);
    models::LoraConfig lc;
    lc.rank = o_.lora.rank;
    lc.alpha = o_.lora.alpha;
    lc.dropout = o_.lora.dropout;
    lc.target_modules = lora_targets();
    lora_ = models::LoraLayers(*transformer_, lc);
    trainable_ = lora_.ptr();
    acc.print("LoRA rank {} alpha {} on {} transformer module(s)", lc.rank, lc.alpha,
              lora_->module_names().size());
    train::quantize_frozen_base(acc, o_.model.base_weights_dtype, {transformer_.ptr().get()});
  }
  // Once the adapters are attached and the base stored as it trains.
  transformer_->enable_block_swap(train::blocks_to_swap(o_.family, o_.lora.enabled));
  train::report_block_swap(acc, transformer_->block_swap());
  denoiser_ = std::make_unique<QwenImageDenoiser>(transformer_);
}

void QwenImageTask::build_edit_data(accel::Accelerator& acc, io::TensorMap visual_weights) {
  const auto& d = o_.data;
  if (o_.text.with_prior_preservation || d.resolution_buckets || d.random_flip ||
      d.dataset != "imagefolder") {
    throw Error(
        "Qwen-Image-Edit training reads pairs from an imagefolder --train_data_dir (targets with "
        "control/ images or metadata.jsonl control_image) at one size; it takes no "
        "--with_prior_preservation, buckets or --random_flip");
  }
  const std::string te_config = folder_.text_encoder_dir + "/config.json";
  visual_ = models::make_qwen2_5_vl_vision(te_config, visual_weights, folder_.text_encoder_dir,
                                           models::module_dtype(*vae_));
  visual_->to(acc.device());
  visual_->eval();
  for (auto& p : visual_->parameters()) p.set_requires_grad(false);
  models::Qwen2VLImageProcessorOptions processor;
  const auto processor_file = fs::path(folder_.dir) / "processor" / "preprocessor_config.json";
  std::error_code ec;
  if (fs::is_regular_file(processor_file, ec)) {
    processor = models::Qwen2VLImageProcessorOptions::load(processor_file.string());
  }
  const std::vector<EditPair> pairs = find_edit_pairs(d.train_data_dir, d.caption_column,
                                                      d.caption_extension, o_.text.instance_prompt);
  acc.print("{}: {} pair(s), {} control image(s) each, {}x{}; encoding them once", name(),
            pairs.size(), pairs.front().controls.size(), d.width(), d.height());
  EditEncoders enc;
  enc.encoder = &text_.as<diffusion::Qwen3TextEncoder>(0);
  enc.visual = visual_;
  enc.processor = processor;
  enc.vae = vae_;
  enc.kind = edit_;
  edit_data_ = encode_edit_pairs(pairs, d.height(), d.width(), enc, [] { core::note_progress(); });
  if (!o_.validation.prompt.empty()) {
    const auto& given = o_.family.at("validation_image");
    if (given.is_array() && !given.empty()) {
      for (const auto& path : given) {
        validation_images_.push_back(io::load_image(path.get<std::string>(), 3));
      }
    } else {
      for (const auto& path : pairs.front().controls) {
        validation_images_.push_back(io::load_image(path, 3));
      }
    }
    const EditImages refs = prepare_edit_images(validation_images_, edit_);
    torch::NoGradGuard no_grad;
    std::tie(validation_embeds_, validation_mask_) = encode_edit_prompts(
        *enc.encoder, visual_, processor, {o_.validation.prompt}, refs.condition, edit_);
    if (true_cfg_ > 1) {
      std::tie(negative_embeds_, negative_mask_) =
          encode_edit_prompts(*enc.encoder, visual_, processor, {" "}, refs.condition, edit_);
    }
  }
}

torch::Tensor QwenImageTask::loss(const data::Batch& batch, int64_t epoch, torch::Device device) {
  if (!transformer_->is_training()) transformer_->train();
  if (edit_data_) {
    const auto index = batch.at("index").to(torch::kCPU);
    std::vector<int64_t> keys(index.data_ptr<int64_t>(), index.data_ptr<int64_t>() + index.numel());
    const auto mean = batch.at("latent_mean").to(torch::kCPU, torch::kFloat32);
    const auto logvar = batch.at("latent_logvar").to(torch::kCPU, torch::kFloat32);
    std::vector<torch::Tensor> z;
    for (size_t i = 0; i < keys.size(); ++i) {
      auto g = core::sample_generator(o_.noise.seed, epoch, keys[i], core::SampleStream::kLatent);
      const auto k = static_cast<int64_t>(i);
      z.push_back(mean[k] +
                  (0.5 * logvar[k]).exp() * torch::randn(mean[k].sizes(), g, torch::kFloat32));
    }
    const auto latents =
        vae_->normalize_latents(torch::stack(z).unsqueeze(2)).squeeze(2).to(device);
    const diffusion::Conditioning cond = {
        {"encoder_hidden_states", batch.at("prompt_embeds").to(device, torch::kFloat32)},
        {"encoder_attention_mask", batch.at("prompt_attention_mask").to(device, torch::kInt64)},
        {"reference_latents", batch.at("reference_latents").to(device, torch::kFloat32)},
        {"reference_shapes", batch.at("reference_shapes")}};
    const auto noised = objective_->noise(latents, keys, epoch, device);
    const auto prediction = denoiser_->denoise(noised.model_input, noised.timesteps, cond);
    return objective_->losses(prediction, noised).mean();
  }
  std::vector<int64_t> keys;
  const EncodedBatch in = data_.encode_batch(batch, epoch, device, keys);
  const diffusion::Conditioning cond = {{"encoder_hidden_states", in.embeds},
                                        {"encoder_attention_mask", in.attention_mask}};
  const auto noised = objective_->noise(in.latents, keys, epoch, device);
  const auto prediction = denoiser_->denoise(noised.model_input, noised.timesteps, cond);
  return data_.reduce_losses(objective_->losses(prediction, noised, in.loss_mask));
}

QwenImagePipeline QwenImageTask::as_pipeline() const {
  QwenImagePipeline p;
  p.folder = folder_;
  p.text_encoders = text_;
  p.transformer = transformer_;
  p.vae = vae_;
  p.scheduler = diffusion::load_sampler(folder_.scheduler_config, "");
  p.edit = edit_;
  p.images = validation_images_;
  return p;
}

diffusion::GenerateRequest QwenImageTask::render_request(const std::string& prompt) const {
  diffusion::GenerateRequest r;
  r.prompts = {prompt};
  if (true_cfg_ > 1) r.negative_prompts = {" "};
  r.num_inference_steps = o_.validation.inference_steps;
  r.options["true_cfg_scale"] = true_cfg_;
  r.height = o_.data.height();
  r.width = o_.data.width();
  r.max_sequence_length = o_.family.integer("max_sequence_length");
  r.seeding = diffusion::Seeding::kPerImage;
  return r;
}

train::ValidationImages QwenImageTask::render_validation(const std::vector<int64_t>& mine,
                                                         int64_t /*begin*/,
                                                         const SamplerStepCallback& on_step) {
  if (mine.empty()) return {torch::zeros({0, o_.data.height(), o_.data.width(), 3})};
  QwenImagePipeline pipe = as_pipeline();
  diffusion::GenerateRequest r = render_request(o_.validation.prompt);
  r.negative_prompts.clear();
  r.prompt_embeds = validation_embeds_;
  r.prompt_attention_mask = validation_mask_;
  r.negative_prompt_embeds = negative_embeds_;
  r.negative_attention_mask = negative_mask_;
  r.num_images = static_cast<int64_t>(mine.size());
  r.seed = o_.validation.seed + static_cast<uint64_t>(mine.front());
  r.on_step = on_step;
  return {pipe.generate(r).images};
}

void QwenImageTask::export_to(const fs::path& out) {
  export_transformer_run(
      out, folder_, *transformer_, lora_,
      [this](io::LoraWeights& l) {
        adapt_dit_lora(qwen_image_lora_layout(), l, folder_.dir, io::LoraFormat::kKohya);
      },
      pipeline_class_of(edit_));
}

}  // namespace

std::unique_ptr<train::TrainingTask> make_qwen_image_training_task(
    const train::TaskOptions& options) {
  return std::make_unique<QwenImageTask>(options);
}

}  // namespace difftrain::families::qwen_image
