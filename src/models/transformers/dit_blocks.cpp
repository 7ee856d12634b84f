// The shared DiT blocks (dit_blocks.h).
#include "difftrain/models/transformers/dit_blocks.h"

#include "difftrain/models/kernels/fused_ops.h"
#include "difftrain/models/layers.h"

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include <torch/nn/functional/normalization.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/dropout.h>

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

namespace {

// The rotation of apply_rotary_emb in one pass over x: per pair (x0, x1) = (x[2m], x[2m+1]) with
// the tables' (c0, s0) at 2m and (c1, s1) at 2m+1, forward (x0 c0 - x1 s0, x1 c1 + x0 s1) and its
// transpose, the backward, (g0 c0 + g1 s1, g1 c1 - g0 s0): float32 arithmetic in the op order of
// the tensor expression (two products, then their sum), rounded once to the tensor's dtype.
template <typename T>
void rotate_pairs(const T* x, const float* cos, const float* sin, T* out, int64_t rows,
                  int64_t tokens, int64_t heads, int64_t dim, bool transpose) {
  at::parallel_for(0, rows * tokens, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float* c = cos + (r % tokens) * dim;
      const float* s = sin + (r % tokens) * dim;
      const T* xr = x + r * heads * dim;
      T* yr = out + r * heads * dim;
      for (int64_t h = 0; h < heads; ++h, xr += dim, yr += dim) {
        for (int64_t i = 0; i < dim; i += 2) {
          const float x0 = static_cast<float>(xr[i]), x1 = static_cast<float>(xr[i + 1]);
          float a, b, p, q;
          if (!transpose) {
            a = x0 * c[i], b = x1 * s[i], p = x1 * c[i + 1], q = x0 * s[i + 1];
            yr[i] = static_cast<T>(a - b);
            yr[i + 1] = static_cast<T>(p + q);
          } else {
            a = x0 * c[i], b = x1 * s[i + 1], p = x1 * c[i + 1], q = x0 * s[i];
            yr[i] = static_cast<T>(a + b);
            yr[i + 1] = static_cast<T>(p - q);
          }
        }
      }
    }
  });
}

torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin,
                     bool transpose) {
  const torch::Tensor xc = x.contiguous();
  torch::Tensor out = torch::empty_like(xc);
  const int64_t B = x.size(0), N = x.size(1), H = x.size(2), D = x.size(3);
  AT_DISPATCH_FLOATING_TYPES_AND2(torch::kBFloat16, torch::kHalf, x.scalar_type(), "rotate", [&] {
    rotate_pairs<scalar_t>(xc.data_ptr<scalar_t>(), cos.data_ptr<float>(), sin.data_ptr<float>(),
                           out.data_ptr<scalar_t>(), B, N, H, D, transpose);
  });
  return out;
}

// apply_rotary_emb as one op with its own backward (the tensor expression makes eight tensors of
// x's size forward and more backward: the pairs' stack, the float32 copies, the products).
struct RotaryFn : public torch::autograd::Function<RotaryFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& cos, const torch::Tensor& sin) {
    ctx->saved_data["cos"] = cos;
    ctx->saved_data["sin"] = sin;
    return rotate(x, cos, sin, /*transpose=*/false);
  }
  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    return {rotate(grads[0], ctx->saved_data["cos"].toTensor(), ctx->saved_data["sin"].toTensor(),
                   /*transpose=*/true),
            torch::Tensor(), torch::Tensor()};
  }
};

bool fused_rotary_applies(const torch::Tensor& x, const RotaryTables& rope) {
  const auto t = x.scalar_type();
  return fused_kernels_enabled() && x.device().is_cpu() && !rope.cos.requires_grad() &&
         !rope.sin.requires_grad() && rope.cos.scalar_type() == torch::kFloat32 &&
         rope.sin.scalar_type() == torch::kFloat32 && rope.cos.device().is_cpu() &&
         (t == torch::kFloat32 || t == torch::kBFloat16 || t == torch::kHalf) && x.size(3) % 2 == 0;
}

}  // namespace

torch::Tensor apply_rotary_emb(const torch::Tensor& x, const RotaryTables& rope) {
  TORCH_CHECK(
      x.dim() == 4 && rope.cos.dim() == 2 && x.size(1) == rope.cos.size(0) &&
          x.size(3) == rope.cos.size(1),
      "apply_rotary_emb: x must be [B, N, heads, head_dim] with tables [N, head_dim], got x ",
      x.sizes(), " and tables ", rope.cos.sizes());
  const int64_t N = x.size(1), d = x.size(3);
  if (fused_rotary_applies(x, rope)) {
    return RotaryFn::apply(x, rope.cos.contiguous(), rope.sin.contiguous());
  }
  torch::Tensor cos = rope.cos.view({1, N, 1, d});
  torch::Tensor sin = rope.sin.view({1, N, 1, d});
  // (x_real, x_imag) pairs -> (-x_imag, x_real), interleaved again.
  torch::Tensor pairs = x.reshape({x.size(0), N, x.size(2), d / 2, 2});
  torch::Tensor rotated = torch::stack({-pairs.select(-1, 1), pairs.select(-1, 0)}, -1).flatten(3);
  return (x.to(torch::kFloat32) * cos + rotated.to(torch::kFloat32) * sin).to(x.scalar_type());
}

