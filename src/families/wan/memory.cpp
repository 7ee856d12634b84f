// `difftrain estimate-memory` for Wan: a 14 B transformer cannot be built to be counted, so two
// depth-reduced copies at the real width are: one without blocks (the patch embedding, the
// condition embedder, norm_out, proj_out) and one with a single WanTransformerBlock. Their
// parameters, named as the full model's, give every unit FSDP's transformer-based wrap makes (one
// per block). Activations: a training forward of each copy at two small token counts (2 and 4
// latent frames of 16 x 16 latents, in 2 x 2 patches) with the run's text length. Attention is
// counted as a fused kernel keeps it (q, k, v, the output and the log-sum-exp: CUDA's
// scaled_dot_product_attention, difftrain's CPU kernel for heads up to 64 wide): the softmax
// outputs difftrain's CPU path saves for Wan's 128-wide heads (heads x N x S floats per attention)
// are subtracted from each measurement. What is left grows linearly with the tokens, so the two
// measurements give a line, evaluated at the clip's tokens (81 x 480 x 832: 21 x 30 x 52 =
// 32,760) and scaled by the block count. UMT5 (5.7 B for Wan) is not counted: a run caches every
// caption's embeddings and releases it; the VAE is counted as frozen.
#include "../denoiser_memory.h"
#include "difftrain/accel/precision.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/models/autoencoders/autoencoder_kl_qwen_image.h"
#include "difftrain/models/transformers/wan_transformer.h"
#include "wan_task.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>

