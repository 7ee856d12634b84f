// The UNet families' memory model (families::unet::estimate_memory for UNet, SD and SDXL folders):
// the UNet built from its config, LoRA adapters as the trainer adds them, the pipeline's frozen
// encoders and VAE counted from their configs, and activations measured on one forward.

#include "difftrain/families/unet/memory.h"
#include "difftrain/models/kernels/quantized_weight.h"

#include "difftrain/accel/precision.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/lora/lora_training.h"
#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/models/unets/unet_config.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <filesystem>

namespace difftrain::families::unet {
using namespace difftrain::train;
namespace fs = std::filesystem;
namespace {

models::UNetConditioning make_conditioning(const models::UNetImpl& unet, int64_t batch,
                                           int64_t sequence_length) {
  const auto& c = unet.config();
  models::UNetConditioning cond;
  const std::string type = c.class_embed_type.value_or("");
  if (c.num_class_embeds) {
    cond.class_labels = torch::zeros({batch}, torch::kInt64);
  } else if (type == "timestep") {
    cond.class_labels = torch::randint(0, 1000, {batch}, torch::kInt64);
  } else if (type == "projection" || type == "simple_projection") {
    cond.class_labels = torch::zeros({batch, c.projection_class_embeddings_input_dim.value_or(1)});
  } else if (type == "identity") {
    cond.class_labels =
        torch::zeros({batch, c.time_embedding_dim.value_or(c.block_out_channels.at(0) * 4)});
  }
  if (c.time_cond_proj_dim) cond.timestep_cond = torch::zeros({batch, *c.time_cond_proj_dim});
  if (unet.needs_encoder_hidden_states()) {
    const int64_t dim = c.cross_attention_dim.empty() ? 1 : c.cross_attention_dim[0];
    cond.encoder_hidden_states = torch::zeros({batch, sequence_length, dim});
  }
  if (unet.needs_added_conditioning()) {
    // SDXL: 6 time ids, the pooled text embedding fills the rest of add_embedding's input.
    const int64_t ids = 6 * c.addition_time_embed_dim.value_or(0);
    cond.text_embeds =
        torch::zeros({batch, c.projection_class_embeddings_input_dim.value_or(ids) - ids});
    cond.time_ids = torch::full({batch, 6}, 1024.0);
  }
  return cond;
}

// One training forward of `unet` on sample [B, C, H, W], timesteps [B]; returns the output
// [B, out_channels, H, W] with its graph alive (the autocast scope ends, as in a training step).
torch::Tensor training_forward(models::UNetImpl& unet, accel::MixedPrecision mp,
                               const torch::Tensor& sample, const torch::Tensor& timesteps,
                               const models::UNetConditioning& cond) {
  accel::AutocastGuard autocast(mp, torch::kCPU);
  return unet.forward(sample, timesteps, cond);
}

}  // namespace

int64_t measure_activation_bytes(models::UNetImpl& unet, const MemoryEstimateOptions& options,
                                 int64_t batch_size) {
  check_memory_estimate_options(options);
  if (batch_size < 1) throw Error(fmt::format("batch_size must be >= 1, got {}", batch_size));
  const auto& c = unet.config();
  int64_t h = options.resolution, w = options.resolution;
  if (h == 0) {
    if (c.sample_size.empty()) {
      throw Error(
          "the UNet config has no sample_size (null); pass the input size with --resolution");
    }
    h = c.sample_size[0];
    w = c.sample_size.size() > 1 ? c.sample_size[1] : h;
  }
  // Every down block but the last halves the size.
  const int64_t factor = int64_t{1} << std::max<int64_t>(0, c.down_block_types.size() - 1);
  if (h % factor != 0 || w % factor != 0) {
    throw Error(fmt::format(
        "resolution {}x{} is not divisible by {}, the UNet's downsampling factor; use a multiple "
        "of {}",
        h, w, factor, factor));
  }
  const auto mp = accel::parse_mixed_precision(options.mixed_precision);
  if (mp == accel::MixedPrecision::kBf16) accel::install_autocast_fixes();
  const bool was_training = unet.is_training();
  const bool was_checkpointing = unet.gradient_checkpointing();
  unet.train();
  unet.set_gradient_checkpointing(options.gradient_checkpointing);
  torch::AutoGradMode grad_on(true);

  // CLIP's 77 tokens unless given.
  auto cond = make_conditioning(
      unet, batch_size, options.encoder_sequence_length > 0 ? options.encoder_sequence_length : 77);
  auto x = torch::randn({batch_size, c.in_channels, h, w});
  auto t = torch::randint(0, 1000, {batch_size}, torch::kInt64);
  // measure_forward_bytes warms up on the same shapes, its graph dropped: thread pools, oneDNN's
  // primitive caches (keyed by shape; the Winograd convolutions only build theirs while
  // recording a graph) and autocast state allocate once and stay, which is not activation memory.
  const auto started = std::chrono::steady_clock::now();
  const int64_t bytes =
      measure_forward_bytes([&] { return training_forward(unet, mp, x, t, cond); });
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - started).count() / 2;
  unet.train(was_training);
  unet.set_gradient_checkpointing(was_checkpointing);
  log::info("activations: one forward at batch {}, {}x{}, mixed precision {}{} keeps {} ({:.1f} s)",
            batch_size, h, w, options.mixed_precision,
            options.gradient_checkpointing ? ", gradient checkpointing" : "", format_bytes(bytes),
            seconds);
  return bytes;
}

