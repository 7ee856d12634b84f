// `difftrain estimate-memory` for Qwen-Image: a 20 B transformer cannot be built to be counted,
// so two depth-reduced copies at the real width are: one without blocks (img_in, txt_norm +
// txt_in, the timestep embedding, norm_out, proj_out) and one with a single
// QwenImageTransformerBlock. Their parameters, named as the full model's, give every unit FSDP's
// transformer-based wrap makes (one per block); their training forwards give the activations,
// scaled by the block count. The Qwen2.5-VL text encoder (7 B) is not counted: a run caches every
// caption's embeddings and releases it, as train_dreambooth_lora_qwen_image.py does.
#include "../denoiser_memory.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"
#include "difftrain/models/transformers/qwen_image_transformer.h"
#include "qwen_image_pipeline.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::qwen_image {
namespace fs = std::filesystem;

namespace {

std::vector<DenoiserParam> qwen_params(
    const torch::nn::Module& m, const std::string& prefix,
    const std::function<std::string(const std::string&)>& rename) {
  return denoiser_params(
      m, prefix, [](const std::string& name) { return name.rfind("transformer_blocks.", 0) == 0; },
      rename, {"addition_t_embedding"});
}

}  // namespace

const std::vector<std::string>& default_qwen_image_lora_targets() {
  // train_dreambooth_lora_qwen_image.py without --lora_layers.
  static const std::vector<std::string> targets = {"to_k", "to_q", "to_v", "to_out.0"};
  return targets;
}

std::vector<train::MemoryEstimate> estimate_qwen_image_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies) {
  bool pipeline = false;
  const std::string config = denoiser_config_path(
      model_path,
      "a QwenImagePipeline folder, a QwenImageTransformer2DModel folder or its config.json",
      &pipeline);
  const fs::path root(model_path);
  const auto o = models::QwenImageTransformerOptions::load(config);
  if (options.lora && options.lora_rank < 1) {
    throw Error(fmt::format("LoRA rank must be at least 1, got {}", options.lora_rank));
  }
  // Latent pixels (1024 px / 8 = 128 by default), in 2x2 patches.
  const int64_t R = options.resolution > 0 ? options.resolution : 128;
  if (R % o.patch_size != 0) {
    throw Error(fmt::format("resolution {} (latent pixels) must be a multiple of the patch size {}",
                            R, o.patch_size));
  }
  const int64_t g = R / o.patch_size;
  // Text tokens: what --max_sequence_length lets through at most (real captions are shorter).
  const int64_t text_tokens =
      options.encoder_sequence_length > 0 ? options.encoder_sequence_length : 512;

  auto reduced = [&](int64_t layers) {
    auto r = o;
    r.num_layers = layers;
    models::QwenImageTransformer2DModel m(r);
    m->train();
    m->set_gradient_checkpointing(options.gradient_checkpointing);
    return m;
  };
  auto measure = [&](models::QwenImageTransformer2DModel& m) {
    torch::AutoGradMode grad_on(true);
    const auto x = torch::randn({1, g * g, o.in_channels});
    const auto text = torch::randn({1, text_tokens, o.joint_attention_dim});
    const auto t = torch::full({1}, 0.5);
    const torch::Tensor cond =
        o.use_additional_t_cond ? torch::zeros({1}, torch::kInt64) : torch::Tensor();
    return train::measure_forward_bytes([&] {
      return m->forward(x, text, {}, t, {{{1, g, g}}}, cond);
    });
  };
  auto m0 = reduced(0);
  const int64_t a0 = measure(m0);
  DenoiserBlocks blocks;
  const auto same = [](const std::string& s) { return s; };
  std::vector<DenoiserParam> root_params = qwen_params(*m0, "", same);
  m0 = nullptr;
  int64_t a_block = 0;
  {
    auto m = reduced(1);
    a_block = std::max<int64_t>(0, measure(m) - a0);
    for (int64_t i = 0; i < o.num_layers; ++i) {
      const std::string name = fmt::format("transformer_blocks.{}", i);
      blocks.emplace_back(name, qwen_params(*m, "transformer_blocks.0.", [&](const std::string& s) {
                            return name + s.substr(std::string("transformer_blocks.0").size());
                          }));
    }
  }
  blocks.emplace_back("", std::move(root_params));

  const int64_t frozen_size = options.mixed_precision == "bf16" ? 2 : 4;
  const DenoiserState state =
      denoiser_state(blocks, options, default_qwen_image_lora_targets(),
                     [](const std::string&) { return std::string("QwenImageTransformerBlock"); });
  int64_t frozen = state.frozen;
  int64_t frozen_bytes = state.frozen_bytes;
  log::info("QwenImageTransformer2DModel {}: {} parameters{}", config, state.params,
            options.lora ? fmt::format(" (frozen under LoRA rank {})", options.lora_rank) : "");
  if (pipeline) {
    log::info(
        "text encoder: not counted (Qwen2.5-VL is released once the captions' embeddings "
        "are cached)");
    torch::NoGradGuard no_grad;
    int64_t n = 0;
    const models::AutoencoderKLQwenImage vae(
        models::AutoencoderKLQwenImageConfig::load((root / "vae" / "config.json").string()));
    for (const auto& t : vae->parameters()) n += t.numel();
    log::info("frozen vae: {} parameters", n);
    frozen += n;
    frozen_bytes += n * frozen_size;
  }
  std::vector<train::MemoryEstimate> out;
  for (const auto s : strategies) {
    train::MemoryEstimateOptions so = options;
    so.strategy = s;
    out.push_back(train::estimate_state_memory_from_counts(state.units, state.numels, frozen,
                                                           frozen_bytes, so));
  }
  add_last_blocks_swap(blocks, "transformer_blocks.", o.num_layers, options, out);
  const int64_t activations = (a0 + o.num_layers * a_block) * options.batch_size;
  log::info(
      "activations: {} per block at {}x{} latents ({} image tokens) and {} text tokens, "
      "batch {}{}",
      train::format_bytes(a_block), R, R, g * g, text_tokens, options.batch_size,
      options.gradient_checkpointing ? ", gradient checkpointing" : "");
  for (auto& e : out) e.activation_bytes = activations;
  return out;
}

}  // namespace difftrain::families::qwen_image
