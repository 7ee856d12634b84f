#pragma once
// Diffusers' UNet2DModel and UNet2DConditionModel as one LibTorch module built from a
// config.json (UNetConfig::kind picks the class). Parameter names are Diffusers' state-dict keys,
// so a `diffusion_pytorch_model.safetensors` loads by name with no conversion.

#include "difftrain/core/forward_hooks.h"
#include "difftrain/core/no_split_modules.h"
#include "difftrain/models/unets/unet_blocks.h"
#include "difftrain/models/unets/unet_config.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>

#include <string>
#include <vector>

namespace difftrain::models {

/// Optional inputs of a UNet forward.
struct UNetConditioning {
  /// [B] int64 class ids (num_class_embeds), or the input of class_embed_type
  /// "timestep"/"identity"/"projection" ([B] or [B, D]).
  torch::Tensor class_labels;
  /// [B, S, cross_attention_dim]: text embeddings for UNet2DConditionModel.
  torch::Tensor encoder_hidden_states;
  /// [B, time_cond_proj_dim] when the config sets time_cond_proj_dim.
  torch::Tensor timestep_cond;
  /// addition_embed_type "text_time" (SDXL's added_cond_kwargs): the pooled text embedding
  /// [B, D] and the micro-conditioning time ids [B, K] (original size, crop top-left, target
  /// size: K = 6); D + K * addition_time_embed_dim = projection_class_embeddings_input_dim.
  torch::Tensor text_embeds;
  torch::Tensor time_ids;
};

/// A Diffusers UNet. Diffusers: `UNet2DModel` (kind kUNet2D) / `UNet2DConditionModel`
/// (kUNet2DCondition) with `.sample` of the output.
class UNetImpl : public torch::nn::Module,
                 public core::HookableModule,
                 public core::NoSplitModules {
 public:
  explicit UNetImpl(const UNetConfig& config);

  /// The blocks a sharded run wraps by default: ResnetBlock2D, Transformer2DModel and the
  /// Attention layers of UNet2DModel's attention blocks (core/no_split_modules.h).
  std::vector<std::string> no_split_modules() const override {
    return {"ResnetBlock2D", "Transformer2DModel", "Attention"};
  }

  /// sample: [B, in_channels, H, W]; timestep: [] or [B] (int or float);
  /// -> [B, out_channels, H, W] (the model's prediction: noise, v or x0).
  torch::Tensor forward(const torch::Tensor& sample, const torch::Tensor& timestep,
                        const UNetConditioning& cond = {});
  /// "UNet2DModel" or "UNet2DConditionModel".
  std::string hook_class_name() const override { return config_.class_name(); }

  const UNetConfig& config() const { return config_; }
  /// Diffusers' enable_gradient_checkpointing() / disable_gradient_checkpointing(): in training
  /// mode with grad enabled, recompute each resnet and attention in backward instead of storing
  /// their activations.
  void set_gradient_checkpointing(bool on) { gradient_checkpointing_ = on; }
  bool gradient_checkpointing() const { return gradient_checkpointing_; }
  /// True for a config with addition_embed_type "text_time" (needs text_embeds and time_ids).
  bool needs_added_conditioning() const { return !add_embedding_.is_empty(); }
  /// True for UNet2DConditionModel with cross-attention blocks (needs encoder_hidden_states).
  bool needs_encoder_hidden_states() const;

 private:
  torch::Tensor forward_impl(const torch::Tensor& sample, const torch::Tensor& timestep,
                             const UNetConditioning& cond);
  torch::Tensor time_features(const torch::Tensor& timesteps, const torch::Tensor& like);

  UNetConfig config_;
  bool gradient_checkpointing_ = false;
  int64_t num_upsamplers_ = 0;
  Conv2d conv_in_{nullptr}, conv_out_{nullptr};
  GaussianFourierProjection fourier_{nullptr};
  torch::nn::Embedding learned_time_{nullptr};
  TimestepEmbedding time_embedding_{nullptr};
  torch::nn::Embedding class_embedding_table_{nullptr};
  TimestepEmbedding class_embedding_mlp_{nullptr};
  Linear class_embedding_linear_{nullptr};
  TimestepEmbedding add_embedding_{nullptr};
  std::vector<DownBlock> down_blocks_;
  MidBlock mid_block_{nullptr};
  std::vector<UpBlock> up_blocks_;
  torch::nn::GroupNorm conv_norm_out_{nullptr};
};
TORCH_MODULE(UNet);

}  // namespace difftrain::models