torch::Tensor token_rows(const torch::Tensor& x, int64_t start, int64_t length) {
  torch::Tensor rows = x.narrow(1, start, length);
  // One sample: the same memory with its batch stride re-derived (squeeze, unsqueeze), which
  // LibTorch 2.x's matmul folds into one mm; a batch's row ranges are really apart: a copy.
  return x.size(0) == 1 ? rows.squeeze(0).unsqueeze(0) : rows.contiguous();
}

// ------------------------------------------------------------------ norms

RMSNormImpl::RMSNormImpl(int64_t dim, double eps) : eps_(eps) {
  weight = register_parameter("weight", torch::ones({dim}));
}

namespace {

bool reduced(torch::ScalarType t) { return t == torch::kBFloat16 || t == torch::kHalf; }

// RMSNormImpl::forward's maths over rows of `dim`, in one pass forward and one backward: per row
// r = rsqrt(mean(x²) + eps) in float32; h = x r; y = h w, with h first rounded to w's dtype when w
// is bf16 / fp16 (the output is then in w's dtype, else float32), as the tensor expression. The
// backward: dh = g w, dx = r dh - x r³ mean(dh x) in float32, rounded once to x's dtype; dw = sum
// over rows of g h (tensor ops, in float32), only when w requires grad.
template <typename X, typename W, typename Y>
void rms_norm_forward(const X* x, const W* w, Y* y, float* rstd, int64_t rows, int64_t dim,
                      float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const X* xr = x + r * dim;
      float ss = 0;
      for (int64_t i = 0; i < dim; ++i) ss += static_cast<float>(xr[i]) * static_cast<float>(xr[i]);
      const float rs = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
      rstd[r] = rs;
      Y* yr = y + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float h = static_cast<float>(xr[i]) * rs;
        // W reduced: h rounds to W first; float W: h stays float32.
        yr[i] = static_cast<Y>(static_cast<float>(static_cast<W>(h)) * static_cast<float>(w[i]));
      }
    }
  });
}

template <typename X, typename W, typename Y>
void rms_norm_backward(const Y* g, const X* x, const W* w, const float* rstd, X* dx, int64_t rows,
                       int64_t dim) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const Y* gr = g + r * dim;
      const X* xr = x + r * dim;
      const float rs = rstd[r];
      float dot = 0;
      for (int64_t i = 0; i < dim; ++i) {
        dot += static_cast<float>(gr[i]) * static_cast<float>(w[i]) * static_cast<float>(xr[i]);
      }
      const float k = rs * rs * rs * dot / static_cast<float>(dim);
      X* dr = dx + r * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float xi = static_cast<float>(xr[i]);
        dr[i] =
            static_cast<X>(rs * (static_cast<float>(gr[i]) * static_cast<float>(w[i])) - xi * k);
      }
    }
  });
}

// Calls f with null pointers typed as x's and w's element types (float, bf16, fp16 each).
template <typename F>
void dispatch_rms(torch::ScalarType xt, torch::ScalarType wt, F&& f) {
  auto with_w = [&](auto xp) {
    if (wt == torch::kBFloat16) return f(xp, static_cast<const c10::BFloat16*>(nullptr));
    if (wt == torch::kHalf) return f(xp, static_cast<const c10::Half*>(nullptr));
    return f(xp, static_cast<const float*>(nullptr));
  };
  if (xt == torch::kBFloat16) return with_w(static_cast<const c10::BFloat16*>(nullptr));
  if (xt == torch::kHalf) return with_w(static_cast<const c10::Half*>(nullptr));
  return with_w(static_cast<const float*>(nullptr));
}

