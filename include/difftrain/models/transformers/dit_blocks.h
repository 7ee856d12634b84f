#pragma once
// The building blocks diffusion transformers share (Diffusers' embeddings.py, normalization.py,
// attention_processor.py, attention.py): rotary position embeddings over N axes, RMSNorm (also
// the per-head q/k norm), adaptive layer-norm modulation, attention with an optional joint text
// stream, and the gated (SwiGLU) feed-forward; the plain one is models::FeedForward
// (attention.h), patchify / unpatchify are in patchify.h. FLUX.1's blocks are made of them
// (flux_blocks.h), and so is a new family's transformer. Registered names are Diffusers'
// state-dict keys.

#include "difftrain/models/attention.h"
#include "difftrain/models/linear.h"

#include <torch/nn/module.h>

#include <array>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::models {

/// cos and sin tables of a rotary embedding, each [N, head_dim] float32.
struct RotaryTables {
  torch::Tensor cos;
  torch::Tensor sin;
};

/// Diffusers' `FluxPosEmbed(theta, axes_dim)` / `get_1d_rotary_pos_embed(..., repeat_interleave
/// _real=True)` per axis: for every axis a (dims d_a, even), angles ids[:, a] · theta^(-2j/d_a),
/// j = 0..d_a/2-1, in float64, then cos/sin in float32 with every column repeated twice
/// (interleaved pairs), axes concatenated in order. ids: [N, len(axes_dims)] (any dtype; cast to
/// float32 first, as Diffusers does) -> tables [N, sum(axes_dims)]. Any number of axes: FLUX.1's
/// (text/frame, row, column), a clip's (frame, row, column), one for text.
RotaryTables rotary_tables(const torch::Tensor& ids, const std::vector<int64_t>& axes_dims,
                           double theta = 10000.0);

/// Diffusers' `apply_rotary_emb(x, (cos, sin), use_real=True, use_real_unbind_dim=-1)`: every
/// pair (x[2m], x[2m+1]) -> (x[2m]·cos − x[2m+1]·sin, x[2m+1]·cos + x[2m]·sin), computed in
/// float32 and cast back to x's dtype. x: [B, N, heads, head_dim], tables [N, head_dim]. On the
/// CPU (float32 / bf16 / fp16 x, fused kernels on: kernels/fused_ops.h) one pass with its own
/// backward: float32 bit for bit as the tensor expression, reduced precision rounded once.
torch::Tensor apply_rotary_emb(const torch::Tensor& x, const RotaryTables& rope);

/// x[:, start : start + length] of x [B, N, ...] in a form every matmul takes without copying a
/// weight: LibTorch 2.x's matmul (linear's path for a strided 3-D input) folds [B, n, D] into one
/// mm only when the batch stride is n·D; a narrowed one-sample view (stride N·D, though
/// is_contiguous() says true) goes to bmm with the weight expanded and copied on every call.
/// One sample: the same memory, its batch stride re-derived; B > 1: a contiguous copy.
torch::Tensor token_rows(const torch::Tensor& x, int64_t start, int64_t length);

/// Diffusers' `RMSNorm(dim, eps, elementwise_affine=True)`: x * rsqrt(mean(x², -1) + eps) * weight
/// with the variance in float32; for bf16/fp16 weights the normalised value is cast to the
/// weight's dtype before the product. x: [..., dim]. Over one head's features it is the q/k norm.
/// On the CPU (float32 / bf16 / fp16 x and weight, fused kernels on) one pass per row with its own
/// backward, which keeps x and one float per row (the expression keeps float32 copies of x).
class RMSNormImpl : public torch::nn::Module {
 public:
  RMSNormImpl(int64_t dim, double eps);
  torch::Tensor forward(const torch::Tensor& x);
  torch::Tensor weight;

 private:
  double eps_;
};
TORCH_MODULE(RMSNorm);

