#pragma once
// Diffusers' `FluxTransformer2DModel` (v0.31, FLUX.1-dev and FLUX.1-schnell): the MMDiT that
// predicts the flow-matching velocity of packed latents, built from config.json, with Diffusers'
// state-dict keys, so `diffusion_pytorch_model.safetensors` loads by name.

#include "difftrain/core/forward_hooks.h"
#include "difftrain/core/no_split_modules.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/block_swap.h"
#include "difftrain/models/layers.h"
#include "difftrain/models/linear.h"
#include "difftrain/models/transformers/flux_blocks.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::models {

/// The fields of a FluxTransformer2DModel config.json (Diffusers' `__init__` arguments).
struct FluxTransformer2DModelOptions {
  /// Side of the square patches of the packed latents (1 for FLUX.1); proj_out has
  /// patch_size²·out_channels outputs.
  TORCH_ARG(int64_t, patch_size) = 1;
  /// Channels of one packed token (16 latent channels × 2×2 = 64 for FLUX.1).
  TORCH_ARG(int64_t, in_channels) = 64;
  /// Output channels; unset (config null or absent) = in_channels.
  TORCH_ARG(std::optional<int64_t>, out_channels) = std::nullopt;
  /// Double-stream blocks (transformer_blocks; 19 in FLUX.1).
  TORCH_ARG(int64_t, num_layers) = 19;
  /// Single-stream blocks (single_transformer_blocks; 38 in FLUX.1).
  TORCH_ARG(int64_t, num_single_layers) = 38;
  TORCH_ARG(int64_t, attention_head_dim) = 128;
  TORCH_ARG(int64_t, num_attention_heads) = 24;
  /// Width of encoder_hidden_states (T5's d_model; 4096 in FLUX.1).
  TORCH_ARG(int64_t, joint_attention_dim) = 4096;
  /// Width of pooled_projections (CLIP's pooled output; 768 in FLUX.1).
  TORCH_ARG(int64_t, pooled_projection_dim) = 768;
  /// true: FLUX.1-dev (a guidance_embedder, forward needs guidance); false: FLUX.1-schnell.
  TORCH_ARG(bool, guidance_embeds) = false;
  /// RoPE dims per id axis; each even, summing to attention_head_dim.
  TORCH_ARG(std::vector<int64_t>, axes_dims_rope) = std::vector<int64_t>{16, 56, 56};

 public:
  /// num_attention_heads · attention_head_dim, the model width D.
  int64_t inner_dim() const { return num_attention_heads() * attention_head_dim(); }
  /// out_channels, or in_channels when unset.
  int64_t output_channels() const { return out_channels().value_or(in_channels()); }
  /// Throws difftrain::Error naming `source` and the field for a non-positive size, odd RoPE
  /// dims, or sum(axes_dims_rope) ≠ attention_head_dim.
  void validate(const std::string& source) const;

  /// Reads `path` (a Diffusers config.json). Every size field must be present (save_pretrained
  /// writes them all); patch_size (1), out_channels (null) and guidance_embeds (false) take
  /// Diffusers' defaults when absent. Errors name the file and the field; validate() runs.
  static FluxTransformer2DModelOptions load(const std::string& path);
  /// load() of config.json text already in memory; `source` names it in errors.
  static FluxTransformer2DModelOptions parse(const std::string& json_text,
                                             const std::string& source);
  /// The config.json Diffusers writes (with _class_name and _diffusers_version).
  nlohmann::json to_json() const;
};

/// kohya's split of `--blocks_to_swap n` over FLUX.1's blocks: n / 2 double-stream blocks and
/// twice the rest single-stream ones (a single block is about half a double one), the last
/// ones of each kind.
struct FluxBlockSwapSplit {
  int64_t double_blocks = 0, single_blocks = 0;
  bool fits = false;  ///< within the counts, at least one block left on the device
};
FluxBlockSwapSplit flux_block_swap_split(int64_t n, int64_t num_layers, int64_t num_single_layers);
/// The largest n that fits (37 for FLUX.1's 19 + 38 blocks).
int64_t flux_max_blocks_to_swap(int64_t num_layers, int64_t num_single_layers);
/// Which blocks n swaps, double blocks first, in forward order; throws difftrain::Error naming
/// n, the counts and the largest n that fits when it does not fit.
std::vector<bool> flux_swapped_blocks(int64_t n, int64_t num_layers, int64_t num_single_layers);

/// What a forward computed on its way, for tests and debugging (the fixture's `A.inter.*`).
struct FluxTransformerIntermediates {
  torch::Tensor temb;                     ///< [B, D]
  torch::Tensor rope_cos, rope_sin;       ///< [S + L, head_dim]
  std::vector<torch::Tensor> double_img;  ///< per double block: [B, L, D]
  std::vector<torch::Tensor> double_txt;  ///< per double block: [B, S, D]
  std::vector<torch::Tensor> single;      ///< per single block: [B, S + L, D]
  torch::Tensor norm_out;                 ///< [B, L, D], before proj_out
};

