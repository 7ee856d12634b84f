// `difftrain estimate-memory` for FLUX.1: a 12 B transformer cannot be built to be counted, so its
// parameters are listed from config.json (every tensor's size, grouped into the units FSDP's
// transformer-based wrap makes of the blocks), T5 likewise, CLIP and the VAE are built (small);
// activations are measured on depth-reduced copies at the real width (no block, one double
// block, one single block) and scaled by the block counts.
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/models/text_encoders/clip_text_model.h"
#include "difftrain/models/text_encoders/t5_encoder.h"
#include "difftrain/models/transformers/flux_packing.h"
#include "difftrain/models/transformers/flux_transformer.h"
#include "flux_family.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>
#include <map>

namespace difftrain::families::flux {
namespace fs = std::filesystem;

namespace {

void flux_linear(std::vector<FluxParam>& out, const std::string& name, int64_t in, int64_t outf,
                 bool bias = true) {
  out.push_back({name + ".weight", in * outf, in, outf});
  if (bias) out.push_back({name + ".bias", outf, 0, 0});
}

}  // namespace

std::vector<std::pair<std::string, std::vector<FluxParam>>> flux_transformer_parameters(
    const models::FluxTransformer2DModelOptions& o) {
  const int64_t D = o.inner_dim(), hd = o.attention_head_dim();
  std::vector<std::pair<std::string, std::vector<FluxParam>>> units;
  for (int64_t i = 0; i < o.num_layers(); ++i) {
    const std::string b = fmt::format("transformer_blocks.{}", i);
    std::vector<FluxParam> p;
    flux_linear(p, b + ".norm1.linear", D, 6 * D);
    flux_linear(p, b + ".norm1_context.linear", D, 6 * D);
    for (const char* n : {"to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj",
                          "to_out.0", "to_add_out"}) {
      flux_linear(p, b + ".attn." + n, D, D);
    }
    for (const char* n : {"norm_q", "norm_k", "norm_added_q", "norm_added_k"}) {
      p.push_back({b + ".attn." + n + ".weight", hd, 0, 0});
    }
    for (const char* ff : {"ff", "ff_context"}) {
      flux_linear(p, b + "." + ff + ".net.0.proj", D, 4 * D);
      flux_linear(p, b + "." + ff + ".net.2", 4 * D, D);
    }
    units.emplace_back(b, std::move(p));
  }
  for (int64_t i = 0; i < o.num_single_layers(); ++i) {
    const std::string b = fmt::format("single_transformer_blocks.{}", i);
    std::vector<FluxParam> p;
    flux_linear(p, b + ".norm.linear", D, 3 * D);
    flux_linear(p, b + ".proj_mlp", D, 4 * D);
    for (const char* n : {"to_q", "to_k", "to_v"}) flux_linear(p, b + ".attn." + n, D, D);
    p.push_back({b + ".attn.norm_q.weight", hd, 0, 0});
    p.push_back({b + ".attn.norm_k.weight", hd, 0, 0});
    flux_linear(p, b + ".proj_out", 5 * D, D);
    units.emplace_back(b, std::move(p));
  }
  std::vector<FluxParam> root;
  const std::string t = "time_text_embed.";
  flux_linear(root, t + "timestep_embedder.linear_1", 256, D);
  flux_linear(root, t + "timestep_embedder.linear_2", D, D);
  if (o.guidance_embeds()) {
    flux_linear(root, t + "guidance_embedder.linear_1", 256, D);
    flux_linear(root, t + "guidance_embedder.linear_2", D, D);
  }
  flux_linear(root, t + "text_embedder.linear_1", o.pooled_projection_dim(), D);
  flux_linear(root, t + "text_embedder.linear_2", D, D);
  flux_linear(root, "context_embedder", o.joint_attention_dim(), D);
  flux_linear(root, "x_embedder", o.in_channels(), D);
  flux_linear(root, "norm_out.linear", D, 2 * D);
  flux_linear(root, "proj_out", D, o.patch_size() * o.patch_size() * o.output_channels());
  units.emplace_back("", std::move(root));
  return units;
}

int64_t t5_encoder_parameter_count(const models::T5EncoderOptions& o) {
  const int64_t d = o.d_model(), inner = o.num_heads() * o.d_kv();
  const int64_t ff = (o.gated() ? 3 : 2) * d * o.d_ff();
  return o.vocab_size() * d + o.num_layers() * (4 * d * inner + 2 * d + ff) +
         o.relative_attention_num_buckets() * o.num_heads() + d;
}

int64_t t5_encoder_stored_bytes(const models::T5EncoderOptions& o, models::WeightStorage storage,
                                int64_t dense_bytes) {
  const int64_t d = o.d_model(), inner = o.num_heads() * o.d_kv(), ff = o.d_ff();
  // Per layer: q, k, v [inner, d], o [d, inner], wi (or wi_0 and wi_1) [ff, d], wo [d, ff].
  const int64_t linears =
      3 * models::stored_weight_bytes(inner * d, inner, storage, dense_bytes) +
      models::stored_weight_bytes(d * inner, d, storage, dense_bytes) +
      (o.gated() ? 2 : 1) * models::stored_weight_bytes(ff * d, ff, storage, dense_bytes) +
      models::stored_weight_bytes(d * ff, d, storage, dense_bytes);
  const int64_t rest = o.vocab_size() * d + o.num_layers() * 2 * d +
                       o.relative_attention_num_buckets() * o.num_heads() + d;
  return o.num_layers() * linears + rest * dense_bytes;
}

std::vector<train::MemoryEstimate> estimate_flux_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies) {
  bool pipeline = false;
  const std::string config = denoiser_config_path(
      model_path, "a FluxPipeline folder, a FluxTransformer2DModel folder or its config.json",
      &pipeline);
  const fs::path root(model_path);
  const auto o = models::FluxTransformer2DModelOptions::load(config);
  if (options.lora && options.lora_rank < 1) {
    throw Error(fmt::format("LoRA rank must be at least 1, got {}", options.lora_rank));
  }
  const auto blocks = flux_transformer_parameters(o);
  const int64_t frozen_size = options.mixed_precision == "bf16" ? 2 : 4;
  // Trainable: the whole transformer, or LoRA adapters on the targets, by default Diffusers'
  // FLUX script's (default_flux_lora_targets), matched by suffix.
  const auto storage = options.lora ? models::parse_weight_storage(options.base_weights_dtype,
                                                                   "--base_weights_dtype")
                                    : models::WeightStorage::kDense;
  DenoiserState state =
      denoiser_state(blocks, options, default_flux_lora_targets(), [](const std::string& name) {
        return name.rfind("single_", 0) == 0 ? "FluxSingleTransformerBlock"
                                             : "FluxTransformerBlock";
      });
  const int64_t base = state.params;
  int64_t frozen = state.frozen;
  int64_t frozen_bytes = state.frozen_bytes;
  auto& units = state.units;
  auto& numels = state.numels;
  log::info("FluxTransformer2DModel {}: {} parameters{}", config, base,
            options.lora ? fmt::format(" (frozen under LoRA rank {})", options.lora_rank) : "");
  if (pipeline) {
    // The frozen parts every rank holds, in bf16 under bf16 as the trainer keeps them.
    torch::NoGradGuard no_grad;
    // The text encoders only while they encode batches (--train_text_encoder); otherwise the
    // trainer caches every caption's embeddings and releases them before training.
    struct Part {
      std::string name;
      int64_t params, bytes;
    };
    std::vector<Part> parts;
    if (options.train_text_encoder) {
      const auto te =
          models::read_clip_text_config((root / "text_encoder" / "config.json").string());
      const models::ClipTextModel clip(te);
      int64_t n = 0;
      for (const auto& p : clip->parameters()) n += p.numel();
      parts.push_back({"text_encoder", n, models::stored_model_bytes(*clip, storage, frozen_size)});
      const auto t5 =
          models::T5EncoderOptions::load((root / "text_encoder_2" / "config.json").string());
      parts.push_back({"text_encoder_2", t5_encoder_parameter_count(t5),
                       t5_encoder_stored_bytes(t5, storage, frozen_size)});
    } else {
      log::info(
          "text encoders: not counted (released once the captions' embeddings are cached; "
          "--train_text_encoder keeps them)");
    }
    int64_t n = 0;
    for (const auto& p : models::AutoencoderKL(models::read_autoencoder_kl_config(
                                                   (root / "vae" / "config.json").string()))
                             ->parameters()) {
      n += p.numel();
    }
    parts.push_back({"vae", n, n * frozen_size});
    for (const auto& part : parts) {
      log::info("frozen {}: {} parameters", part.name, part.params);
      frozen += part.params;
      frozen_bytes += part.bytes;
    }
  }
  std::vector<train::MemoryEstimate> out;
  for (const auto s : strategies) {
    train::MemoryEstimateOptions so = options;
    so.strategy = s;
    out.push_back(
        train::estimate_state_memory_from_counts(units, numels, frozen, frozen_bytes, so));
  }

  if (options.blocks_to_swap > 0) {
    // kohya's split, the last blocks of each kind (models/transformers/flux_transformer.h).
    const auto which =
        models::flux_swapped_blocks(options.blocks_to_swap, o.num_layers(), o.num_single_layers());
    std::vector<std::string> swapped;
    for (int64_t i = 0; i < o.num_layers() + o.num_single_layers(); ++i) {
      if (!which[static_cast<size_t>(i)]) continue;
      swapped.push_back(i < o.num_layers()
                            ? "transformer_blocks." + std::to_string(i)
                            : "single_transformer_blocks." + std::to_string(i - o.num_layers()));
    }
    add_block_swap(blocks, swapped, options, out);
  }

  // Activations: one training forward of depth-reduced copies at the real width (batch 1, R x R
  // latents packed 2x2, encoder_sequence_length T5 tokens), a = a0 + L (a10 - a0) + S (a01 - a0).
  const int64_t R = options.resolution > 0 ? options.resolution : 128;
  if (R % 2 != 0) throw Error(fmt::format("resolution {} must be even (FLUX packs 2x2)", R));
  // `difftrain train`'s --max_sequence_length default, as Diffusers' FLUX scripts.
  const int64_t text_tokens =
      options.encoder_sequence_length > 0 ? options.encoder_sequence_length : 512;
  auto measure = [&](int64_t doubles, int64_t singles) {
    auto reduced = o;
    reduced.num_layers(doubles);
    reduced.num_single_layers(singles);
    models::FluxTransformer2DModel m(reduced);
    m->train();
    m->set_gradient_checkpointing(options.gradient_checkpointing);
    torch::AutoGradMode grad_on(true);
    const int64_t S = text_tokens;
    const auto x = torch::randn({1, (R / 2) * (R / 2), o.in_channels()});
    const auto c = torch::randn({1, S, o.joint_attention_dim()});
    const auto p = torch::randn({1, o.pooled_projection_dim()});
    const auto t = torch::full({1}, 0.5);
    const auto g = o.guidance_embeds() ? torch::full({1}, 3.5) : torch::Tensor();
    const auto img_ids = models::latent_image_ids(R / 2, R / 2);
    const auto txt_ids = torch::zeros({S, 3});
    return train::measure_forward_bytes(
        [&] { return m->forward(x, c, p, t, g, img_ids, txt_ids); });
  };
  const int64_t a0 = measure(0, 0);
  const int64_t a_double = std::max<int64_t>(0, measure(1, 0) - a0);
  const int64_t a_single = std::max<int64_t>(0, measure(0, 1) - a0);
  const int64_t activations =
      (a0 + o.num_layers() * a_double + o.num_single_layers() * a_single) * options.batch_size;
  log::info(
      "activations: {} per double block, {} per single block at {}x{} latents and {} text "
      "tokens, batch {}{}",
      train::format_bytes(a_double), train::format_bytes(a_single), R, R, text_tokens,
      options.batch_size, options.gradient_checkpointing ? ", gradient checkpointing" : "");
  for (auto& e : out) e.activation_bytes = activations;
  return out;
}

}  // namespace difftrain::families::flux
