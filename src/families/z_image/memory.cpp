// `difftrain estimate-memory` for Z-Image: a 6 B transformer cannot be built to be counted, so
// depth-reduced copies at the real width are: one without blocks (the embedders, the final layer,
// the pad tokens), one with a single main layer, one with a single noise- and context-refiner
// pair. Their parameters, named as the full model's, give every unit FSDP's transformer-based
// wrap makes (one per block); their training forwards give the activations, scaled by the block
// counts. Qwen3 is not counted: the trainer caches every caption's embeddings and releases it.
#include "../denoiser_memory.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/models/transformers/z_image_transformer.h"
#include "z_image_pipeline.h"
#include "z_image_task.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>

namespace difftrain::families::z_image {
namespace fs = std::filesystem;

namespace {

// Z-Image's blocks: the main layers and both refiners.
bool z_in_block(const std::string& name) {
  return name.rfind("layers.", 0) == 0 || name.rfind("noise_refiner.", 0) == 0 ||
         name.rfind("context_refiner.", 0) == 0;
}

std::vector<DenoiserParam> z_params(const torch::nn::Module& m, const std::string& prefix,
                                    const std::function<std::string(const std::string&)>& rename) {
  return denoiser_params(m, prefix, z_in_block, rename, {"pad_token"});
}

}  // namespace

std::vector<train::MemoryEstimate> estimate_z_image_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies) {
  bool pipeline = false;
  const std::string config = denoiser_config_path(
      model_path, "a ZImagePipeline folder, a ZImageTransformer2DModel folder or its config.json",
      &pipeline);
  const fs::path root(model_path);
  const auto o = models::ZImageTransformerOptions::load(config);
  if (options.lora && options.lora_rank < 1) {
    throw Error(fmt::format("LoRA rank must be at least 1, got {}", options.lora_rank));
  }
  const int64_t R = options.resolution > 0 ? options.resolution : 128;  // latents of 1024 px
  const int64_t p = o.all_patch_size.front();
  if (R % p != 0) {
    throw Error(
        fmt::format("resolution {} (latent pixels) must be a multiple of the patch size {}", R, p));
  }
  // Caption tokens: what --max_sequence_length lets through at most (real captions are shorter).
  const int64_t text_tokens =
      options.encoder_sequence_length > 0 ? options.encoder_sequence_length : 512;

  // The reduced copies: no block; one main layer; one refiner of each kind.
  auto reduced = [&](int64_t layers, int64_t refiners) {
    auto r = o;
    r.n_layers = layers;
    r.n_refiner_layers = refiners;
    models::ZImageTransformer2DModel m(r);
    m->train();
    m->set_gradient_checkpointing(options.gradient_checkpointing);
    return m;
  };
  auto measure = [&](models::ZImageTransformer2DModel& m) {
    torch::AutoGradMode grad_on(true);
    const auto x = torch::randn({o.in_channels, 1, R, R});
    const auto cap = torch::randn({text_tokens, o.cap_feat_dim});
    const auto t = torch::full({1}, 0.5);
    return train::measure_forward_bytes([&] { return m->forward({x}, t, {cap}).front(); });
  };
  auto m0 = reduced(0, 0);
  const int64_t a0 = measure(m0);
  DenoiserBlocks blocks;
  const auto same = [](const std::string& s) { return s; };
  std::vector<DenoiserParam> root_params = z_params(*m0, "", same);
  m0 = nullptr;
  int64_t a_layer = 0, a_refiners = 0;
  {
    auto m = reduced(1, 0);
    a_layer = std::max<int64_t>(0, measure(m) - a0);
    for (int64_t i = 0; i < o.n_layers; ++i) {
      const std::string name = fmt::format("layers.{}", i);
      blocks.emplace_back(name, z_params(*m, "layers.0.", [&](const std::string& s) {
                            return name + s.substr(std::string("layers.0").size());
                          }));
    }
  }
  {
    auto m = reduced(0, 1);
    a_refiners = std::max<int64_t>(0, measure(m) - a0);
    for (const char* kind : {"noise_refiner", "context_refiner"}) {
      const std::string first = std::string(kind) + ".0";
      for (int64_t i = 0; i < o.n_refiner_layers; ++i) {
        const std::string name = fmt::format("{}.{}", kind, i);
        blocks.emplace_back(name, z_params(*m, first + ".", [&](const std::string& s) {
                              return name + s.substr(first.size());
                            }));
      }
    }
  }
  blocks.emplace_back("", std::move(root_params));

  const int64_t frozen_size = options.mixed_precision == "bf16" ? 2 : 4;
  const DenoiserState state =
      denoiser_state(blocks, options, default_z_image_lora_targets(),
                     [](const std::string&) { return std::string("ZImageTransformerBlock"); });
  const int64_t base = state.params;
  int64_t frozen = state.frozen;
  int64_t frozen_bytes = state.frozen_bytes;
  const auto& units = state.units;
  const auto& numels = state.numels;
  log::info("ZImageTransformer2DModel {}: {} parameters{}", config, base,
            options.lora ? fmt::format(" (frozen under LoRA rank {})", options.lora_rank) : "");
  if (pipeline) {
    torch::NoGradGuard no_grad;
    log::info(
        "text encoder: not counted (Qwen3 is released once the captions' embeddings are cached)");
    int64_t n = 0;
    for (const auto& t : models::AutoencoderKL(models::read_autoencoder_kl_config(
                                                   (root / "vae" / "config.json").string()))
                             ->parameters()) {
      n += t.numel();
    }
    log::info("frozen vae: {} parameters", n);
    frozen += n;
    frozen_bytes += n * frozen_size;
  }
  std::vector<train::MemoryEstimate> out;
  for (const auto s : strategies) {
    train::MemoryEstimateOptions so = options;
    so.strategy = s;
    out.push_back(
        train::estimate_state_memory_from_counts(units, numels, frozen, frozen_bytes, so));
  }
  add_last_blocks_swap(blocks, "layers.", o.n_layers, options, out);
  const int64_t activations =
      (a0 + o.n_layers * a_layer + o.n_refiner_layers * a_refiners) * options.batch_size;
  log::info(
      "activations: {} per layer, {} per refiner pair at {}x{} latents and {} caption tokens, "
      "batch {}{}",
      train::format_bytes(a_layer), train::format_bytes(a_refiners), R, R, text_tokens,
      options.batch_size, options.gradient_checkpointing ? ", gradient checkpointing" : "");
  for (auto& e : out) e.activation_bytes = activations;
  return out;
}

}  // namespace difftrain::families::z_image
