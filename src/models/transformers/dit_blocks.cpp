// The shared DiT blocks (dit_blocks.h).
#include "difftrain/models/transformers/dit_blocks.h"

#include "difftrain/models/layers.h"

#include <torch/nn/functional/normalization.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>

#include <cmath>
#include <limits>

namespace difftrain::models {

// ------------------------------------------------------------------ rotary embedding

RotaryTables rotary_tables(const torch::Tensor& ids, const std::vector<int64_t>& axes_dims,
                           double theta) {
  TORCH_CHECK(ids.dim() == 2 && ids.size(1) == static_cast<int64_t>(axes_dims.size()),
              "RoPE ids must be [N, ", axes_dims.size(),
              "] (one column per axes_dims_rope entry), got ", ids.sizes());
  // Diffusers casts the ids to float32 and computes the angles in float64 (outer product of a
  // float32 and a float64 tensor), then cos/sin go to float32.
  const torch::Tensor pos = ids.to(torch::kFloat32).to(torch::kFloat64);
  auto f64 = torch::TensorOptions().dtype(torch::kFloat64).device(ids.device());
  std::vector<torch::Tensor> cos_parts, sin_parts;
  for (size_t a = 0; a < axes_dims.size(); ++a) {
    const int64_t d = axes_dims[a];
    torch::Tensor exponent =
        torch::arange(0, d, 2, f64).narrow(0, 0, d / 2) / static_cast<double>(d);
    torch::Tensor freqs = 1.0 / torch::pow(theta, exponent);
    torch::Tensor angles = torch::outer(pos.select(1, static_cast<int64_t>(a)), freqs);  // [N, d/2]
    cos_parts.push_back(angles.cos().repeat_interleave(2, 1).to(torch::kFloat32));
    sin_parts.push_back(angles.sin().repeat_interleave(2, 1).to(torch::kFloat32));
  }
  return {torch::cat(cos_parts, -1), torch::cat(sin_parts, -1)};
}

torch::Tensor apply_rotary_emb(const torch::Tensor& x, const RotaryTables& rope) {
  TORCH_CHECK(
      x.dim() == 4 && rope.cos.dim() == 2 && x.size(1) == rope.cos.size(0) &&
          x.size(3) == rope.cos.size(1),
      "apply_rotary_emb: x must be [B, N, heads, head_dim] with tables [N, head_dim], got x ",
      x.sizes(), " and tables ", rope.cos.sizes());
  const int64_t N = x.size(1), d = x.size(3);
  torch::Tensor cos = rope.cos.view({1, N, 1, d});
  torch::Tensor sin = rope.sin.view({1, N, 1, d});
  // (x_real, x_imag) pairs -> (-x_imag, x_real), interleaved again.
  torch::Tensor pairs = x.reshape({x.size(0), N, x.size(2), d / 2, 2});
  torch::Tensor rotated = torch::stack({-pairs.select(-1, 1), pairs.select(-1, 0)}, -1).flatten(3);
  return (x.to(torch::kFloat32) * cos + rotated.to(torch::kFloat32) * sin).to(x.scalar_type());
}

// ------------------------------------------------------------------ norms

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  torch::Tensor variance = x.to(torch::kFloat32).pow(2).mean(-1, /*keepdim=*/true);
  torch::Tensor h = x * torch::rsqrt(variance + eps_);
  if (weight.scalar_type() == torch::kBFloat16 || weight.scalar_type() == torch::kFloat16) {
    h = h.to(weight.scalar_type());
  }
  return h * weight;
}

AdaLayerNormZeroImpl::AdaLayerNormZeroImpl(int64_t dim, int64_t chunks) : chunks_(chunks) {
  linear_ = register_module("linear", Linear(dim, chunks * dim));
}

std::vector<torch::Tensor> AdaLayerNormZeroImpl::forward(const torch::Tensor& temb) {
  return linear_(torch::silu(temb)).chunk(chunks_, 1);
}

torch::Tensor modulate(const torch::Tensor& x, const torch::Tensor& shift,
                       const torch::Tensor& scale, double eps) {
  torch::Tensor n = torch::layer_norm(x, {x.size(-1)}, {}, {}, eps);
  return n * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

// ------------------------------------------------------------------ attention

DiTAttentionImpl::DiTAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, bool joint,
                                   double eps)
    : heads_(heads), head_dim_(head_dim) {
  const int64_t inner = heads * head_dim;
  norm_q_ = register_module("norm_q", RMSNorm(head_dim, eps));
  norm_k_ = register_module("norm_k", RMSNorm(head_dim, eps));
  to_q_ = register_module("to_q", Linear(dim, inner));
  to_k_ = register_module("to_k", Linear(dim, inner));
  to_v_ = register_module("to_v", Linear(dim, inner));
  if (!joint) return;  // pre_only: the single block projects the attention itself (proj_out)
  auto to_out = register_module("to_out", torch::nn::ModuleList());
  to_out_0_ = Linear(inner, dim);
  to_out->push_back(to_out_0_);
  to_out->push_back(torch::nn::Dropout(0.0));
  norm_added_q_ = register_module("norm_added_q", RMSNorm(head_dim, eps));
  norm_added_k_ = register_module("norm_added_k", RMSNorm(head_dim, eps));
  add_q_proj_ = register_module("add_q_proj", Linear(dim, inner));
  add_k_proj_ = register_module("add_k_proj", Linear(dim, inner));
  add_v_proj_ = register_module("add_v_proj", Linear(dim, inner));
  to_add_out_ = register_module("to_add_out", Linear(inner, dim));
}

