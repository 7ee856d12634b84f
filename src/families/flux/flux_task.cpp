// The FLUX.1 training task: Diffusers' train_dreambooth_lora_flux.py (LoRA on the transformer and
// optionally CLIP, DreamBooth prior preservation) and train_dreambooth_flux.py (full fine-tuning)
// on a FluxPipeline folder. The data side (captioned images, buckets, class images drawn with the
// FLUX sampler, the latent and text caches) is families::TextImageData; the objective is
// diffusion::FlowMatchObjective on the folder's FlowMatchEulerDiscreteScheduler tables and the
// denoiser FluxDenoiser (packing, ids, t/1000, embedded guidance). With the text encoders frozen,
// every caption's T5 and CLIP embeddings (and the validation prompt's) are computed once and the
// encoders released.
#include "../text_image_data.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/phase.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/families/flux/denoiser.h"
#include "difftrain/families/flux/lora_layouts.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/module_info.h"
#include "difftrain/models/pretrained.h"
#include "difftrain/train/block_swap_option.h"
#include "difftrain/train/flow_matching_options.h"
#include "difftrain/train/text_image_options.h"
#include "flux_family.h"
#include "flux_pipeline.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::flux {
namespace {
namespace fs = std::filesystem;
using families::EncodedBatch;
using families::TextImageData;

// What a FLUX.1 LoRA run trains when CLIP trains too: both adapter sets, under "transformer" and
// "text_encoder", prepared, optimised and checkpointed as one module.
class FluxLoraImpl : public torch::nn::Module {
 public:
  FluxLoraImpl(models::LoraLayers transformer, models::LoraLayers text_encoder) {
    register_module("transformer", std::move(transformer));
    register_module("text_encoder", std::move(text_encoder));
  }
};
TORCH_MODULE(FluxLora);

class FluxTask : public families::TextImageTask {
 public:
  explicit FluxTask(train::TaskOptions options) : TextImageTask(std::move(options)) {}

  std::string name() const override { return "FLUX.1 text-to-image"; }
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
    // With the weights (consolidated by `difftrain merge-weights`), a transformer folder.
    io::write_file_atomic((dir / "config.json").string(),
                          io::read_file(folder_.transformer_dir + "/config.json"));
  }
  void export_to(const fs::path& out) override;

  // As train_dreambooth_(lora_)flux.py's save_model_card: licence "other" (FLUX.1-dev's
  // non-commercial licence, linked), tags flux and flux-diffusers, bf16 in the snippet.
  train::ModelCard model_card() const override {
    train::ModelCard card;
    const bool lora = o_.lora.enabled, dreambooth = !o_.text.instance_prompt.empty();
    card.base_model = o_.model.pretrained_model_name_or_path;
    card.title =
        std::string("Flux ") + (dreambooth ? "DreamBooth " : "") + (lora ? "LoRA" : "fine-tune");
    card.description = "A text-to-image " + std::string(dreambooth ? "DreamBooth " : "") +
                       "fine-tune of `" + card.base_model + "` (" +
                       (lora ? std::string("LoRA adapters on the transformer") +
                                   (o_.lora.train_text_encoder ? " and the CLIP text encoder" : "")
                             : std::string("the whole transformer")) +
                       "), trained with `difftrain train` (Diffusers' train_dreambooth" +
                       (lora ? "_lora" : "") + "_flux.py) on " +
                       (o_.data.train_data_dir.empty() ? std::string("its dataset")
                                                       : "`" + o_.data.train_data_dir + "`") +
                       ".";
    card.license = "other";
    card.license_note =
        "Please adhere to the licensing terms as described "
        "[here](https://huggingface.co/black-forest-labs/FLUX.1-dev/blob/main/LICENSE.md).";
    card.tags = {"text-to-image", "flux", "flux-diffusers"};
    card.pipeline_class = "FluxPipeline";
    card.torch_dtype = "torch.bfloat16";
    card.lora = lora;
    card.lora_weight_name = "pytorch_lora_weights.safetensors";
    train::add_task_details(card, o_);
    if (lora)
      train::set_card_detail(card, "LoRA target modules",
                             fmt::format("{}", fmt::join(lora_targets(), ", ")));
    card.sample_flags = {"--prompt", train::card_prompt(o_),
                         "--height", std::to_string(o_.data.height()),
                         "--width",  std::to_string(o_.data.width())};
    return card;
  }

 private:
  // The transformer's LoRA targets: --lora_layers, else --lora_target_modules when changed, else
  // Diffusers' FLUX default (attention and feed-forward projections).
  std::vector<std::string> lora_targets() const {
    if (!o_.lora.layers.empty()) return o_.lora.layers;
    if (o_.lora.target_modules_given) return o_.lora.target_modules;
    return default_flux_lora_targets();
  }
  void check_flags() const;
  void build_trainable(accel::Accelerator& acc);
  // The FluxPipeline of the current weights (the folder's scheduler).
  FluxPipeline as_pipeline() const;
  // A text-to-image request for `prompt` at the run's resolution and guidance, image i from
  // seed + i.
  diffusion::GenerateRequest render_request(const std::string& prompt) const;

