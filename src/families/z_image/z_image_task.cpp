// The Z-Image training task: Diffusers' train_dreambooth_lora_z_image.py (LoRA on the
// transformer's attention by default, DreamBooth prior preservation) and full fine-tuning of the
// transformer on a ZImagePipeline folder. The data side is families::TextImageData (captions,
// buckets, class images drawn with ZImagePipeline, the latent and text caches; latents are the
// VAE posterior's mode, as the script takes them); the objective is diffusion::FlowMatchObjective
// on the folder's scheduler tables; the denoiser ZImageDenoiser (lists, real caption tokens,
// t = (1000 - t) / 1000, the negated output). Qwen3 is frozen: every caption's embeddings (and the
// validation prompt's) are computed once and the text encoder released.
#include "z_image_task.h"
#include "../text_image_data.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/phase.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/families/z_image/denoiser.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/train/block_swap_option.h"
#include "difftrain/train/flow_matching_options.h"
#include "difftrain/train/text_image_options.h"
#include "z_image_pipeline.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::z_image {
namespace {
namespace fs = std::filesystem;
using families::EncodedBatch;
using families::TextImageData;

class ZImageTask : public families::TextImageTask {
 public:
  explicit ZImageTask(train::TaskOptions options) : TextImageTask(std::move(options)) {}

  std::string name() const override { return "Z-Image text-to-image"; }
  void build(accel::Accelerator& acc, const std::string& output_dir) override;
  std::shared_ptr<torch::nn::Module> trainable() const override { return trainable_; }

  std::string parameter_summary() const override {
    return train::parameter_summary(*transformer_, *trainable_, o_.lora.enabled);
  }

