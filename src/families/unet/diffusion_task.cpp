// What the diffusion tasks share: noise scheduler, LoRA, the denoising loss, checkpoint config
// files and the LoRA export.
#include "difftrain/families/unet/diffusion_task.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/diffusion/scheduler_config.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_format.h"
#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/models/unets/sgm_names.h"
#include "difftrain/train/ddpm_options.h"
#include "difftrain/train/text_image_options.h"

#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::unet {
using namespace difftrain::train;
namespace fs = std::filesystem;

DiffusionTask::DiffusionTask(train::TaskOptions options)
    : o_(train::with_text_image_options(std::move(options))) {
  if (o_.family.find("prediction_type") != nullptr) {
    o_.noise = train::ddpm_noise_options(o_.family, o_.noise.seed);
  }
}

namespace {

// What a text-to-image LoRA run trains when the text encoder trains too: both adapter sets,
// under "unet" and "text_encoder", prepared, optimised and checkpointed as one module.
class TextToImageLoraImpl : public torch::nn::Module {
 public:
  TextToImageLoraImpl(models::LoraLayers unet, models::LoraLayers text_encoder,
                      models::LoraLayers text_encoder_2) {
    register_module("unet", std::move(unet));
    register_module("text_encoder", std::move(text_encoder));
    // SDXL's second encoder; SD-1.x/2.x runs keep the two-child layout of their checkpoints.
    if (!text_encoder_2.is_empty()) register_module("text_encoder_2", std::move(text_encoder_2));
  }
};
TORCH_MODULE(TextToImageLora);

}  // namespace

void DiffusionTask::build_noise_scheduler() {
  diffusion::SchedulerConfig sc;
  bool have_scheduler = false;
  if (!o_.model.pretrained_model_name_or_path.empty()) {
    const fs::path p(o_.model.pretrained_model_name_or_path);
    for (const auto& f : {p / "scheduler" / "scheduler_config.json", p / "scheduler_config.json"}) {
      if (fs::exists(f)) {
        sc = diffusion::SchedulerConfig::load(f.string());
        have_scheduler = true;
        break;
      }
    }
  }
  if (!have_scheduler) {
    sc.num_train_timesteps = o_.noise.ddpm_num_steps;
    sc.beta_schedule = diffusion::parse_beta_schedule(o_.noise.ddpm_beta_schedule);
  }
  sc.prediction_type = diffusion::parse_prediction_type(o_.noise.prediction_type);
  sc.class_name = "DDPMScheduler";
  noise_scheduler_ = diffusion::make_scheduler(sc, "ddpm");
  diffusion::DdpmObjectiveOptions oo;
  oo.snr_gamma = o_.noise.snr_gamma;
  oo.noise_offset = o_.noise.noise_offset;
  oo.input_perturbation = o_.noise.input_perturbation;
  oo.multires_noise_iterations = o_.noise.multires_noise_iterations;
  oo.multires_noise_discount = o_.noise.multires_noise_discount;
  oo.loss = o_.noise.loss;
  oo.seed = o_.noise.seed;
  objective_ = std::make_shared<diffusion::DdpmObjective>(noise_scheduler_, oo);
}