std::vector<std::pair<std::string, int64_t>> pipeline_frozen_params(const std::string& model_path) {
  std::vector<std::pair<std::string, int64_t>> out;
  for (const auto& part : pipeline_frozen_parts(model_path, models::WeightStorage::kDense, 4))
    out.emplace_back(part.name, part.params);
  return out;
}

std::vector<FrozenPart> pipeline_frozen_parts(const std::string& model_path,
                                              models::WeightStorage text_storage,
                                              int64_t dense_bytes) {
  std::vector<FrozenPart> out;
  const fs::path root(model_path);
  if (!fs::is_directory(root) || !fs::exists(root / "model_index.json")) return out;
  auto count = [](const torch::nn::Module& m) {
    int64_t n = 0;
    for (const auto& p : m.parameters()) n += p.numel();
    return n;
  };
  // Built from the configs alone (random weights), as the UNet is.
  torch::NoGradGuard no_grad;
  for (const char* te : {"text_encoder", "text_encoder_2"}) {
    const fs::path config = root / te / "config.json";
    if (!fs::is_regular_file(config)) continue;
    auto c = models::read_clip_text_config(config.string());
    if (std::string(te) == "text_encoder_2") c.with_projection = true;
    const models::ClipTextModel model(c);
    out.push_back(
        {te, count(*model), models::stored_model_bytes(*model, text_storage, dense_bytes)});
  }
  const fs::path vae = root / "vae" / "config.json";
  if (fs::is_regular_file(vae)) {
    const models::AutoencoderKL model(models::read_autoencoder_kl_config(vae.string()));
    out.push_back({"vae", count(*model), count(*model) * dense_bytes});
  }
  return out;
}

std::string resolve_unet_config_path(const std::string& model_path) {
  const fs::path p(model_path);
  if (fs::is_directory(p)) {
    const fs::path config =
        fs::exists(p / "model_index.json") ? p / "unet" / "config.json" : p / "config.json";
    if (!fs::is_regular_file(config)) {
      throw Error("'" + model_path + "' has no " + config.lexically_relative(p).string() +
                  "; pass a UNet folder (config.json), a pipeline folder (model_index.json + "
                  "unet/config.json) or a config.json path");
    }
    return config.string();
  }
  if (!fs::is_regular_file(p)) {
    throw Error("'" + model_path +
                "' does not exist; pass a UNet folder (config.json), a pipeline folder "
                "(model_index.json + unet/config.json) or a config.json path");
  }
  return model_path;
}

std::vector<MemoryEstimate> estimate_memory(
    const std::string& model_path, const MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies) {
  check_memory_estimate_options(options);
  const auto config = models::UNetConfig::load(resolve_unet_config_path(model_path));
  models::UNet unet(config);
  models::LoraLayers lora{nullptr};
  torch::nn::Module* trainable = unet.get();
  if (options.lora) {
    // As the trainer's build_parts: the base frozen, adapters with alpha = rank.
    for (auto& p : unet->parameters()) p.set_requires_grad(false);
    models::LoraConfig lc;
    lc.rank = options.lora_rank;
    lc.alpha = static_cast<double>(options.lora_rank);
    if (!options.lora_target_modules.empty()) lc.target_modules = options.lora_target_modules;
    lora = models::LoraLayers(*unet, lc);
    trainable = lora.get();
    // As the trainer: under bf16 the frozen base is held in bf16, the adapters stay fp32; an
    // 8-bit base quantized as the trainer's pass does it.
    if (options.mixed_precision == "bf16") unet->to(torch::kBFloat16);
    models::quantize_frozen_weights(
        *unet, models::parse_weight_storage(options.base_weights_dtype, "--base_weights_dtype"));
  }
  // Plan first: a bad auto-wrap policy fails before the (slow) forward.
  std::vector<MemoryEstimate> out;
  for (const auto s : strategies) {
    MemoryEstimateOptions o = options;
    o.strategy = s;
    out.push_back(estimate_state_memory(*trainable, o, options.lora ? unet.get() : nullptr));
  }
  // A text-to-image pipeline also holds its frozen text encoder(s) and VAE on every rank, in
  // bf16 under bf16 as the trainer keeps them.
  // The text encoders' frozen layers are 8-bit too under --base_weights_dtype (not the VAE's).
  const auto storage = options.lora ? models::parse_weight_storage(options.base_weights_dtype,
                                                                   "--base_weights_dtype")
                                    : models::WeightStorage::kDense;
  const auto frozen =
      pipeline_frozen_parts(model_path, storage, options.mixed_precision == "bf16" ? 2 : 4);
  for (const auto& part : frozen) {
    log::info("frozen {}: {} parameters", part.name, part.params);
    for (auto& e : out) {
      e.frozen_params += part.params;
      e.frozen_param_bytes += part.bytes;
    }
  }
  const int64_t activations = measure_activation_bytes(*unet, options, 1) * options.batch_size;
  for (auto& e : out) e.activation_bytes = activations;
  return out;
}

MemoryEstimate estimate_memory(const std::string& model_path,
                               const MemoryEstimateOptions& options) {
  return estimate_memory(model_path, options, {options.strategy}).at(0);
}

}  // namespace difftrain::families::unet