struct RmsNormFn : public torch::autograd::Function<RmsNormFn> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& x,
                               const torch::Tensor& weight, double eps) {
    const torch::Tensor xc = x.contiguous(), wc = weight.contiguous();
    const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(1, dim);
    const auto out_type = reduced(weight.scalar_type()) ? weight.scalar_type() : torch::kFloat32;
    torch::Tensor y = torch::empty(x.sizes(), x.options().dtype(out_type));
    torch::Tensor rstd = torch::empty({rows}, x.options().dtype(torch::kFloat32));
    dispatch_rms(x.scalar_type(), weight.scalar_type(), [&](auto xp, auto wp) {
      using X = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
      using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
      auto run = [&](auto yp) {
        using Y = std::remove_pointer_t<decltype(yp)>;
        rms_norm_forward<X, W, Y>(static_cast<const X*>(xc.data_ptr()),
                                  static_cast<const W*>(wc.data_ptr()),
                                  static_cast<Y*>(y.data_ptr()), rstd.data_ptr<float>(), rows, dim,
                                  static_cast<float>(eps));
      };
      if constexpr (std::is_same_v<W, float>) {
        run(static_cast<float*>(nullptr));
      } else {
        run(static_cast<W*>(nullptr));
      }
    });
    ctx->save_for_backward({xc, wc, rstd});
    return y;
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &x = saved[0], &w = saved[1], &rstd = saved[2];
    const int64_t dim = x.size(-1), rows = x.numel() / std::max<int64_t>(1, dim);
    const bool want_dw = ctx->needs_input_grad(1);
    const torch::Tensor g = grads[0].contiguous();
    torch::Tensor dx = torch::empty_like(x);
    dispatch_rms(x.scalar_type(), w.scalar_type(), [&](auto xp, auto wp) {
      using X = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
      using W = std::remove_const_t<std::remove_pointer_t<decltype(wp)>>;
      using Y = std::conditional_t<std::is_same_v<W, float>, float, W>;
      rms_norm_backward<X, W, Y>(static_cast<const Y*>(g.data_ptr()),
                                 static_cast<const X*>(x.data_ptr()),
                                 static_cast<const W*>(w.data_ptr()), rstd.data_ptr<float>(),
                                 static_cast<X*>(dx.data_ptr()), rows, dim);
    });
    torch::Tensor dw;
    if (want_dw) {  // a trained norm (full fine-tune): sum over rows of g h, h as the forward's
      torch::Tensor h = x.reshape({rows, dim}).to(torch::kFloat32) * rstd.view({rows, 1});
      if (reduced(w.scalar_type())) h = h.to(w.scalar_type()).to(torch::kFloat32);
      dw = (g.reshape({rows, dim}).to(torch::kFloat32) * h).sum(0).to(w.scalar_type());
    }
    return {dx, dw, torch::Tensor()};
  }
};

bool fused_rms_norm_applies(const torch::Tensor& x, const torch::Tensor& w) {
  const auto ok = [](torch::ScalarType t) { return t == torch::kFloat32 || reduced(t); };
  return fused_kernels_enabled() && x.device().is_cpu() && w.device().is_cpu() &&
         ok(x.scalar_type()) && ok(w.scalar_type()) && x.dim() >= 1 && w.dim() == 1 &&
         x.size(-1) == w.size(0) && x.numel() > 0;
}

}  // namespace

torch::Tensor RMSNormImpl::forward(const torch::Tensor& x) {
  // Under LibTorch's CPU autocast the expression's ops keep their dtypes (none is on its lists),
  // so the fused op computes the same thing inside and outside an autocast region.
  if (fused_rms_norm_applies(x, weight)) return RmsNormFn::apply(x, weight, eps_);
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
                                                                  const torch::Tensor& key_mask,
                                                                  int64_t queries_from) {
  const bool joint = !to_add_out_.is_empty();
  TORCH_CHECK(joint == context.defined(), joint ? "the joint attention needs the text stream"
                                                : "the single-stream attention takes no "
                                                  "text stream");
  const int64_t B = x.size(0), L = x.size(1);
  TORCH_CHECK(queries_from == 0 || (!joint && queries_from > 0 && queries_from < L),
              "DiTAttention: queries_from must be 0, or in (0, ", L,
              ") for the single-stream attention; got ", queries_from);
  // With queries_from > 0 only the rows from there on are wanted: their queries, every key.
  const int64_t rows = L - queries_from;
  torch::Tensor q =
      heads_of(to_q_, &norm_q_, queries_from > 0 ? token_rows(x, queries_from, rows) : x);
  torch::Tensor k = heads_of(to_k_, &norm_k_, x);
  torch::Tensor v = heads_of(to_v_, nullptr, x);
  const int64_t S = joint ? context.size(1) : 0;
  if (joint) {
    // Text tokens come first in the joint sequence, as in the RoPE ids.
    q = torch::cat({heads_of(add_q_proj_, &norm_added_q_, context), q}, 1);
    k = torch::cat({heads_of(add_k_proj_, &norm_added_k_, context), k}, 1);
    v = torch::cat({heads_of(add_v_proj_, nullptr, context), v}, 1);
  }
  q = apply_rotary_emb(q, queries_from > 0 ? RotaryTables{rope.cos.narrow(0, queries_from, rows),
                                                          rope.sin.narrow(0, queries_from, rows)}
                                           : rope);
  k = apply_rotary_emb(k, rope);
  const int64_t N = S + L, inner = heads_ * head_dim_;
  if (key_mask.defined()) {
    // A padding mask on the keys ([B, N], true: attend), as SDPA's boolean attn_mask: masked
    // scores are -inf before a float32 softmax. Some key of every row is real (the image).
    TORCH_CHECK(key_mask.dim() == 2 && key_mask.size(0) == B && key_mask.size(1) == N,
                "DiTAttention: key_mask must be [", B, ", ", N, "], got ", key_mask.sizes());
  }
  const torch::Tensor o =
      multi_head_attention(q.reshape({B, S + rows, inner}), k.reshape({B, N, inner}),
                           v.reshape({B, N, inner}), heads_, /*upcast_attention=*/false,
                           /*upcast_softmax=*/true, key_mask);
  if (!joint) return {o, torch::Tensor()};
  torch::Tensor o_txt = token_rows(o, 0, S);
  torch::Tensor o_img = token_rows(o, S, L);
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