/// Diffusers' `FluxTransformer2DModel`: time_text_embed (timestep_embedder, guidance_embedder
/// when guidance_embeds, text_embedder), context_embedder, x_embedder, transformer_blocks.{i},
/// single_transformer_blocks.{i}, norm_out.linear, proj_out.
class FluxTransformer2DModelImpl : public torch::nn::Module,
                                   public core::HookableModule,
                                   public core::NoSplitModules {
 public:
  explicit FluxTransformer2DModelImpl(const FluxTransformer2DModelOptions& options);

  /// hidden_states: [B, L, in_channels] packed latents; encoder_hidden_states: [B, S,
  /// joint_attention_dim]; pooled_projections: [B, pooled_projection_dim]; timestep: [B]
  /// (scheduler timestep / 1000; the model multiplies by 1000); guidance: [B] (raw scale, e.g.
  /// 3.5) when guidance_embeds, undefined otherwise (Diffusers raises a TypeError either way it
  /// is mismatched; here a difftrain::Error); img_ids: [L, n_axes], txt_ids: [S, n_axes] (a 3-D
  /// [B, ·, n_axes] is accepted and its [0] taken, as v0.31 does).
  /// -> [B, L, patch_size²·out_channels]. `intermediates`, when given, receives the inner values.
  torch::Tensor forward(const torch::Tensor& hidden_states,
                        const torch::Tensor& encoder_hidden_states,
                        const torch::Tensor& pooled_projections, const torch::Tensor& timestep,
                        const torch::Tensor& guidance, const torch::Tensor& img_ids,
                        const torch::Tensor& txt_ids,
                        FluxTransformerIntermediates* intermediates = nullptr);

  std::string hook_class_name() const override { return "FluxTransformer2DModel"; }
  /// Diffusers' `_no_split_modules`.
  std::vector<std::string> no_split_modules() const override {
    return {"FluxTransformerBlock", "FluxSingleTransformerBlock"};
  }
  const FluxTransformer2DModelOptions& options() const { return options_; }

  /// Diffusers' enable_gradient_checkpointing() / disable_gradient_checkpointing(): in training
  /// mode with grad enabled, each block is recomputed in backward instead of keeping its
  /// activations (models/checkpointing.h).
  void set_gradient_checkpointing(bool on) { gradient_checkpointing_ = on; }
  bool gradient_checkpointing() const { return gradient_checkpointing_; }

  /// kohya's `--blocks_to_swap n` (models/block_swap.h): the frozen weights of n blocks in
  /// host memory, split as kohya splits FLUX.1's (flux_swapped_blocks); 0 turns it off (the
  /// weights back on the device). Call once the model is on its device, its adapters attached
  /// and its base stored as it trains. Throws difftrain::Error for too many blocks, or for a
  /// swapped block whose parameters train.
  void enable_block_swap(int64_t n);
  /// The swap, or nullptr.
  const BlockSwap* block_swap() const { return block_swap_.get(); }

 private:
  torch::Tensor forward_impl(const torch::Tensor& hidden_states,
                             const torch::Tensor& encoder_hidden_states,
                             const torch::Tensor& pooled_projections, const torch::Tensor& timestep,
                             const torch::Tensor& guidance, const torch::Tensor& img_ids,
                             const torch::Tensor& txt_ids,
                             FluxTransformerIntermediates* intermediates);
  // CombinedTimestep(Guidance)TextProjEmbeddings: [B] timestep·1000, guidance·1000 or
  // undefined, pooled [B, P] -> temb [B, D].
  torch::Tensor time_text_embed(const torch::Tensor& timestep, const torch::Tensor& guidance,
                                const torch::Tensor& pooled);

  FluxTransformer2DModelOptions options_;
  bool gradient_checkpointing_ = false;
  std::shared_ptr<BlockSwap> block_swap_;
  TimestepEmbedding timestep_embedder_{nullptr}, guidance_embedder_{nullptr};
  TimestepEmbedding text_embedder_{nullptr};
  Linear context_embedder_{nullptr}, x_embedder_{nullptr};
  std::vector<FluxTransformerBlock> transformer_blocks_;
  std::vector<FluxSingleTransformerBlock> single_transformer_blocks_;
  AdaLayerNormZero norm_out_{nullptr};
  Linear proj_out_{nullptr};
};
TORCH_MODULE(FluxTransformer2DModel);

/// The weights of a FluxTransformer2DModel folder: `dir`/diffusion_pytorch_model.safetensors (or
/// .<variant>.safetensors), or the shards diffusion_pytorch_model.safetensors.index.json names
/// (io/weight_index.h), floating-point tensors converted to `dtype` file by file.
io::TensorMap load_flux_weights(const std::string& dir, torch::Dtype dtype = torch::kFloat32,
                                const std::string& variant = "");

/// Builds the model from `dir`/config.json and loads its weights strictly by name
/// (models::load_weights), on the CPU in `dtype`. Diffusers:
/// `FluxTransformer2DModel.from_pretrained(dir, torch_dtype=dtype, variant=variant)`.
FluxTransformer2DModel load_flux_transformer(const std::string& dir,
                                             torch::Dtype dtype = torch::kFloat32,
                                             const std::string& variant = "");

/// Writes `dir`/config.json and `dir`/diffusion_pytorch_model[.<variant>].safetensors (in the
/// model's dtype), each atomically, so Diffusers' from_pretrained(dir) loads it. Creates `dir`.
void save_flux_transformer(FluxTransformer2DModelImpl& model, const std::string& dir,
                           const std::string& variant = "");

}  // namespace difftrain::models
