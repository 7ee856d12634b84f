#pragma once
// Attention layers of the UNets (Diffusers' attention_processor.py `Attention` with the classic
// AttnProcessor, attention.py `BasicTransformerBlock` / `FeedForward` / `GEGLU`, and
// transformers/transformer_2d.py `Transformer2DModel` on continuous inputs).

#include "difftrain/core/forward_hooks.h"
#include "difftrain/models/linear.h"

#include <torch/nn/module.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>
#include <torch/nn/modules/normalization.h>

#include <optional>
#include <string>

namespace difftrain::models {

/// A layer a UNet block applies to its feature map after each resnet: Diffusers' deprecated
/// spatial `Attention` (AttnDownBlock2D...) or a `Transformer2DModel` (CrossAttnDownBlock2D...).
class SpatialLayer : public torch::nn::Module {
 public:
  /// x: [B, C, H, W], context: [B, S, D] (cross-attention input) or undefined -> [B, C, H, W]
  virtual torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context) = 0;
};

/// Options of Attention (Diffusers' `Attention.__init__` arguments that UNets use).
struct AttentionOptions {
  AttentionOptions(int64_t query_dim, int64_t heads, int64_t dim_head)
      : query_dim_(query_dim), heads_(heads), dim_head_(dim_head) {}
  TORCH_ARG(int64_t, query_dim);
  TORCH_ARG(int64_t, heads);
  TORCH_ARG(int64_t, dim_head);
  /// 0 = self-attention (keys/values from the query input).
  TORCH_ARG(int64_t, cross_attention_dim) = 0;
  /// Bias of to_q / to_k / to_v (Diffusers `bias`); to_out.0 always has one (`out_bias`).
  TORCH_ARG(bool, bias) = false;
  TORCH_ARG(bool, out_bias) = true;
  TORCH_ARG(bool, upcast_attention) = false;
  TORCH_ARG(bool, upcast_softmax) = false;
  /// > 0: a `group_norm` over channels before attention (spatial attention blocks).
  TORCH_ARG(int64_t, norm_num_groups) = 0;
  TORCH_ARG(double, eps) = 1e-5;
  TORCH_ARG(bool, residual_connection) = false;
  TORCH_ARG(double, rescale_output_factor) = 1.0;
  TORCH_ARG(double, dropout) = 0.0;
};

/// Diffusers' `Attention`: multi-head scaled dot-product attention with projections to_q, to_k,
/// to_v, to_out.0 (and group_norm when norm_num_groups > 0). Accepts a sequence [B, N, C] or a
/// feature map [B, C, H, W] (flattened to N = H*W and restored, as AttnProcessor does).
class AttentionImpl : public SpatialLayer, public core::HookableModule {
 public:
  explicit AttentionImpl(const AttentionOptions& options);
  /// x: [B, N, C] or [B, C, H, W]; context: [B, S, cross_attention_dim] or undefined (self).
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context) override;
  std::string hook_class_name() const override { return "Attention"; }

 private:
  torch::Tensor forward_impl(const torch::Tensor& x, const torch::Tensor& context);

 public:
  AttentionOptions options;

 private:
  torch::nn::GroupNorm group_norm_{nullptr};
  Linear to_q_{nullptr}, to_k_{nullptr}, to_v_{nullptr};
  torch::nn::ModuleList to_out_;
};
TORCH_MODULE(Attention);

/// How attention_core forms its probabilities: scores = bmm(q, k^T) · scale in q's dtype, cast to
/// float32 when upcast_softmax, softmax, then cast to out_dtype before the product with v.
struct AttentionCore {
  double scale;
  bool upcast_softmax;
  torch::ScalarType out_dtype;
};