void DiffusionTask::build_trainable(accel::Accelerator& acc, torch::nn::Module* text_encoder,
                                    torch::nn::Module* text_encoder_2) {
  if (o_.lora.enabled) {
    for (auto& p : unet_->parameters()) p.set_requires_grad(false);
    unet_->to(acc.device());
    models::LoraConfig lc;
    lc.rank = o_.lora.rank;
    lc.alpha = o_.lora.alpha;
    lc.dropout = o_.lora.dropout;
    lc.target_modules = o_.lora.target_modules;
    lora_ = models::LoraLayers(*unet_, lc);
    trainable_ = lora_.ptr();
    if (o_.lora.train_text_encoder && text_encoder != nullptr) {
      models::LoraConfig tc = lc;
      tc.target_modules = o_.lora.text_encoder_target_modules;
      if (text_encoder_2 != nullptr) {
        // SDXL reads text_encoder's hidden_states[-(skip + 2)]: its layers after that one (and
        // none of text_encoder_2's, whose pooled output comes from the last) never reach the loss.
        text_lora_2_ = models::LoraLayers(*text_encoder_2, tc);
        const auto* te = dynamic_cast<const models::ClipTextModelImpl*>(text_encoder);
        if (te != nullptr) {
          const int64_t layers = te->config().num_hidden_layers;
          for (int64_t i = layers - 1 - (o_.text.clip_skip - 1); i < layers; ++i) {
            tc.exclude_prefixes.push_back("text_model.encoder.layers." + std::to_string(i));
          }
        }
      }
      text_lora_ = models::LoraLayers(*text_encoder, tc);
      trainable_ = TextToImageLora(lora_, text_lora_, text_lora_2_).ptr();
    }
  } else {
    trainable_ = unet_.ptr();
  }
  if (acc.mixed_precision() == accel::MixedPrecision::kBf16) {
    if (o_.lora.enabled) unet_->to(torch::kBFloat16);
    for (auto* m : frozen_modules()) m->to(torch::kBFloat16);
  }
  // The 8-bit base: the UNet's and the text encoders' frozen layers (not the VAE's).
  quantize_frozen_base(acc, o_.model.base_weights_dtype,
                       {unet_.ptr().get(), text_encoder, text_encoder_2});
}

std::string DiffusionTask::parameter_summary() const {
  return train::parameter_summary(*unet_, *trainable_, o_.lora.enabled);
}

int64_t DiffusionTask::frozen_bytes() const {
  int64_t n = o_.lora.enabled ? frozen_parameter_bytes(*unet_) : 0;
  for (const auto* m : frozen_modules()) n += frozen_parameter_bytes(*m);
  return n;
}

void DiffusionTask::write_to_checkpoint(const fs::path& dir) const {
  if (o_.lora.enabled) return;
  // With the weights (consolidated by `difftrain merge-weights`), a Diffusers UNet folder.
  io::write_file_atomic((dir / "config.json").string(), unet_->config().to_json().dump(2) + "\n");
  io::write_file_atomic(
      (dir / "scheduler_config.json").string(),
      diffusion::dump_python_json(noise_scheduler_->config().to_json(), 2) + "\n");
}

torch::Tensor DiffusionTask::denoising_losses(const torch::Tensor& x0,
                                              const std::vector<int64_t>& keys, int64_t epoch,
                                              torch::Device device,
                                              const diffusion::Conditioning& cond,
                                              const torch::Tensor& loss_mask) {
  if (!denoiser_) denoiser_ = std::make_unique<families::unet::UNetDenoiser>(unet_);
  const auto noised = objective_->noise(x0, keys, epoch, device);
  const auto prediction = denoiser_->denoise(noised.model_input, noised.timesteps, cond);
  return objective_->losses(prediction, noised, loss_mask);
}

void DiffusionTask::export_lora(const fs::path& out) const {
  const auto format = o_.lora.format == "kohya"  ? io::LoraFormat::kKohya
                      : o_.lora.format == "peft" ? io::LoraFormat::kPeft
                                                 : io::LoraFormat::kDiffusers;
  const auto path = out / "pytorch_lora_weights.safetensors";
  io::LoraWeights weights = lora_->to_lora_weights("unet");
  if (text_lora_) {
    auto te = text_lora_->to_lora_weights("text_encoder");
    weights.components["text_encoder"] = te.components["text_encoder"];
  }
  if (text_lora_2_) {
    auto te = text_lora_2_->to_lora_weights("text_encoder_2");
    weights.components["text_encoder_2"] = te.components["text_encoder_2"];
  }
  // kohya's SDXL files name the UNet's modules in Stability's SGM layout (sd-scripts' SDXL
  // model), as kohya-trained SDXL LoRAs do.
  if (format == io::LoraFormat::kKohya && unet_->needs_added_conditioning()) {
    weights = models::with_sgm_unet_names(weights, unet_->config());
  }
  io::write_lora(path.string(), weights, format,
                 {{"difftrain_rank", std::to_string(o_.lora.rank)},
                  {"difftrain_lora_alpha", std::to_string(o_.lora.alpha)}});
  log::info("LoRA weights ({} format): {}", o_.lora.format, path.string());
}

}  // namespace difftrain::families::unet