torch::Tensor DiTAttentionImpl::heads_of(Linear& proj, RMSNorm* norm,
                                         const torch::Tensor& x) const {
  torch::Tensor h = proj(x).view({x.size(0), x.size(1), heads_, head_dim_});
  return norm ? (*norm)(h) : h;
}

std::pair<torch::Tensor, torch::Tensor> DiTAttentionImpl::forward(const torch::Tensor& x,
                                                                  const torch::Tensor& context,
                                                                  const RotaryTables& rope,
                                                                  const torch::Tensor& key_mask) {
  const bool joint = !to_add_out_.is_empty();
  TORCH_CHECK(joint == context.defined(), joint ? "the joint attention needs the text stream"
                                                : "the single-stream attention takes no "
                                                  "text stream");
  const int64_t B = x.size(0), L = x.size(1);
  torch::Tensor q = heads_of(to_q_, &norm_q_, x);
  torch::Tensor k = heads_of(to_k_, &norm_k_, x);
  torch::Tensor v = heads_of(to_v_, nullptr, x);
  const int64_t S = joint ? context.size(1) : 0;
  if (joint) {
    // Text tokens come first in the joint sequence, as in the RoPE ids.
    q = torch::cat({heads_of(add_q_proj_, &norm_added_q_, context), q}, 1);
    k = torch::cat({heads_of(add_k_proj_, &norm_added_k_, context), k}, 1);
    v = torch::cat({heads_of(add_v_proj_, nullptr, context), v}, 1);
  }
  q = apply_rotary_emb(q, rope);
  k = apply_rotary_emb(k, rope);
  const int64_t N = S + L, inner = heads_ * head_dim_;
  torch::Tensor o;
  if (key_mask.defined()) {
    // A padding mask on the keys ([B, N], true: attend), as SDPA's boolean attn_mask: masked
    // scores are -inf before a float32 softmax. Some key of every row is real (the image).
    TORCH_CHECK(key_mask.dim() == 2 && key_mask.size(0) == B && key_mask.size(1) == N,
                "DiTAttention: key_mask must be [", B, ", ", N, "], got ", key_mask.sizes());
    const torch::Tensor qh = q.transpose(1, 2), kh = k.transpose(1, 2), vh = v.transpose(1, 2);
    torch::Tensor scores =
        torch::matmul(qh, kh.transpose(2, 3)).to(torch::kFloat32) / std::sqrt(double(head_dim_));
    scores = scores.masked_fill(key_mask.to(torch::kBool).logical_not().view({B, 1, 1, N}),
                                -std::numeric_limits<float>::infinity());
    o = torch::matmul(scores.softmax(-1).to(vh.scalar_type()), vh)
            .transpose(1, 2)
            .reshape({B, N, inner});
  } else {
    o = multi_head_attention(q.reshape({B, N, inner}), k.reshape({B, N, inner}),
                             v.reshape({B, N, inner}), heads_,
                             /*upcast_attention=*/false, /*upcast_softmax=*/true);
  }
  if (!joint) return {o, torch::Tensor()};
  torch::Tensor o_txt = o.narrow(1, 0, S).contiguous();
  torch::Tensor o_img = o.narrow(1, S, L).contiguous();
  return {to_out_0_(o_img), to_add_out_(o_txt)};
}

// ------------------------------------------------------------------ gated feed-forward

GatedFeedForwardImpl::GatedFeedForwardImpl(int64_t dim, int64_t hidden, bool bias,
                                           const std::array<std::string, 3>& names) {
  gate_ = register_module(names[0], Linear(torch::nn::LinearOptions(dim, hidden).bias(bias)));
  up_ = register_module(names[1], Linear(torch::nn::LinearOptions(dim, hidden).bias(bias)));
  down_ = register_module(names[2], Linear(torch::nn::LinearOptions(hidden, dim).bias(bias)));
}

torch::Tensor GatedFeedForwardImpl::forward(const torch::Tensor& x) {
  return down_(torch::silu(gate_(x)) * up_(x));
}

}  // namespace difftrain::models