/// softmax(scale q k^T) v over heads folded into the batch, in query chunks so a score matrix stays
/// near 16 MiB: qh [BH, N, d], kh / vh [BH, S, d] -> [BH, N, d]. key_mask: undefined, or [B, S]
/// (true / nonzero: attend; BH a multiple of B, heads of one sample adjacent), masked scores -inf
/// before the softmax as SDPA's boolean attn_mask. With grad mode on and an input that requires
/// grad, the backward recomputes each chunk's probabilities instead of keeping them (flash
/// attention's trade: about a third more attention matmuls, no [BH, N, S] tensors saved).
torch::Tensor attention_core(const torch::Tensor& qh, const torch::Tensor& kh,
                             const torch::Tensor& vh, const torch::Tensor& key_mask,
                             const AttentionCore& core);

/// The attention core on projected tensors: softmax(q k^T * scale) v per head (attention_core, or
/// the fused float32 kernel of fused_ops.h where no key mask is given and it applies).
/// q: [B, N, h*d], k/v: [B, S, h*d] -> [B, N, h*d]; key_mask as attention_core's ([B, S]).
torch::Tensor multi_head_attention(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, int64_t heads, bool upcast_attention,
                                   bool upcast_softmax, const torch::Tensor& key_mask = {});

/// Diffusers' `FeedForward` with activation_fn "geglu" (net.0 = GEGLU proj to 2*inner), "gelu",
/// "gelu-approximate" or "geglu-approximate"; net.2 projects back to dim. x: [B, N, dim].
class FeedForwardImpl : public torch::nn::Module {
 public:
  FeedForwardImpl(int64_t dim, std::string activation_fn = "geglu", int64_t mult = 4,
                  double dropout = 0.0);
  torch::Tensor forward(const torch::Tensor& x);

 private:
  std::string activation_fn_;
  double dropout_;
  Linear proj_{nullptr}, out_{nullptr};
};
TORCH_MODULE(FeedForward);

/// Diffusers' `BasicTransformerBlock` (norm_type "layer_norm"): self-attention attn1 (or
/// cross-attention when only_cross_attention), cross-attention attn2, GEGLU feed-forward ff, each
/// pre-normed (norm1/norm2/norm3) and residual. x: [B, N, dim], context: [B, S, D].
class BasicTransformerBlockImpl : public torch::nn::Module {
 public:
  BasicTransformerBlockImpl(int64_t dim, int64_t heads, int64_t dim_head,
                            int64_t cross_attention_dim, bool only_cross_attention,
                            bool upcast_attention, bool attention_bias = false,
                            double dropout = 0.0);
  torch::Tensor forward(torch::Tensor x, const torch::Tensor& context);

 private:
  bool only_cross_attention_;
  torch::nn::LayerNorm norm1_{nullptr}, norm2_{nullptr}, norm3_{nullptr};
  Attention attn1_{nullptr}, attn2_{nullptr};
  FeedForward ff_{nullptr};
};
TORCH_MODULE(BasicTransformerBlock);

/// Diffusers' `Transformer2DModel` on a feature map: GroupNorm(eps 1e-6) -> proj_in (1x1 conv, or
/// Linear when use_linear_projection) -> transformer_blocks -> proj_out, plus the input.
class Transformer2DModelImpl : public SpatialLayer, public core::HookableModule {
 public:
  Transformer2DModelImpl(int64_t heads, int64_t dim_head, int64_t in_channels, int64_t num_layers,
                         int64_t cross_attention_dim, int64_t norm_num_groups,
                         bool use_linear_projection, bool only_cross_attention,
                         bool upcast_attention, double dropout = 0.0);
  /// x: [B, C, H, W], context: [B, S, cross_attention_dim] -> [B, C, H, W]
  torch::Tensor forward(const torch::Tensor& x, const torch::Tensor& context) override;
  std::string hook_class_name() const override { return "Transformer2DModel"; }

 private:
  torch::Tensor forward_impl(const torch::Tensor& x, const torch::Tensor& context);
  bool use_linear_projection_;
  torch::nn::GroupNorm norm_{nullptr};
  Conv2d proj_in_conv_{nullptr}, proj_out_conv_{nullptr};
  Linear proj_in_linear_{nullptr}, proj_out_linear_{nullptr};
  torch::nn::ModuleList transformer_blocks_;
};
TORCH_MODULE(Transformer2DModel);

}  // namespace difftrain::models