  FluxFolder folder_;
  diffusion::TextEncoderStack text_;
  models::AutoencoderKL vae_{nullptr};
  models::FluxTransformer2DModel transformer_{nullptr};
  models::LoraLayers lora_{nullptr}, text_lora_{nullptr};
  std::shared_ptr<torch::nn::Module> trainable_;
  std::unique_ptr<diffusion::FlowMatchObjective> objective_;
  std::unique_ptr<FluxDenoiser> denoiser_;
  bool guided_ = false;  // FLUX.1-dev embeds the guidance; schnell does not
  double guidance_ = 3.5;
  // The validation prompt's embeddings when the encoders are released (else undefined).
  torch::Tensor validation_embeds_, validation_pooled_;
};

void FluxTask::check_flags() const {
  if (o_.lora.train_text_encoder && !o_.lora.enabled) {
    throw Error(
        "--train_text_encoder trains CLIP LoRA adapters beside the transformer's: add --lora "
        "(full fine-tuning trains the transformer only)");
  }
}

void FluxTask::build(accel::Accelerator& acc, const std::string& output_dir) {
  const std::string& model = o_.model.pretrained_model_name_or_path;
  TextImageData::check_options(o_, model);
  check_flags();
  folder_ = resolve_flux_folder(model);
  // Frozen weights are read straight in bf16 under bf16 mixed precision (T5-XXL alone is
  // ~9.5 GB there); what trains stays float32.
  const bool bf16 = acc.mixed_precision() == accel::MixedPrecision::kBf16;
  const torch::Dtype frozen = bf16 ? torch::kBFloat16 : torch::kFloat32;
  const auto& f = folder_;
  text_ = load_flux_text_encoders(f, o_.model.variant, frozen);
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
  transformer_ = models::load_flux_transformer(
      f.transformer_dir, o_.lora.enabled ? frozen : torch::kFloat32, o_.model.variant);
  transformer_->to(acc.device());
  check_flux_parts(f, *transformer_, *vae_, text_);
  guided_ = transformer_->options().guidance_embeds();
  guidance_ = o_.validation.guidance_scale_given.value_or(3.5);
  if (!guided_ && o_.validation.guidance_scale_given) {
    acc.warn("--guidance_scale {} is ignored: {} has no guidance embedding (FLUX.1-schnell)",
             guidance_, f.transformer_dir);
  }

  const diffusion::FlowMatchOptions fo = train::flow_matching_options(o_.family, o_.noise.seed);
  nlohmann::json scheduler;
  try {
    scheduler = nlohmann::json::parse(io::read_file(f.scheduler_config));
  } catch (const nlohmann::json::exception& e) {
    throw Error(f.scheduler_config + ": not valid JSON (" + e.what() + ")");
  }
  objective_ = std::make_unique<diffusion::FlowMatchObjective>(scheduler, f.scheduler_config, fo);
  acc.print("objective: {}{}", objective_->name(),
            guided_ ? fmt::format(", guidance {}", guidance_) : std::string(", no guidance"));

  parts.vae = image_vae(vae_);
  parts.text = &text_;
  parts.size_multiple = flux_vae_scale_factor(vae_->config());
  parts.size_reason = "FLUX.1's VAE factor times 2, for its 2x2 patches";
  // DreamBooth's class images come from the pretrained pipeline with the class prompt.
  auto class_images = [this](int64_t count, uint64_t seed) {
    FluxPipeline pipe = as_pipeline();
    diffusion::GenerateRequest r = render_request(o_.text.class_prompt);
    r.num_images = count;
    r.seed = seed;
    r.on_step = [](int64_t, int64_t) { core::note_progress(); };
    return pipe.generate(r).images;
  };
  const bool frozen_text = !o_.lora.train_text_encoder;
  // Captions that change every epoch (shuffled, tag dropout) are encoded batch by batch.
  data_.build(acc, output_dir, parts, class_images, /*cache_text=*/frozen_text);
  if (data_.text_cache_filled()) {
    if (!o_.validation.prompt.empty()) {
      const auto e = data_.encode_captions({o_.validation.prompt});
      validation_embeds_ = e.at("prompt_embeds");
      validation_pooled_ = e.at("pooled_prompt_embeds");
    }
    // Every embedding the run needs is cached: the encoders go (tokenizers stay).
    text_ = text_.tokenizers_only();
    acc.print("text encoders released: the captions' T5 and CLIP embeddings are cached");
  }
  if (o_.model.gradient_checkpointing) transformer_->set_gradient_checkpointing(true);
  build_trainable(acc);
  // Once the adapters are attached and the base stored as it trains: the swap copies what the
  // device holds.
  transformer_->enable_block_swap(train::blocks_to_swap(o_.family, o_.lora.enabled));
  train::report_block_swap(acc, transformer_->block_swap());
  denoiser_ = std::make_unique<FluxDenoiser>(transformer_);
}