namespace difftrain::families::wan {
namespace fs = std::filesystem;

std::vector<train::MemoryEstimate> estimate_wan_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies) {
  bool pipeline = false;
  const std::string config = denoiser_config_path(
      model_path, "a WanPipeline folder, a WanTransformer3DModel folder or its config.json",
      &pipeline);
  const auto o = models::WanTransformerOptions::load(config);
  if (options.lora && options.lora_rank < 1) {
    throw Error(fmt::format("LoRA rank must be at least 1, got {}", options.lora_rank));
  }
  if (options.resolution > 0) {
    throw Error("--resolution: Wan's clip size is --num_frames, --height and --width (pixels)");
  }
  const int64_t F = options.num_frames > 0 ? options.num_frames : 81;
  const int64_t H = options.height > 0 ? options.height : 480;
  const int64_t W = options.width > 0 ? options.width : 832;
  const int64_t ph = o.patch_size[1], pw = o.patch_size[2];
  if ((F - 1) % 4 != 0 || H % (8 * ph) != 0 || W % (8 * pw) != 0) {
    throw Error(
        fmt::format("--num_frames {} / --height {} / --width {}: Wan takes 1 + 4k frames "
                    "and sides divisible by {}",
                    F, H, W, 8 * ph));
  }
  const int64_t tokens = ((F - 1) / 4 + 1) * (H / 8 / ph) * (W / 8 / pw);
  const int64_t text_tokens =
      options.encoder_sequence_length > 0 ? options.encoder_sequence_length : 512;
  const bool bf16 = options.mixed_precision == "bf16";
  if (bf16) accel::install_autocast_fixes();

  auto reduced = [&](int64_t layers) {
    auto r = o;
    r.num_layers = layers;
    models::WanTransformer3DModel m(r);
    m->train();
    m->set_gradient_checkpointing(options.gradient_checkpointing);
    // LoRA runs hold the frozen base in bf16 under bf16; full fine-tunes autocast fp32 weights.
    if (bf16 && options.lora) m->to_dtype(torch::kBFloat16);
    return m;
  };
  // One training forward at `frames` latent frames of 16 x 16 latents: its saved bytes.
  auto measure = [&](models::WanTransformer3DModel& m, int64_t frames) {
    torch::AutoGradMode grad_on(true);
    const auto dtype = m->dtype();
    const auto x = torch::randn({1, o.in_channels, frames, 16, 16}).to(dtype);
    const auto text = torch::randn({1, text_tokens, o.text_dim}).to(dtype);
    const auto t = torch::full({1}, 500.0).to(dtype);
    torch::Tensor image;
    if (o.added_kv_proj_dim) image = torch::randn({1, 257, *o.image_dim}).to(dtype);
    const auto mp = bf16 ? accel::MixedPrecision::kBf16 : accel::MixedPrecision::kNo;
    return train::measure_forward_bytes([&] {
      accel::AutocastGuard autocast(mp, torch::kCPU);
      return m->forward(x, t, text, image);
    });
  };
  const int64_t n1 = 2 * (16 / ph) * (16 / pw), n2 = 2 * n1;
  // The line through (n1, a1) and (n2, a2), at `tokens`.
  auto extrapolate = [&](int64_t a1, int64_t a2) {
    const double slope = static_cast<double>(a2 - a1) / static_cast<double>(n2 - n1);
    return std::max<int64_t>(0, static_cast<int64_t>(static_cast<double>(a1) +
                                                     slope * static_cast<double>(tokens - n1)));
  };
  auto m0 = reduced(0);
  const int64_t r1 = measure(m0, 2), r2 = measure(m0, 4);
  const int64_t root_bytes = extrapolate(r1, r2);
  DenoiserBlocks blocks;
  const auto same = [](const std::string& s) { return s; };
  auto in_block = [](const std::string& name) { return name.rfind("blocks.", 0) == 0; };
  std::vector<DenoiserParam> root_params = denoiser_params(*m0, "", in_block, same);
  m0 = nullptr;
  int64_t block_bytes = 0;
  {
    auto m = reduced(1);
    const int64_t b1 = std::max<int64_t>(0, measure(m, 2) - r1);
    const int64_t b2 = std::max<int64_t>(0, measure(m, 4) - r2);
    // The saved softmax outputs of the unfused path (none under checkpointing: the block's
    // forward keeps only its input), per block at n tokens: self-attention n x n, the caption
    // n x S (and the image context's 257 for 2.1 I2V), float32.
    const bool unfused = o.attention_head_dim > 64 && !options.gradient_checkpointing;
    auto probs = [&](int64_t n) -> int64_t {
      if (!unfused) return 0;
      const int64_t context = text_tokens + (o.added_kv_proj_dim ? 257 : 0);
      return o.num_attention_heads * 4 * n * (n + context);
    };
    block_bytes =
        extrapolate(std::max<int64_t>(0, b1 - probs(n1)), std::max<int64_t>(0, b2 - probs(n2)));
    for (int64_t i = 0; i < o.num_layers; ++i) {
      const std::string name = fmt::format("blocks.{}", i);
      blocks.emplace_back(name,
                          denoiser_params(*m, "blocks.0.", in_block, [&](const std::string& s) {
                            return name + s.substr(std::string("blocks.0").size());
                          }));
    }
  }
  blocks.emplace_back("", std::move(root_params));
  // Diffusers' _keep_in_fp32_modules stay float32 in a bf16 base (WanTransformer3DModel::to_dtype).
  for (auto& unit : blocks) {
    for (auto& p : unit.second) p.fp32 = models::wan_keeps_in_fp32(p.name);
  }

  const int64_t frozen_size = bf16 ? 2 : 4;
  const DenoiserState state =
      denoiser_state(blocks, options, default_wan_lora_targets(o.added_kv_proj_dim.has_value()),
                     [](const std::string&) { return std::string("WanTransformerBlock"); });
  int64_t frozen = state.frozen;
  int64_t frozen_bytes = state.frozen_bytes;
  log::info("WanTransformer3DModel {}: {} parameters{}", config, state.params,
            options.lora ? fmt::format(" (frozen under LoRA rank {})", options.lora_rank) : "");
  if (pipeline) {
    log::info(
        "text encoder: not counted (UMT5 is released once the captions' embeddings are "
        "cached)");
    const fs::path vae_config = fs::path(model_path) / "vae" / "config.json";
    std::error_code ec;
    if (fs::exists(vae_config, ec)) {
      torch::NoGradGuard no_grad;
      int64_t n = 0;
      const models::AutoencoderKLQwenImage vae(
          models::AutoencoderKLQwenImageConfig::load(vae_config.string()));
      for (const auto& t : vae->parameters()) n += t.numel();
      log::info("frozen vae: {} parameters", n);
      frozen += n;
      frozen_bytes += n * frozen_size;
    }
  }
  std::vector<train::MemoryEstimate> out;
  for (const auto s : strategies) {
    train::MemoryEstimateOptions so = options;
    so.strategy = s;
    out.push_back(train::estimate_state_memory_from_counts(state.units, state.numels, frozen,
                                                           frozen_bytes, so));
  }
  add_last_blocks_swap(blocks, "blocks.", o.num_layers, options, out);
  const int64_t activations = (root_bytes + o.num_layers * block_bytes) * options.batch_size;
  log::info(
      "activations: {} per block for {} x {} x {} clips ({} tokens) and {} text tokens, "
      "batch {}{} (measured at {} and {} tokens, linear in the tokens; attention as a fused "
      "kernel keeps it)",
      train::format_bytes(block_bytes), F, H, W, tokens, text_tokens, options.batch_size,
      options.gradient_checkpointing ? ", gradient checkpointing" : "", n1, n2);
  for (auto& e : out) e.activation_bytes = activations;
  return out;
}

}  // namespace difftrain::families::wan
