#pragma once
// The UNets' down, middle and up blocks (Diffusers' unet_2d_blocks.py): DownBlock2D,
// AttnDownBlock2D, CrossAttnDownBlock2D, UNetMidBlock2D, UNetMidBlock2DCrossAttn, UpBlock2D,
// AttnUpBlock2D, CrossAttnUpBlock2D, and the VAE's DownEncoderBlock2D / UpDecoderBlock2D (no time
// embedding: temb_channels 0). One class per role; the type string picks the attention layer.

#include "difftrain/core/forward_hooks.h"
#include "difftrain/models/attention.h"
#include "difftrain/models/layers.h"

#include <torch/nn/modules/container/modulelist.h>

#include <string>
#include <utility>
#include <vector>

namespace difftrain::models {

/// What every block's forward gets besides the feature map.
struct BlockInputs {
  torch::Tensor temb;                   ///< [B, temb_channels]
  torch::Tensor encoder_hidden_states;  ///< [B, S, D], cross-attention blocks only
  bool gradient_checkpointing = false;  ///< recompute each resnet / attention in backward
};

/// The arguments Diffusers' get_down_block / get_mid_block / get_up_block pass on.
struct BlockOptions {
  std::string type;
  int64_t num_layers = 1;
  int64_t in_channels = 0;
  int64_t out_channels = 0;
  int64_t prev_output_channel = 0;  ///< up blocks
  int64_t temb_channels = 0;
  bool add_resample = false;  ///< add_downsample / add_upsample
  double eps = 1e-5;
  std::string act_fn = "silu";
  int64_t groups = 32;
  int64_t attn_groups = 0;  ///< UNetMidBlock2D's attention group norm (0 = none)
  double output_scale_factor = 1.0;
  int64_t downsample_padding = 1;
  std::string resample_type = "conv";  ///< "conv" or "resnet" (UNet2DModel)
  double dropout = 0.0;
  std::string time_scale_shift = "default";
  int64_t attention_head_dim = 8;   ///< Attn*Block2D / UNetMidBlock2D: channels per head
  int64_t num_attention_heads = 1;  ///< CrossAttn* blocks: heads
  int64_t cross_attention_dim = 0;
  std::vector<int64_t> transformer_layers{1};  ///< per layer; one entry = every layer
  bool use_linear_projection = false;
  bool only_cross_attention = false;
  bool upcast_attention = false;
  bool add_attention = true;  ///< UNetMidBlock2D
};

/// A down block: num_layers x (resnet [+ attention]) then an optional downsampler. Submodules
/// `resnets`, `attentions`, `downsamplers` as in Diffusers. "DownEncoderBlock2D" (the VAE
/// encoder's) is DownBlock2D with temb_channels 0 and the encoder's downsample_padding 0.
class DownBlockImpl : public torch::nn::Module, public core::HookableModule {
 public:
  explicit DownBlockImpl(const BlockOptions& options);
  /// x: [B, C_in, H, W] -> (x: [B, C_out, H', W'], one residual per resnet and downsampler)
  std::pair<torch::Tensor, std::vector<torch::Tensor>> forward(torch::Tensor x,
                                                               const BlockInputs& in);
  /// The Diffusers block type, e.g. "CrossAttnDownBlock2D".
  std::string hook_class_name() const override { return type_; }

 private:
  std::pair<torch::Tensor, std::vector<torch::Tensor>> forward_impl(torch::Tensor x,
                                                                    const BlockInputs& in);
  std::string type_;
  std::vector<ResnetBlock2D> resnets_;
  std::vector<std::shared_ptr<SpatialLayer>> attentions_;
  Downsample2D downsample_{nullptr};
  ResnetBlock2D resnet_down_{nullptr};
};
TORCH_MODULE(DownBlock);

/// A middle block: resnet, then num_layers x (attention, resnet). With temb_channels 0 and
/// attn_groups = groups it is the VAE's UNetMidBlock2D (resnets without time_emb_proj).
class MidBlockImpl : public torch::nn::Module, public core::HookableModule {
 public:
  explicit MidBlockImpl(const BlockOptions& options);
  /// x: [B, C, H, W] -> [B, C, H, W]
  torch::Tensor forward(torch::Tensor x, const BlockInputs& in);
  /// The Diffusers block type, e.g. "UNetMidBlock2DCrossAttn".
  std::string hook_class_name() const override { return type_; }

 private:
  torch::Tensor forward_impl(torch::Tensor x, const BlockInputs& in);
  std::string type_;
  std::vector<ResnetBlock2D> resnets_;
  std::vector<std::shared_ptr<SpatialLayer>> attentions_;  // null entries when add_attention=false
};
TORCH_MODULE(MidBlock);

/// An up block: num_layers x (concat a skip, resnet [+ attention]) then an optional upsampler.
/// "UpDecoderBlock2D" (the VAE decoder's) takes no skips: its resnets chain from in_channels.
class UpBlockImpl : public torch::nn::Module, public core::HookableModule {
 public:
  /// The Diffusers block type, e.g. "CrossAttnUpBlock2D".
  std::string hook_class_name() const override { return type_; }
  explicit UpBlockImpl(const BlockOptions& options);
  /// x: [B, C, H, W]; takes num_resnets() skips from the back of `skips` (popping them; none
  /// for UpDecoderBlock2D); upsample_size: {H', W'} or empty (double). -> [B, C_out, H', W']
  torch::Tensor forward(torch::Tensor x, std::vector<torch::Tensor>& skips, const BlockInputs& in,
                        const std::vector<int64_t>& upsample_size);
  size_t num_resnets() const { return resnets_.size(); }

 private:
  torch::Tensor forward_impl(torch::Tensor x, std::vector<torch::Tensor>& skips,
                             const BlockInputs& in, const std::vector<int64_t>& upsample_size);
  std::string type_;
  bool takes_skips_ = true;
  std::vector<ResnetBlock2D> resnets_;
  std::vector<std::shared_ptr<SpatialLayer>> attentions_;
  Upsample2D upsample_{nullptr};
  ResnetBlock2D resnet_up_{nullptr};
};
TORCH_MODULE(UpBlock);

}  // namespace difftrain::models