void FluxTask::build_trainable(accel::Accelerator& acc) {
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
  if (o_.lora.train_text_encoder) {
    models::LoraConfig tc = lc;
    tc.target_modules = o_.lora.text_encoder_target_modules;
    text_lora_ = models::LoraLayers(*text_[0].module(), tc);
    trainable_ = FluxLora(lora_, text_lora_).ptr();
  }
  acc.print("LoRA rank {} alpha {} on {} transformer module(s){}", lc.rank, lc.alpha,
            lora_->module_names().size(),
            text_lora_ ? fmt::format(" and {} CLIP module(s)", text_lora_->module_names().size())
                       : std::string());
  // The 8-bit base, once the adapters are attached: the transformer's frozen layers and the
  // encoders still loaded (CLIP under --train_text_encoder; released ones are gone).
  auto frozen = text_.modules();
  frozen.push_back(transformer_.ptr().get());
  train::quantize_frozen_base(acc, o_.model.base_weights_dtype, frozen);
}

torch::Tensor FluxTask::loss(const data::Batch& batch, int64_t epoch, torch::Device device) {
  // Validation renders leave the transformer in eval mode; checkpointing needs training mode.
  if (!transformer_->is_training()) transformer_->train();
  std::vector<int64_t> keys;
  const EncodedBatch in = data_.encode_batch(batch, epoch, device, keys);
  diffusion::Conditioning cond = {{"encoder_hidden_states", in.embeds},
                                  {"pooled_projections", in.pooled}};
  if (guided_) {
    cond["guidance"] = torch::full({in.latents.size(0)}, guidance_,
                                   torch::TensorOptions().device(device).dtype(torch::kFloat32));
  }
  const auto noised = objective_->noise(in.latents, keys, epoch, device);
  const auto prediction = denoiser_->denoise(noised.model_input, noised.timesteps, cond);
  return data_.reduce_losses(objective_->losses(prediction, noised, in.loss_mask));
}

FluxPipeline FluxTask::as_pipeline() const {
  FluxPipeline p;
  p.folder = folder_;
  p.text_encoders = text_;
  p.transformer = transformer_;
  p.vae = vae_;
  p.scheduler = diffusion::load_sampler(folder_.scheduler_config, "");
  return p;
}

diffusion::GenerateRequest FluxTask::render_request(const std::string& prompt) const {
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

train::ValidationImages FluxTask::render_validation(const std::vector<int64_t>& mine,
                                                    int64_t /*begin*/,
                                                    const SamplerStepCallback& on_step) {
  if (mine.empty()) return {torch::zeros({0, o_.data.height(), o_.data.width(), 3})};
  FluxPipeline pipe = as_pipeline();
  diffusion::GenerateRequest r = render_request(o_.validation.prompt);
  if (validation_embeds_.defined()) {
    r.prompt_embeds = validation_embeds_;
    r.pooled_prompt_embeds = validation_pooled_;
  }
  r.num_images = static_cast<int64_t>(mine.size());
  r.seed = o_.validation.seed + static_cast<uint64_t>(mine.front());
  r.on_step = on_step;
  return {pipe.generate(r).images};
}

void FluxTask::export_to(const fs::path& out) {
  if (!o_.lora.enabled) {
    models::save_flux_transformer(*transformer_, (out / "transformer").string());
    families::copy_pipeline_parts(
        folder_.dir, out,
        {"vae", "scheduler", "text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2"});
    log::info("pipeline folder (FluxPipeline): {}", out.string());
    return;
  }
  io::LoraWeights weights = lora_->to_lora_weights("transformer");
  if (text_lora_) {
    weights.components["text_encoder"] =
        text_lora_->to_lora_weights("text_encoder").components["text_encoder"];
  }
  const auto path = (out / "pytorch_lora_weights.safetensors").string();
  const std::map<std::string, std::string> meta = {
      {"difftrain_rank", std::to_string(o_.lora.rank)},
      {"difftrain_lora_alpha", std::to_string(o_.lora.alpha)}};
  if (o_.lora.format == "kohya") {
    // sd-scripts' FLUX names (BFL modules, q/k/v fused), as kohya-trained FLUX LoRAs have.
    // FluxSingleTransformerBlock's mlp_ratio 4: linear1's proj_mlp rows when not trained.
    const int64_t mlp_dim = 4 * transformer_->options().inner_dim();
    io::write_lora(path, families::flux::flux_lora_to_bfl(weights, mlp_dim), io::LoraFormat::kKohya,
                   meta);
  } else if (o_.lora.format == "peft") {
    io::write_lora(path, weights, io::LoraFormat::kPeft, meta);
  } else {
    // As Diffusers' FLUX script saves it (FluxPipeline.save_lora_weights of PEFT state dicts):
    // "transformer.<module>.lora_A.weight", alpha / r folded into lora_B.
    io::Metadata m(meta.begin(), meta.end());
    m.emplace("format", "pt");
    io::save_safetensors(path, io::lora_to_tensors(weights, io::LoraFormat::kPeft), m);
  }
  log::info("LoRA weights ({} format): {}", o_.lora.format, path);
}

}  // namespace

std::unique_ptr<train::TrainingTask> make_flux_training_task(const train::TaskOptions& options) {
  return std::make_unique<FluxTask>(options);
}

}  // namespace difftrain::families::flux
