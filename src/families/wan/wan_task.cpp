// The Wan training task: LoRA and full fine-tuning of a WanPipeline folder's transformer on clips
// and images with musubi-tuner's semantics (wan_train_network.py; Diffusers has no Wan training
// script): the data side is families::VideoData (clips cut and bucketed as musubi-tuner's dataset
// config, the VAE's latent mode normalised, UMT5 embeddings trimmed to their tokens, all cached
// once; the text encoder then released), the objective diffusion::FlowMatchObjective's continuous
// samplings (musubi-tuner's uniform / sigmoid / shift, with --min_timestep / --max_timestep;
// "sigma" on FlowMatchDiscreteScheduler tables of the same shift), the model given 1000 t + 1 as
// its timestep as musubi-tuner gives it, the loss the plain mean squared error against noise - x0.
// Image to video (a WanImageToVideoPipeline folder): each clip's own first frame through the VAE
// with the mask, concatenated to the noisy latents. Wan 2.2 A14B: one expert per run
// (--train_expert high: transformer, t >= boundary; low: transformer_2), its timestep range set
// from the folder's boundary_ratio.
#include "wan_task.h"
#include "../text_image_data.h"
#include "../video_data.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/train/block_swap_option.h"
#include "difftrain/train/flow_matching_options.h"
#include "difftrain/train/model_card.h"
#include "difftrain/train/text_image_options.h"
#include "difftrain/train/training_cache.h"
#include "wan_pipeline.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::wan {
namespace {
namespace fs = std::filesystem;

class WanTask : public train::TrainingTask {
 public:
  explicit WanTask(train::TaskOptions options)
      : o_(train::with_text_image_options(std::move(options))),
        data_(o_, VideoDataOptions::from(o_.family)) {}

  std::string name() const override {
    return std::string("Wan ") + (folder_.image_to_video ? "image-to-video" : "text-to-video");
  }
  void build(accel::Accelerator& acc, const std::string& output_dir) override;
  std::shared_ptr<data::Dataset> dataset() const override { return data_.dataset(); }
  std::function<std::vector<int64_t>(int64_t)> sampler() const override { return data_.sampler(); }
  // Cached latents (no augmentation); the captions' dropout draws.
  void set_epoch(int64_t epoch) override { data_.set_epoch(epoch); }
  std::shared_ptr<torch::nn::Module> trainable() const override { return trainable_; }
  std::string parameter_summary() const override {
    return train::parameter_summary(*transformer_, *trainable_, o_.lora.enabled);
  }
  int64_t frozen_bytes() const override {
    int64_t n = o_.lora.enabled ? train::frozen_parameter_bytes(*transformer_) : 0;
    if (image_encoder_) n += train::frozen_parameter_bytes(*image_encoder_);
    return n + train::frozen_parameter_bytes(*vae_);
  }
  const models::BlockSwap* block_swap() const override { return transformer_->block_swap(); }

  torch::Tensor loss(const data::Batch& batch, int64_t epoch, torch::Device device) override;
  std::string validation_unavailable() const override { return prompt_validation_unavailable(o_); }
  std::vector<std::string> validation_labels(int64_t K) const override {
    return prompt_validation_labels(o_, K);
  }
  std::string validation_note() const override { return " (\"" + o_.validation.prompt + "\")"; }
  bool validation_requested() const override { return !o_.validation.prompt.empty(); }
  train::ValidationImages render_validation(const std::vector<int64_t>& mine, int64_t begin,
                                            const SamplerStepCallback& on_step) override;
  void write_to_checkpoint(const fs::path& dir) const override {
    if (o_.lora.enabled) return;
    io::write_file_atomic((dir / "config.json").string(),
                          io::read_file(transformer_dir_ + "/config.json"));
  }
  void export_to(const fs::path& out) override;
  train::ModelCard model_card() const override;

 private:
  std::vector<std::string> lora_targets() const {
    if (!o_.lora.layers.empty()) return o_.lora.layers;
    if (o_.lora.target_modules_given) return o_.lora.target_modules;
    return default_wan_lora_targets(transformer_->options().added_kv_proj_dim.has_value());
  }
  int64_t validation_frames() const {
    const int64_t given = o_.family.integer("validation_num_frames");
    if (given > 0) return (given - 1) / 4 * 4 + 1;
    const auto& t = VideoDataOptions::from(o_.family).target_frames;
    return (*std::max_element(t.begin(), t.end()) - 1) / 4 * 4 + 1;
  }