/// The modulation of Diffusers' `AdaLayerNormZero` (chunks 6), `AdaLayerNormZeroSingle`
/// (chunks 3) and `AdaLayerNormContinuous` (chunks 2): linear(silu(temb)).chunk(chunks), with
/// child `linear` [chunks·dim, dim]. The parameter-free LayerNorm is modulate().
class AdaLayerNormZeroImpl : public torch::nn::Module {
 public:
  AdaLayerNormZeroImpl(int64_t dim, int64_t chunks);
  /// temb: [B, dim] -> `chunks` tensors [B, dim].
  std::vector<torch::Tensor> forward(const torch::Tensor& temb);

 private:
  int64_t chunks_;
  Linear linear_{nullptr};
};
TORCH_MODULE(AdaLayerNormZero);

/// layer_norm(x, eps, no affine) · (1 + scale) + shift, the modulation broadcast over tokens.
/// x: [B, N, D], shift/scale: [B, D].
torch::Tensor modulate(const torch::Tensor& x, const torch::Tensor& shift,
                       const torch::Tensor& scale, double eps = 1e-6);

/// Diffusers' `Attention(bias=True, qk_norm="rms_norm")` with the joint processor of the MMDiTs
/// (FluxAttnProcessor2_0): to_q/to_k/to_v, norm_q/norm_k (RMSNorm per head, before RoPE); joint
/// (added_kv_proj_dim = dim): add_q_proj/add_k_proj/add_v_proj, norm_added_q/norm_added_k,
/// to_add_out and to_out.0, the text tokens first in the joint sequence; not joint (pre_only):
/// no output projection.
class DiTAttentionImpl : public torch::nn::Module {
 public:
  DiTAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, bool joint, double eps = 1e-6);
  /// Joint: x [B, L, D] (image), context [B, S, D] (text), rope over the S + L tokens, text
  /// FIRST -> {to_out.0(o_img) [B, L, D], to_add_out(o_txt) [B, S, D]}.
  /// Not joint: x [B, N, D], context undefined -> {o [B, N, heads·head_dim], undefined}.
  /// queries_from > 0 (not joint only): only the output rows from that token on, [B, N −
  /// queries_from, heads·head_dim] — their queries against all N keys, the same values as those
  /// rows of the whole output — for a last block whose other rows are discarded.
  std::pair<torch::Tensor, torch::Tensor> forward(const torch::Tensor& x,
                                                  const torch::Tensor& context,
                                                  const RotaryTables& rope,
                                                  const torch::Tensor& key_mask = {},
                                                  int64_t queries_from = 0);

 private:
  // x: [B, N, D] through a projection and its per-head RMSNorm -> [B, N, heads, head_dim].
  torch::Tensor heads_of(Linear& proj, RMSNorm* norm, const torch::Tensor& x) const;

  int64_t heads_, head_dim_;
  Linear to_q_{nullptr}, to_k_{nullptr}, to_v_{nullptr};
  RMSNorm norm_q_{nullptr}, norm_k_{nullptr};
  Linear add_q_proj_{nullptr}, add_k_proj_{nullptr}, add_v_proj_{nullptr};
  RMSNorm norm_added_q_{nullptr}, norm_added_k_{nullptr};
  Linear to_add_out_{nullptr}, to_out_0_{nullptr};
};
TORCH_MODULE(DiTAttention);

/// The gated (SwiGLU) feed-forward of LLaMA-style blocks: down(silu(gate(x)) · up(x)), three
/// Linears named `names` = {gate, up, down} (default {"w1", "w3", "w2"}, as the DiTs that use it
/// save them; a decoder LLM's MLP is {"gate_proj", "up_proj", "down_proj"}). x: [..., dim].
class GatedFeedForwardImpl : public torch::nn::Module {
 public:
  GatedFeedForwardImpl(int64_t dim, int64_t hidden, bool bias = false,
                       const std::array<std::string, 3>& names = {"w1", "w3", "w2"});
  torch::Tensor forward(const torch::Tensor& x);

 private:
  Linear gate_{nullptr}, up_{nullptr}, down_{nullptr};
};
TORCH_MODULE(GatedFeedForward);

}  // namespace difftrain::models
