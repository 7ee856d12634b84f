#include "difftrain/models/transformers/flux_blocks.h"

#include "difftrain/models/layers.h"

#include <torch/nn/functional/normalization.h>
#include <torch/nn/modules/dropout.h>

#include <cmath>

namespace difftrain::models {

namespace {

// The dims of FLUX's LayerNorms and RMSNorms.
constexpr double kFluxNormEps = 1e-6;

}  // namespace

// ------------------------------------------------------------------ rotary embedding

RotaryTables flux_rotary_tables(const torch::Tensor& ids, const std::vector<int64_t>& axes_dims,
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

torch::Tensor flux_modulate(const torch::Tensor& x, const torch::Tensor& shift,
                            const torch::Tensor& scale) {
  torch::Tensor n = torch::layer_norm(x, {x.size(-1)}, {}, {}, kFluxNormEps);
  return n * (1 + scale.unsqueeze(1)) + shift.unsqueeze(1);
}

// ------------------------------------------------------------------ attention

FluxAttentionImpl::FluxAttentionImpl(int64_t dim, int64_t heads, int64_t head_dim, bool joint)
    : heads_(heads), head_dim_(head_dim) {
  const int64_t inner = heads * head_dim;
  norm_q_ = register_module("norm_q", RMSNorm(head_dim, kFluxNormEps));
  norm_k_ = register_module("norm_k", RMSNorm(head_dim, kFluxNormEps));
  to_q_ = register_module("to_q", Linear(dim, inner));
  to_k_ = register_module("to_k", Linear(dim, inner));
  to_v_ = register_module("to_v", Linear(dim, inner));
  if (!joint) return;  // pre_only: the single block projects the attention itself (proj_out)
  auto to_out = register_module("to_out", torch::nn::ModuleList());
  to_out_0_ = Linear(inner, dim);
  to_out->push_back(to_out_0_);
  to_out->push_back(torch::nn::Dropout(0.0));
  norm_added_q_ = register_module("norm_added_q", RMSNorm(head_dim, kFluxNormEps));
  norm_added_k_ = register_module("norm_added_k", RMSNorm(head_dim, kFluxNormEps));
  add_q_proj_ = register_module("add_q_proj", Linear(dim, inner));
  add_k_proj_ = register_module("add_k_proj", Linear(dim, inner));
  add_v_proj_ = register_module("add_v_proj", Linear(dim, inner));
  to_add_out_ = register_module("to_add_out", Linear(inner, dim));
}

torch::Tensor FluxAttentionImpl::heads_of(Linear& proj, RMSNorm* norm,
                                          const torch::Tensor& x) const {
  torch::Tensor h = proj(x).view({x.size(0), x.size(1), heads_, head_dim_});
  return norm ? (*norm)(h) : h;
}

std::pair<torch::Tensor, torch::Tensor> FluxAttentionImpl::forward(const torch::Tensor& x,
                                                                   const torch::Tensor& context,
                                                                   const RotaryTables& rope) {
  const bool joint = !to_add_out_.is_empty();
  TORCH_CHECK(joint == context.defined(), joint ? "the joint FLUX attention needs the text stream"
                                                : "the single-stream FLUX attention takes no "
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
  torch::Tensor o = multi_head_attention(q.reshape({B, N, inner}), k.reshape({B, N, inner}),
                                         v.reshape({B, N, inner}), heads_,
                                         /*upcast_attention=*/false, /*upcast_softmax=*/true);
  if (!joint) return {o, torch::Tensor()};
  torch::Tensor o_txt = o.narrow(1, 0, S).contiguous();
  torch::Tensor o_img = o.narrow(1, S, L).contiguous();
  return {to_out_0_(o_img), to_add_out_(o_txt)};
}

// ------------------------------------------------------------------ double-stream block

FluxTransformerBlockImpl::FluxTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim) {
  norm1_ = register_module("norm1", AdaLayerNormZero(dim, 6));
  norm1_context_ = register_module("norm1_context", AdaLayerNormZero(dim, 6));
  attn_ = register_module("attn", FluxAttention(dim, heads, head_dim, /*joint=*/true));
  ff_ = register_module("ff", FeedForward(dim, "gelu-approximate", 4));
  ff_context_ = register_module("ff_context", FeedForward(dim, "gelu-approximate", 4));
}

std::pair<torch::Tensor, torch::Tensor> FluxTransformerBlockImpl::forward(
    const torch::Tensor& img, const torch::Tensor& txt, const torch::Tensor& temb,
    const RotaryTables& rope) {
  core::ForwardScope scope(*this);
  // shift, scale, gate of the attention, then of the feed-forward.
  const std::vector<torch::Tensor> m = norm1_(temb);
  const std::vector<torch::Tensor> c = norm1_context_(temb);
  auto [a_img, a_txt] = attn_(flux_modulate(img, m[0], m[1]), flux_modulate(txt, c[0], c[1]), rope);
  torch::Tensor h = img + m[2].unsqueeze(1) * a_img;
  h = h + m[5].unsqueeze(1) * ff_(flux_modulate(h, m[3], m[4]));
  torch::Tensor e = txt + c[2].unsqueeze(1) * a_txt;
  e = e + c[5].unsqueeze(1) * ff_context_(flux_modulate(e, c[3], c[4]));
  if (e.scalar_type() == torch::kFloat16) e = e.clamp(-65504, 65504);
  auto outs = scope.outputs({h, e});
  return {outs[0], outs[1]};
}

// ------------------------------------------------------------------ single-stream block

FluxSingleTransformerBlockImpl::FluxSingleTransformerBlockImpl(int64_t dim, int64_t heads,
                                                               int64_t head_dim) {
  const int64_t mlp = 4 * dim;
  norm_ = register_module("norm", AdaLayerNormZero(dim, 3));
  proj_mlp_ = register_module("proj_mlp", Linear(dim, mlp));
  proj_out_ = register_module("proj_out", Linear(dim + mlp, dim));
  attn_ = register_module("attn", FluxAttention(dim, heads, head_dim, /*joint=*/false));
}

torch::Tensor FluxSingleTransformerBlockImpl::forward(const torch::Tensor& h,
                                                      const torch::Tensor& temb,
                                                      const RotaryTables& rope) {
  core::ForwardScope scope(*this);
  const std::vector<torch::Tensor> m = norm_(temb);  // shift, scale, gate
  torch::Tensor n = flux_modulate(h, m[0], m[1]);
  torch::Tensor mlp = gelu(proj_mlp_(n), /*tanh_approximation=*/true);
  torch::Tensor a = attn_(n, torch::Tensor(), rope).first;
  torch::Tensor out = h + m[2].unsqueeze(1) * proj_out_(torch::cat({a, mlp}, 2));
  if (out.scalar_type() == torch::kFloat16) out = out.clamp(-65504, 65504);
  return scope.output(out);
}

}  // namespace difftrain::models