  train::TaskOptions o_;
  VideoData data_;
  WanFolder folder_;
  std::string expert_, transformer_dir_;
  models::AutoencoderKLQwenImage vae_{nullptr};
  models::WanTransformer3DModel transformer_{nullptr};
  models::LoraLayers lora_{nullptr};
  std::shared_ptr<torch::nn::Module> trainable_;
  std::unique_ptr<diffusion::FlowMatchObjective> objective_;
  torch::Tensor validation_embeds_, negative_embeds_;
  torch::Tensor validation_image_;  // image to video: the first frame of the first clip, uint8
  // --train_expert both: the experts' frozen weights, swapped into transformer_ by select_expert.
  void select_expert(bool high);
  std::map<std::string, torch::Tensor> high_weights_, low_weights_;
  bool current_high_ = true, swapped_ = false;
  double boundary_ = 0;
  models::ClipVisionModel image_encoder_{nullptr};  // Wan 2.1 I2V: kept for validation renders
  models::ClipImageProcessorOptions image_processor_;
};

void WanTask::build(accel::Accelerator& acc, const std::string& output_dir) {
  const std::string& model = o_.model.pretrained_model_name_or_path;
  folder_ = resolve_wan_folder(model);
  const auto& f = folder_;
  acc.print("{}: {} ({})", name(), model,
            f.pipeline_class.empty() ? "WanPipeline" : f.pipeline_class);
  if (f.expand_timesteps) {
    throw Error(model +
                ": Wan 2.2 TI2V-5B (expand_timesteps, the 48-channel VAE) does not train yet; "
                "train Wan 2.1 or 2.2 A14B folders");
  }
  if (o_.lora.train_text_encoder) {
    throw Error(
        "--train_text_encoder: Wan trains the transformer only (UMT5 stays frozen and its "
        "embeddings are cached, as musubi-tuner does)");
  }
  if (o_.text.with_prior_preservation) {
    throw Error("--with_prior_preservation: Wan's video data has no class half; leave it out");
  }
  // Wan 2.2 A14B: one expert per run.
  const auto& expert = o_.family.at("train_expert");
  diffusion::FlowMatchOptions fo = train::flow_matching_options(o_.family, o_.noise.seed);
  transformer_dir_ = f.transformer_dir;
  if (!f.transformer_2_dir.empty()) {
    if (expert.is_null()) {
      throw Error(model +
                  " is Wan 2.2 A14B with two experts: pass --train_expert high (transformer, the "
                  "noisy steps t >= boundary) or low (transformer_2), one per run");
    }
    expert_ = expert.get<std::string>();
    const double boundary = f.boundary_ratio.value_or(0.875) * 1000.0;
    boundary_ = boundary;
    const bool range_given = fo.min_timestep != 0.0 || fo.max_timestep != 1000.0;
    if (expert_ == "low") transformer_dir_ = f.transformer_2_dir;
    if (expert_ == "both") {
      // musubi-tuner's --dit + --dit_high_noise: one LoRA trained on both experts, the frozen
      // bases swapped into one model by each sample's timestep (t >= boundary: transformer).
      if (!o_.lora.enabled) {
        throw Error(
            "--train_expert both trains one LoRA across the two experts (musubi-tuner's "
            "--dit_high_noise); a full fine-tune trains one expert per run: high or low");
      }
      if (fo.weighting_scheme != "none") {
        throw Error(
            "--train_expert both moves t onto one expert's side per micro-batch; its "
            "loss weights would not follow: leave --weighting_scheme at none");
      }
      if (o_.model.base_weights_dtype != "none") {
        throw Error(
            "--train_expert both swaps the experts' float weights; leave out "
            "--base_weights_dtype (or train one expert per run)");
      }
      acc.print(
          "Wan 2.2 A14B: one LoRA on both experts (transformer for t >= {}, transformer_2 "
          "below), their bases swapped by each sample's timestep",
          boundary);
    } else if (!range_given) {
      fo.min_timestep = expert_ == "high" ? boundary : 0.0;
      fo.max_timestep = expert_ == "high" ? 1000.0 : boundary;
    }
    if (expert_ != "both") {
      acc.print("Wan 2.2 A14B: training the {}-noise expert ({}), timesteps {}..{}", expert_,
                fs::path(transformer_dir_).filename().string(), fo.min_timestep, fo.max_timestep);
    }
  } else if (!expert.is_null()) {
    throw Error("--train_expert: " + model + " has one transformer (Wan 2.1); leave it out");
  }

  const bool bf16 = acc.mixed_precision() == accel::MixedPrecision::kBf16;
  const torch::Dtype frozen = bf16 ? torch::kBFloat16 : torch::kFloat32;
  const std::string vae_dir = o_.model.vae.empty() ? f.vae_dir : o_.model.vae;
  const std::string vae_variant = o_.model.vae.empty() ? o_.model.variant : "";
  vae_ = models::load_autoencoder_kl_qwen_image(vae_dir, torch::kFloat32, vae_variant);
  for (auto& p : vae_->parameters()) p.set_requires_grad(false);
  vae_->to(acc.device(), frozen);
  vae_->eval();
  auto tokenizer =
      std::make_shared<const models::T5Tokenizer>(models::T5Tokenizer::load(f.tokenizer_dir));
  auto text_encoder = models::load_t5_encoder(f.text_encoder_dir, frozen, o_.model.variant);
  for (auto& p : text_encoder->parameters()) p.set_requires_grad(false);
  text_encoder->to(acc.device());
  text_encoder->eval();
  transformer_ = models::load_wan_transformer(
      transformer_dir_, o_.lora.enabled ? frozen : torch::kFloat32, o_.model.variant);
  transformer_->to(acc.device());
  const auto& t = transformer_->options();
  const int64_t z = vae_->config().z_dim;
  const int64_t in = f.image_to_video ? 2 * z + vae_->config().temporal_compression_ratio() : z;
  if (t.text_dim != text_encoder->options().d_model() || t.in_channels != in) {
    throw Error(fmt::format(
        "{}: the transformer (text_dim {}, in_channels {}) does not fit the "
        "text encoder (d_model {}) and VAE (z_dim {}); the folder mixes models",
        transformer_dir_, t.text_dim, t.in_channels, text_encoder->options().d_model(), z));
  }
  if (t.added_kv_proj_dim) {
    if (f.image_encoder_dir.empty()) {
      throw Error(model +
                  ": the transformer takes CLIP image features (added_kv_proj_dim) but "
                  "the folder has no image_encoder/");
    }
    if (o_.family.integer("max_sequence_length") != 512) {
      throw Error("--max_sequence_length " +
                  std::to_string(o_.family.integer("max_sequence_length")) +
                  ": Wan 2.1 image to video splits the image context off 512 text tokens (as "
                  "WanAttention does); leave it at 512");
    }
    image_encoder_ = models::load_clip_vision_model(f.image_encoder_dir, o_.model.variant);
    for (auto& p : image_encoder_->parameters()) p.set_requires_grad(false);
    image_encoder_->to(acc.device(), frozen);
    image_encoder_->eval();
    if (!f.image_processor_config.empty()) {
      image_processor_ = models::ClipImageProcessorOptions::load(f.image_processor_config);
    }
  }
  // musubi-tuner's "sigma": FlowMatchDiscreteScheduler tables shifted by --discrete_flow_shift.
  const nlohmann::json tables = {{"_class_name", "FlowMatchEulerDiscreteScheduler"},
                                 {"num_train_timesteps", 1000},
                                 {"shift", fo.discrete_flow_shift}};
  objective_ = std::make_unique<diffusion::FlowMatchObjective>(tables, model, fo);
  acc.print("objective: {} (musubi-tuner: the model gets 1000 t + 1)", objective_->name());

  const int64_t length = o_.family.integer("max_sequence_length");
  VideoData::Parts parts;
  models::AutoencoderKLQwenImage vae = vae_;
  parts.encode = [vae](const torch::Tensor& px) mutable {
    // musubi-tuner's WanVAE.encode: the posterior's mean, (mu - mean) * (1 / std).
    auto zz = vae->encode(px.to(models::module_device(*vae), models::module_dtype(*vae))).mode();
    return vae->normalize_latents(zz.to(torch::kFloat32));
  };
  if (f.image_to_video) {
    parts.extras["condition"] = [vae](const torch::Tensor& px) mutable {
      return wan_image_condition(vae, px.narrow(2, 0, 1), torch::Tensor(), px.size(2));
    };
  }
  if (image_encoder_) {
    // Wan 2.1 I2V: CLIP's penultimate hidden states of the clip's first frame (as uint8, through
    // CLIPImageProcessor), as musubi-tuner caches its clip context per item.
    models::ClipVisionModel clip = image_encoder_;
    const auto processor = image_processor_;
    parts.extras["image_embeds"] = [clip, processor](const torch::Tensor& px) mutable {
      const auto first = px[0]
                             .select(1, 0)
                             .add(1)
                             .mul(127.5)
                             .round()
                             .clamp(0, 255)
                             .to(torch::kUInt8)
                             .permute({1, 2, 0})
                             .contiguous();
      const auto pv = models::clip_image_pixel_values({first}, processor);
      auto hidden = clip->forward(pv.to(models::module_device(*clip), models::module_dtype(*clip)))
                        .hidden_states;
      return hidden[hidden.size() - 2].to(torch::kFloat32);
    };
  }
  parts.encode_text = [tokenizer, text_encoder, length](const std::vector<std::string>& c) mutable {
    std::vector<int64_t> lengths;
    auto e = encode_wan_prompts(*tokenizer, text_encoder, c, length, &lengths);
    return std::map<std::string, torch::Tensor>{{"prompt_embeds", e},
                                                {"prompt_lengths", torch::tensor(lengths)}};
  };
  parts.text_length = length;
  parts.latent_key = io::read_file(vae_dir + "/config.json") +
                     train::file_stamp(models::weights_path(vae_dir, vae_variant)) +
                     (f.image_to_video ? ";i2v" : "") + (bf16 ? ";bf16" : ";fp32");
  parts.text_key = io::read_file(f.text_encoder_dir + "/config.json") +
                   train::folder_stamp(f.text_encoder_dir) + train::folder_stamp(f.tokenizer_dir) +
                   ";len " + std::to_string(length) + (bf16 ? ";bf16" : ";fp32");
  parts.size_multiple = vae_->config().spatial_compression_ratio() * t.patch_size[1];
  parts.size_reason = "Wan's VAE factor times its 2x2 patches";
  data_.build(acc, output_dir, parts);

  if (!o_.validation.prompt.empty()) {
    torch::NoGradGuard no_grad;
    validation_embeds_ =
        encode_wan_prompts(*tokenizer, text_encoder, {o_.validation.prompt}, length);
    const std::string negative = o_.validation.negative_prompt;
    negative_embeds_ = encode_wan_prompts(*tokenizer, text_encoder, {negative}, length);
    if (f.image_to_video) {
      const auto& first = data_.items().front();
      const auto& media = data_.media()[static_cast<size_t>(first.media)];
      const auto px =
          clip_pixels(read_media_frames(media, VideoDataOptions::from(o_.family).target_fps)
                          .narrow(0, first.start, 1),
                      first.height, first.width);
      validation_image_ = px.select(1, 0)
                              .add(1)
                              .mul(127.5)
                              .round()
                              .clamp(0, 255)
                              .to(torch::kUInt8)
                              .permute({1, 2, 0})
                              .contiguous();
    }
  }
  text_encoder = nullptr;
  acc.print("text encoder released: every caption's UMT5 embeddings are cached");

  if (o_.model.gradient_checkpointing) transformer_->set_gradient_checkpointing(true);
  if (!o_.lora.enabled) {
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
  const int64_t swap_blocks = train::blocks_to_swap(o_.family, o_.lora.enabled);
  if (swap_blocks > 0 && expert_ == "both") {
    throw Error(
        "--blocks_to_swap with --train_expert both: the two experts' bases are copied into the "
        "transformer by timestep, which block swap's host copies would not follow; train one "
        "expert per run (high or low) to swap blocks");
  }
  transformer_->enable_block_swap(swap_blocks);
  train::report_block_swap(acc, transformer_->block_swap());
  if (expert_ == "both") {
    // The two bases, float, on the device: the high-noise one is loaded; the low-noise one waits.
    const torch::Dtype base_dtype = models::module_dtype(*transformer_);
    auto low = models::load_wan_transformer(f.transformer_2_dir, base_dtype, o_.model.variant);
    for (const auto& item : transformer_->named_parameters(/*recurse=*/true)) {
      if (item.key().find(".lora_") != std::string::npos) continue;
      high_weights_[item.key()] = item.value().detach().clone();
    }
    for (const auto& item : low->named_parameters(/*recurse=*/true)) {
      low_weights_[item.key()] = item.value().detach().to(acc.device()).clone();
    }
    current_high_ = true;
  }
}

void WanTask::select_expert(bool high) {
  if (expert_ != "both" || high == current_high_) return;
  torch::NoGradGuard no_grad;
  const auto& from = high ? high_weights_ : low_weights_;
  for (auto& p : transformer_->named_parameters(/*recurse=*/true)) {
    const auto it = from.find(p.key());
    if (it != from.end()) p.value().copy_(it->second);
  }
  current_high_ = high;
  if (!swapped_) {
    log::info("--train_expert both: the {}-noise expert's base swapped in (first swap)",
              high ? "high" : "low");
    swapped_ = true;
  }
}

torch::Tensor WanTask::loss(const data::Batch& batch, int64_t epoch, torch::Device device) {
  if (!transformer_->is_training()) transformer_->train();
  const auto index = batch.at("index").to(torch::kCPU);
  const std::vector<int64_t> keys(index.data_ptr<int64_t>(),
                                  index.data_ptr<int64_t>() + index.numel());
  const auto latents = batch.at("latents").to(device, torch::kFloat32);
  const auto context = batch.at("prompt_embeds").to(device, torch::kFloat32);
  const auto noised = objective_->noise(latents, keys, epoch, device);
  torch::Tensor input = noised.model_input;
  if (batch.count("condition")) {
    input = torch::cat({input, batch.at("condition").to(device, torch::kFloat32)}, 1);
  }
  const auto dtype = models::module_dtype(*transformer_);
  // musubi-tuner: timesteps = t * 1000, then += 1 ("1 to 1000").
  const torch::Tensor image =
      batch.count("image_embeds") ? batch.at("image_embeds").to(device, dtype) : torch::Tensor();
  if (expert_ != "both") {
    const auto pred = transformer_->forward(input.to(dtype), (noised.timesteps + 1).to(dtype),
                                            context.to(dtype), image);
    return objective_->losses(pred.to(torch::kFloat32), noised).mean();
  }
  // Both experts (musubi-tuner's --dit + --dit_high_noise): a micro-batch runs one expert, the
  // one of its first sample's noise level (1000 t >= boundary: the high-noise one); the other
  // samples' t are moved onto that side keeping their place in it (musubi-tuner redraws them),
  // their noisy inputs remade from the same noise. A micro-batch of one sample is exactly its own
  // expert; the swap happens between micro-batches, after the previous backward.
  const double b = boundary_ / 1000.0;
  const auto t = noised.timesteps.to(torch::kFloat32) / 1000.0F;
  const bool high = t[0].item<double>() >= b;
  const auto moved = high ? torch::where(t >= b, t, b + t / b * (1 - b))
                          : torch::where(t < b, t, (t - b) / (1 - b) * b);
  std::vector<int64_t> view(static_cast<size_t>(latents.dim()), 1);
  view[0] = latents.size(0);
  diffusion::NoisedBatch part = noised;
  part.model_input = (latents + moved.view(view) * noised.target).to(noised.model_input.dtype());
  part.timesteps = moved * 1000.0F;
  torch::Tensor in = part.model_input;
  if (batch.count("condition")) {
    in = torch::cat({in, batch.at("condition").to(device, torch::kFloat32)}, 1);
  }
  select_expert(high);
  const auto pred =
      transformer_->forward(in.to(dtype), (part.timesteps + 1).to(dtype), context.to(dtype), image);
  return objective_->losses(pred.to(torch::kFloat32), part).mean();
}

train::ValidationImages WanTask::render_validation(const std::vector<int64_t>& mine,
                                                   int64_t /*begin*/,
                                                   const SamplerStepCallback& on_step) {
  const int64_t frames = validation_frames();
  if (mine.empty()) {
    return {torch::zeros({0, frames, o_.data.height(), o_.data.width(), 3})};
  }
  WanPipeline p;
  p.folder = folder_;
  if (expert_ == "both") {
    // Both experts through the one model: the pipeline asks for the expert of each step.
    p.select_expert = [this](bool high) { select_expert(high); };
  } else {
    p.folder.transformer_2_dir.clear();  // one expert: every step (musubi-tuner without the other)
    p.folder.boundary_ratio.reset();
  }
  p.transformer = transformer_;
  p.vae = vae_;
  p.scheduler = diffusion::load_sampler(folder_.scheduler_config, "");
  if (validation_image_.defined()) p.image = validation_image_;
  p.image_encoder = image_encoder_;
  p.image_processor = image_processor_;
  diffusion::GenerateRequest r;
  r.prompt_embeds = validation_embeds_;
  r.negative_prompt_embeds = negative_embeds_;
  r.num_inference_steps = o_.validation.inference_steps;
  if (o_.validation.guidance_scale_given) r.guidance_scale = *o_.validation.guidance_scale_given;
  r.height = o_.data.height();
  r.width = o_.data.width();
  r.options["num_frames"] = frames;
  r.num_images = static_cast<int64_t>(mine.size());
  r.seed = o_.validation.seed + static_cast<uint64_t>(mine.front());
  r.seeding = diffusion::Seeding::kPerImage;
  r.on_step = on_step;
  auto rendered = p.generate(r).images;
  select_expert(true);
  return {rendered};
}

void WanTask::export_to(const fs::path& out) {
  const std::string component = expert_ == "low" ? "transformer_2" : "transformer";
  if (o_.lora.enabled) {
    write_transformer_lora(out, o_, lora_, [this](io::LoraWeights& l, io::LoraFormat format) {
      adapt_dit_lora(wan_lora_layout(), l, folder_.dir, format);
    });
    return;
  }
  const fs::path dir = out / component;
  fs::create_directories(dir);
  io::write_file_atomic((dir / "config.json").string(),
                        io::read_file(transformer_dir_ + "/config.json"));
  io::TensorMap tensors;
  for (const auto& [name, t] : models::named_tensors(*transformer_)) tensors[name] = t.detach();
  io::save_safetensors((dir / "diffusion_pytorch_model.safetensors").string(), tensors,
                       {{"format", "pt"}});
  std::vector<std::string> parts = {"vae", "scheduler", "text_encoder", "tokenizer"};
  if (!folder_.transformer_2_dir.empty()) {
    parts.push_back(component == "transformer" ? "transformer_2" : "transformer");
  }
  copy_pipeline_parts(folder_.dir, out, parts);
  log::info("pipeline folder ({}, {} fine-tuned): {}", folder_.pipeline_class, component,
            out.string());
}

train::ModelCard WanTask::model_card() const {
  train::ModelCard card;
  const bool lora = o_.lora.enabled;
  card.base_model = o_.model.pretrained_model_name_or_path;
  card.title = std::string("Wan ") + (lora ? "LoRA" : "fine-tune") +
               (expert_.empty()     ? ""
                : expert_ == "both" ? " (both experts)"
                                    : " (" + expert_ + "-noise expert)");
  card.description =
      std::string("A ") + (folder_.image_to_video ? "image-to-video" : "text-to-video") +
      " fine-tune of `" + card.base_model + "` (" +
      (lora ? std::string("LoRA adapters on the transformer") : "the whole transformer") +
      "), trained with `difftrain train` (musubi-tuner's wan_train_network.py semantics) on " +
      (o_.data.train_data_dir.empty() ? std::string("its clips")
                                      : "`" + o_.data.train_data_dir + "`") +
      ".";
  card.license = "apache-2.0";
  card.tags = {folder_.image_to_video ? "image-to-video" : "text-to-video", "diffusers-training",
               "diffusers", "wan", "video"};
  card.pipeline_class = folder_.pipeline_class.empty() ? "WanPipeline" : folder_.pipeline_class;
  card.torch_dtype = "torch.bfloat16";
  card.lora = lora;
  card.lora_weight_name = "pytorch_lora_weights.safetensors";
  train::add_task_details(card, o_);
  if (lora) {
    train::set_card_detail(card, "LoRA target modules",
                           fmt::format("{}", fmt::join(lora_targets(), ", ")));
  }
  card.sample_flags = {"--prompt",     train::card_prompt(o_),
                       "--height",     std::to_string(o_.data.height()),
                       "--width",      std::to_string(o_.data.width()),
                       "--num_frames", std::to_string(validation_frames()),
                       "--output",     "sample.mp4"};
  return card;
}

}  // namespace

const std::vector<std::string>& default_wan_lora_targets(bool image_branch) {
  // musubi-tuner's Wan LoRA: every Linear of each WanAttentionBlock (self_attn q/k/v/o,
  // cross_attn q/k/v/o, and k_img/v_img with an image branch, ffn.0 / ffn.2), by Diffusers'
  // names.
  static const std::vector<std::string> plain = {
      "attn1.to_q", "attn1.to_k", "attn1.to_v",     "attn1.to_out.0", "attn2.to_q",
      "attn2.to_k", "attn2.to_v", "attn2.to_out.0", "ffn.net.0.proj", "ffn.net.2"};
  static const std::vector<std::string> with_image = [] {
    auto v = plain;
    v.push_back("attn2.add_k_proj");
    v.push_back("attn2.add_v_proj");
    return v;
  }();
  return image_branch ? with_image : plain;
}

std::unique_ptr<train::TrainingTask> make_wan_training_task(const train::TaskOptions& options) {
  return std::make_unique<WanTask>(options);
}

}  // namespace difftrain::families::wan