  int64_t frozen_bytes() const override {
    int64_t n = o_.lora.enabled ? train::frozen_parameter_bytes(*transformer_) : 0;
    n += train::frozen_parameter_bytes(*vae_);
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

  // As train_dreambooth_lora_z_image.py's save_model_card: Apache-2.0, its tags.
  train::ModelCard model_card() const override {
    return transformer_model_card("Z-Image", "train_dreambooth_lora_z_image.py", "z-image",
                                  "ZImagePipeline", lora_targets());
  }

 private:
  std::vector<std::string> lora_targets() const {
    if (!o_.lora.layers.empty()) return o_.lora.layers;
    if (o_.lora.target_modules_given) return o_.lora.target_modules;
    return default_z_image_lora_targets();
  }
  void build_trainable(accel::Accelerator& acc);
  ZImagePipeline as_pipeline() const;
  diffusion::GenerateRequest render_request(const std::string& prompt) const;

  ZImageFolder folder_;
  diffusion::TextEncoderStack text_;
  models::AutoencoderKL vae_{nullptr};
  models::ZImageTransformer2DModel transformer_{nullptr};
  models::LoraLayers lora_{nullptr};
  std::shared_ptr<torch::nn::Module> trainable_;
  std::unique_ptr<diffusion::FlowMatchObjective> objective_;
  std::unique_ptr<ZImageDenoiser> denoiser_;
  double guidance_ = 5.0;
  // The validation prompt's (and, with guidance, the empty negative prompt's) embeddings and
  // masks when the text encoder is released (else undefined).
  torch::Tensor validation_embeds_, validation_mask_, negative_embeds_, negative_mask_;
};

void ZImageTask::build(accel::Accelerator& acc, const std::string& output_dir) {
  const std::string& model = o_.model.pretrained_model_name_or_path;
  TextImageData::check_options(o_, model);
  if (o_.lora.train_text_encoder) {
    throw Error(
        "--train_text_encoder: train_dreambooth_lora_z_image.py trains the transformer only "
        "(Qwen3 stays frozen and its embeddings are cached); leave the flag out");
  }
  folder_ = resolve_z_image_folder(model);
  const bool bf16 = acc.mixed_precision() == accel::MixedPrecision::kBf16;
  const torch::Dtype frozen = bf16 ? torch::kBFloat16 : torch::kFloat32;
  const auto& f = folder_;
  text_ = load_z_image_text_encoders(f, o_.model.variant, frozen);
  text_.set_max_sequence_length(o_.family.integer("max_sequence_length"));
  text_.freeze();
  text_.to(acc.device());
  TextImageData::Parts parts;
  parts.vae_dir = o_.model.vae.empty() ? f.vae_dir : o_.model.vae;
  parts.vae_variant = o_.model.vae.empty() ? o_.model.variant : "";
  if (!o_.model.vae.empty()) acc.print("VAE from {}", o_.model.vae);
  vae_ = models::load_autoencoder_kl(parts.vae_dir, parts.vae_variant);
  for (auto& p : vae_->parameters()) p.set_requires_grad(false);
  vae_->to(acc.device(), frozen);
  vae_->eval();
  transformer_ = models::load_z_image_transformer(
      f.transformer_dir, o_.lora.enabled ? frozen : torch::kFloat32, o_.model.variant);
  transformer_->to(acc.device());
  check_z_image_parts(f, *transformer_, *vae_, text_);
  guidance_ = o_.validation.guidance_scale_given.value_or(5.0);

  const diffusion::FlowMatchOptions fo = train::flow_matching_options(o_.family, o_.noise.seed);
  nlohmann::json scheduler;
  try {
    scheduler = nlohmann::json::parse(io::read_file(f.scheduler_config));
  } catch (const nlohmann::json::exception& e) {
    throw Error(f.scheduler_config + ": not valid JSON (" + e.what() + ")");
  }
  objective_ = std::make_unique<diffusion::FlowMatchObjective>(scheduler, f.scheduler_config, fo);
  acc.print("objective: {}; validation guidance {}", objective_->name(), guidance_);

  parts.vae = image_vae(vae_);
  parts.text = &text_;
  parts.size_multiple = 2 * z_image_vae_scale_factor(vae_->config());
  parts.size_reason = "Z-Image's VAE factor times 2, for its 2x2 patches";
  parts.latent_mode = true;  // the script trains on latent_dist.mode()
  auto class_images = [this](int64_t count, uint64_t seed) {
    ZImagePipeline pipe = as_pipeline();
    diffusion::GenerateRequest r = render_request(o_.text.class_prompt);
    r.num_images = count;
    r.seed = seed;
    r.on_step = [](int64_t, int64_t) { core::note_progress(); };
    return pipe.generate(r).images;
  };
  parts.text_cache_reason = "Z-Image's Qwen3 is released once every caption is encoded";
  data_.build(acc, output_dir, parts, class_images, /*cache_text=*/true);
  if (!o_.validation.prompt.empty()) {
    const auto e = data_.encode_captions({o_.validation.prompt});
    validation_embeds_ = e.at("prompt_embeds");
    validation_mask_ = e.at("prompt_attention_mask");
    if (guidance_ > 0) {
      const auto n = data_.encode_captions({""});
      negative_embeds_ = n.at("prompt_embeds");
      negative_mask_ = n.at("prompt_attention_mask");
    }
  }
  // Every embedding the run needs is cached: Qwen3 goes (the tokenizer stays).
  text_ = text_.tokenizers_only();
  acc.print("text encoder released: the captions' Qwen3 embeddings are cached");
  if (o_.model.gradient_checkpointing) transformer_->set_gradient_checkpointing(true);
  build_trainable(acc);
  // Once the adapters are attached and the base stored as it trains.
  transformer_->enable_block_swap(train::blocks_to_swap(o_.family, o_.lora.enabled));
  train::report_block_swap(acc, transformer_->block_swap());
  denoiser_ = std::make_unique<ZImageDenoiser>(transformer_);
}

void ZImageTask::build_trainable(accel::Accelerator& acc) {
  if (!o_.lora.enabled) {
    trainable_ = transformer_.ptr();
    return;
  }
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

torch::Tensor ZImageTask::loss(const data::Batch& batch, int64_t epoch, torch::Device device) {
  if (!transformer_->is_training()) transformer_->train();
  std::vector<int64_t> keys;
  const EncodedBatch in = data_.encode_batch(batch, epoch, device, keys);
  const diffusion::Conditioning cond = {{"encoder_hidden_states", in.embeds},
                                        {"encoder_attention_mask", in.attention_mask}};
  const auto noised = objective_->noise(in.latents, keys, epoch, device);
  const auto prediction = denoiser_->denoise(noised.model_input, noised.timesteps, cond);
  return data_.reduce_losses(objective_->losses(prediction, noised, in.loss_mask));
}

ZImagePipeline ZImageTask::as_pipeline() const {
  ZImagePipeline p;
  p.folder = folder_;
  p.text_encoders = text_;
  p.transformer = transformer_;
  p.vae = vae_;
  p.scheduler = diffusion::load_sampler(folder_.scheduler_config, "");
  return p;
}

diffusion::GenerateRequest ZImageTask::render_request(const std::string& prompt) const {
  diffusion::GenerateRequest r;
  r.prompts = {prompt};
  r.num_inference_steps = o_.validation.inference_steps;
  r.guidance_scale = guidance_;
  r.height = o_.data.height();
  r.width = o_.data.width();
  r.max_sequence_length = o_.family.integer("max_sequence_length");
  r.seeding = diffusion::Seeding::kPerImage;
  return r;
}

train::ValidationImages ZImageTask::render_validation(const std::vector<int64_t>& mine,
                                                      int64_t /*begin*/,
                                                      const SamplerStepCallback& on_step) {
  if (mine.empty()) return {torch::zeros({0, o_.data.height(), o_.data.width(), 3})};
  ZImagePipeline pipe = as_pipeline();
  diffusion::GenerateRequest r = render_request(o_.validation.prompt);
  r.prompt_embeds = validation_embeds_;
  r.prompt_attention_mask = validation_mask_;
  r.negative_prompt_embeds = negative_embeds_;
  r.negative_attention_mask = negative_mask_;
  r.num_images = static_cast<int64_t>(mine.size());
  r.seed = o_.validation.seed + static_cast<uint64_t>(mine.front());
  r.on_step = on_step;
  return {pipe.generate(r).images};
}

void ZImageTask::export_to(const fs::path& out) {
  export_transformer_run(
      out, folder_, *transformer_, lora_,
      [this](io::LoraWeights& l) { adapt_z_image_lora(l, folder_.dir, io::LoraFormat::kKohya); },
      "ZImagePipeline");
}

}  // namespace

const std::vector<std::string>& default_z_image_lora_targets() {
  static const std::vector<std::string> targets = {"to_k", "to_q", "to_v", "to_out.0"};
  return targets;
}

std::unique_ptr<train::TrainingTask> make_z_image_training_task(const train::TaskOptions& options) {
  return std::make_unique<ZImageTask>(options);
}

}  // namespace difftrain::families::z_image
