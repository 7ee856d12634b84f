#include "difftrain/models/attention.h"

#include "difftrain/core/error.h"
#include "difftrain/core/torch_compat.h"
#include "difftrain/models/kernels/fused_ops.h"
#include "difftrain/models/layers.h"

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/dropout.h>

#include <torch/autograd.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <tuple>
#include <vector>

namespace difftrain::models {

namespace F = torch::nn::functional;

namespace {

torch::Tensor maybe_dropout(const torch::Tensor& x, double p, bool training) {
  if (p <= 0 || !training) return x;
  return F::dropout(x, F::DropoutFuncOptions().p(p).training(true));
}

}  // namespace

// ------------------------------------------------------------------ Attention

namespace {

// How attention_core splits its work so a chunk's score matrix stays near 16 MiB (4M elements of
// 4 bytes): the forward holds four such matrices at once (bf16 / float32 scores, probabilities),
// the backward six, which keeps those transients under the graph's saved tensors. Whole heads
// first, as many as fit: a range of heads of a contiguous [B*h, N, d] is itself dense, which
// LibTorch's CPU bmm needs (oneDNN takes only dense or transposed-dense batches: a range of query
// rows across all heads was copied before every product, 8% of a FLUX.1 LoRA step at 1,152
// tokens), and a head's dK and dV come out whole. A head whose [N, S] scores alone exceed the
// budget (4,096 tokens and more) runs in query chunks, one head at a time.
struct AttentionChunks {
  int64_t heads;    // heads per chunk
  int64_t queries;  // query rows per chunk: all N unless heads == 1
};

AttentionChunks attention_chunks_of(int64_t batch_heads, int64_t queries, int64_t keys) {
  const int64_t budget = int64_t{4} << 20;
  const int64_t per_head = std::max<int64_t>(1, queries * keys);
  if (per_head <= budget) {
    return {std::clamp<int64_t>(budget / per_head, 1, std::max<int64_t>(batch_heads, 1)), queries};
  }
  return {1, std::max<int64_t>(1, std::min<int64_t>(queries, budget / std::max<int64_t>(1, keys)))};
}

// The key mask's rows for heads [h, h + n): masked is [B*h, 1, S] or [1, 1, S] (broadcast).
torch::Tensor mask_rows(const torch::Tensor& masked, int64_t h, int64_t n) {
  if (!masked.defined() || masked.size(0) == 1) return masked;
  return masked.narrow(0, h, n);
}

// The scaled scores bmm(q, k^T) · scale made ready for the softmax: the optional upcast to float32,
// the key mask (-inf where masked).
torch::Tensor softmax_input(const torch::Tensor& scaled, const torch::Tensor& masked,
                            const AttentionCore& c) {
  torch::Tensor scores = scaled;
  if (c.upcast_softmax) scores = scores.to(torch::kFloat32);
  if (masked.defined()) {
    scores = scores.masked_fill(masked, -std::numeric_limits<double>::infinity());
  }
  return scores;
}

// Whether a chunk's softmax runs as the one-pass bf16 kernel (fused_ops.h): bf16 scores with the
// float32 softmax and bf16 probabilities, on the CPU.
bool bf16_softmax(const torch::Tensor& raw, const AttentionCore& c) {
  return c.upcast_softmax && c.out_dtype == torch::kBFloat16 &&
         raw.scalar_type() == torch::kBFloat16 && raw.device().is_cpu();
}

// One chunk's probabilities in out_dtype from its raw scores bmm(q, k^T) (in q's dtype, or
// autocast's): the one-pass kernel where it applies; else the scale (not folded into a baddbmm:
// LibTorch 1.13's CPU baddbmm with beta = 0 reads its uninitialised input on some small bf16 /
// float64 shapes), the optional upcast, the mask, the softmax and the cast as tensor ops.
torch::Tensor chunk_probs(const torch::Tensor& raw, const torch::Tensor& masked,
                          const AttentionCore& c) {
  if (bf16_softmax(raw, c)) {
    if (torch::Tensor p = attention_softmax_bf16(raw, c.scale, masked); p.defined()) return p;
  }
  return softmax_input(raw * c.scale, masked, c).softmax(-1).to(c.out_dtype);
}

// attention_core's loop over its chunks (masked: undefined or [BH, 1, S], true where masked).
torch::Tensor attention_chunks(const torch::Tensor& qh, const torch::Tensor& kh,
                               const torch::Tensor& vh, const torch::Tensor& masked,
                               const AttentionCore& c) {
  const int64_t BH = qh.size(0), N = qh.size(1);
  const AttentionChunks chunks = attention_chunks_of(BH, N, kh.size(1));
  const torch::Tensor kt = kh.transpose(1, 2);
  std::vector<torch::Tensor> heads;
  for (int64_t h = 0; h < BH; h += chunks.heads) {
    const int64_t nh = std::min(chunks.heads, BH - h);
    const torch::Tensor q = qh.narrow(0, h, nh), k = kt.narrow(0, h, nh), v = vh.narrow(0, h, nh);
    const torch::Tensor m = mask_rows(masked, h, nh);
    std::vector<torch::Tensor> rows;
    for (int64_t start = 0; start < N; start += chunks.queries) {
      const int64_t len = std::min(chunks.queries, N - start);
      const torch::Tensor probs = chunk_probs(torch::bmm(q.narrow(1, start, len), k), m, c);
      rows.push_back(torch::bmm(probs, v));
    }
    heads.push_back(rows.size() == 1 ? rows[0] : torch::cat(rows, 1));
  }
  return heads.size() == 1 ? heads[0] : torch::cat(heads, 0);
}

// The same maths with a backward that recomputes each chunk's probabilities from q and k instead
// of keeping them: autograd would save the float32 softmax output and its cast for every chunk
// ([B*h, N, S] twice, about 190 MiB per FLUX.1 block at 1,152 tokens). The gradients are the ones
// autograd forms for the ops of attention_chunks (the same op sequence, chunk by chunk), with
// dK and dV summed over the chunks in float32.
struct MaskArg {
  torch::Tensor masked;
};

struct RecomputedAttention : public torch::autograd::Function<RecomputedAttention> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, const torch::Tensor& qh,
                               const torch::Tensor& kh, const torch::Tensor& vh,
                               const MaskArg& mask, double scale, bool upcast_softmax,
                               int64_t out_dtype) {
    // The mask needs no gradient, and may be undefined (which apply() would not take as an input).
    const torch::Tensor& masked = mask.masked;
    const AttentionCore c{scale, upcast_softmax, static_cast<torch::ScalarType>(out_dtype)};
    ctx->save_for_backward({qh, kh, vh});
    ctx->saved_data["has_mask"] = masked.defined();
    if (masked.defined()) ctx->saved_data["masked"] = masked;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["upcast"] = upcast_softmax;
    ctx->saved_data["dtype"] = out_dtype;
    // The products ran under the caller's autocast, if any (a float32 q with a bf16 v in a full
    // fine-tune): the backward's run under the same.
    const c10::DeviceType device = qh.device().type();
    const compat::AutocastState autocast = compat::autocast_state(device);
    ctx->saved_data["autocast"] = autocast.enabled;
    ctx->saved_data["autocast_dtype"] = static_cast<int64_t>(autocast.dtype);
    torch::NoGradGuard no_grad;
    return attention_chunks(qh, kh, vh, masked, c);
  }

  static torch::autograd::tensor_list backward(torch::autograd::AutogradContext* ctx,
                                               torch::autograd::tensor_list grads) {
    const auto saved = ctx->get_saved_variables();
    const torch::Tensor &qh = saved[0], &kh = saved[1], &vh = saved[2];
    const torch::Tensor masked = ctx->saved_data["has_mask"].toBool()
                                     ? ctx->saved_data["masked"].toTensor()
                                     : torch::Tensor();
    const AttentionCore c{ctx->saved_data["scale"].toDouble(), ctx->saved_data["upcast"].toBool(),
                          static_cast<torch::ScalarType>(ctx->saved_data["dtype"].toInt())};
    const compat::AutocastRestore autocast(
        qh.device().type(),
        {ctx->saved_data["autocast"].toBool(),
         static_cast<torch::ScalarType>(ctx->saved_data["autocast_dtype"].toInt())});
    const torch::Tensor dout = grads[0].contiguous();
    const int64_t BH = qh.size(0), N = qh.size(1);
    const AttentionChunks chunks = attention_chunks_of(BH, N, kh.size(1));
    std::vector<torch::Tensor> dqs, dks, dvs;
    for (int64_t h = 0; h < BH; h += chunks.heads) {
      const int64_t nh = std::min(chunks.heads, BH - h);
      const torch::Tensor qs = qh.narrow(0, h, nh), ks = kh.narrow(0, h, nh);
      const torch::Tensor vs = vh.narrow(0, h, nh), gs = dout.narrow(0, h, nh);
      const torch::Tensor kt = ks.transpose(1, 2), vt = vs.transpose(1, 2);
      const torch::Tensor m = mask_rows(masked, h, nh);
      // One head in query chunks sums its dK and dV over the chunks, in float32.
      const bool one = chunks.queries >= N;
      torch::Tensor dk, dv;
      std::vector<torch::Tensor> dq_rows;
      for (int64_t start = 0; start < N; start += chunks.queries) {
        const int64_t len = std::min(chunks.queries, N - start);
        const torch::Tensor q = qs.narrow(1, start, len);
        const torch::Tensor g = gs.narrow(1, start, len);
        // raw: bmm's dtype (bf16 under autocast even for float32 q and k); dp: the gradient of
        // the probabilities, out = bmm(probs, v).
        const torch::Tensor raw = torch::bmm(q, kt);
        const torch::Tensor dp = torch::bmm(g, vt);
        torch::Tensor probs, ds;
        if (bf16_softmax(raw, c))
          std::tie(probs, ds) = attention_softmax_backward_bf16(raw, dp, c.scale, m);
        if (!probs.defined()) {
          const auto raw_dtype = raw.scalar_type();
          const torch::Tensor p = softmax_input(raw * c.scale, m, c).softmax(-1);
          probs = p.to(c.out_dtype);
          // p = softmax(scores); scores = [masked] [upcast] (raw * scale), in p's dtype
          ds = torch::_softmax_backward_data(dp.to(p.scalar_type()), p, -1, p.scalar_type());
          if (m.defined()) ds = ds.masked_fill(m, 0);
          ds = ds.to(raw_dtype) * c.scale;
        }
        const torch::Tensor dv_c = torch::bmm(probs.transpose(1, 2), g);
        dq_rows.push_back(torch::bmm(ds, ks));
        const torch::Tensor dk_c = torch::bmm(ds.transpose(1, 2), q);
        if (one) {
          dk = dk_c, dv = dv_c;
        } else if (!dk.defined()) {
          dk = dk_c.to(torch::kFloat), dv = dv_c.to(torch::kFloat);
        } else {
          dk.add_(dk_c);
          dv.add_(dv_c);
        }
      }
      dqs.push_back(dq_rows.size() == 1 ? dq_rows[0] : torch::cat(dq_rows, 1));
      dks.push_back(one ? dk : dk.to(kh.scalar_type()));
      dvs.push_back(one ? dv : dv.to(vh.scalar_type()));
    }
    const auto join = [](const std::vector<torch::Tensor>& t) {
      return t.size() == 1 ? t[0] : torch::cat(t, 0);
    };
    const torch::Tensor dq = join(dqs), dk_one = join(dks), dv_one = join(dvs);
    return {dq, dk_one, dv_one, torch::Tensor(), torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};

}  // namespace

torch::Tensor attention_core(const torch::Tensor& qh, const torch::Tensor& kh,
                             const torch::Tensor& vh, const torch::Tensor& key_mask,
                             const AttentionCore& c) {
  TORCH_CHECK(qh.dim() == 3 && kh.dim() == 3 && vh.dim() == 3 && qh.size(0) == kh.size(0) &&
                  kh.sizes() == vh.sizes() && qh.size(2) == kh.size(2),
              "attention_core: q must be [BH, N, d] and k, v [BH, S, d], got ", qh.sizes(), ", ",
              kh.sizes(), ", ", vh.sizes());
  torch::Tensor masked;  // [BH or 1, 1, S], true where a key is masked out
  if (key_mask.defined()) {
    const int64_t BH = qh.size(0), S = kh.size(1);
    TORCH_CHECK(key_mask.dim() == 2 && key_mask.size(1) == S && BH % key_mask.size(0) == 0,
                "attention_core: key_mask must be [B, ", S, "] with B dividing ", BH, ", got ",
                key_mask.sizes());
    const int64_t B = key_mask.size(0);
    masked = key_mask.to(torch::kBool)
                 .logical_not()
                 .view({B, 1, 1, S})
                 .expand({B, BH / B, 1, S})
                 .reshape({BH, 1, S});
  }
  const bool grad = torch::GradMode::is_enabled() &&
                    (qh.requires_grad() || kh.requires_grad() || vh.requires_grad());
  if (!grad) return attention_chunks(qh, kh, vh, masked, c);
  return RecomputedAttention::apply(qh, kh, vh, MaskArg{masked}, c.scale, c.upcast_softmax,
                                    static_cast<int64_t>(c.out_dtype));
}

torch::Tensor multi_head_attention(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, int64_t heads, bool upcast_attention,
                                   bool upcast_softmax, const torch::Tensor& key_mask) {
  const int64_t B = q.size(0), N = q.size(1), S = k.size(1), inner = q.size(2);
  TORCH_CHECK(inner % heads == 0, "attention width ", inner, " is not a multiple of ", heads,
              " heads");
  const int64_t d = inner / heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // float32 on the CPU: one fused kernel on the projected layout (upcasting is a no-op there).
  if (!key_mask.defined()) {
    if (torch::Tensor fused = fused_attention(q, k, v, heads, scale); fused.defined()) return fused;
  }
  // [B, N, h*d] -> [B*h, N, d], as Diffusers' head_to_batch_dim; dense (for B = 1 the reshape is a
  // strided view, which every product of attention_core would copy again, forward and backward).
  auto split = [&](const torch::Tensor& t, int64_t len) {
    return t.reshape({B, len, heads, d})
        .permute({0, 2, 1, 3})
        .reshape({B * heads, len, d})
        .contiguous();
  };
  torch::Tensor qh = split(q, N), kh = split(k, S), vh = split(v, S);
  const auto out_dtype = qh.scalar_type();
  if (upcast_attention) {
    qh = qh.to(torch::kFloat32);
    kh = kh.to(torch::kFloat32);
  }
  torch::Tensor out = attention_core(qh, kh, vh, key_mask, {scale, upcast_softmax, out_dtype});
  // [B*h, N, d] -> [B, N, h*d], Diffusers' batch_to_head_dim.
  return out.reshape({B, heads, N, d}).permute({0, 2, 1, 3}).reshape({B, N, inner});
}

AttentionImpl::AttentionImpl(const AttentionOptions& o) : options(o) {
  const int64_t inner = o.heads() * o.dim_head();
  const int64_t kv_dim = o.cross_attention_dim() > 0 ? o.cross_attention_dim() : o.query_dim();
  if (o.norm_num_groups() > 0) {
    group_norm_ = register_module(
        "group_norm",
        torch::nn::GroupNorm(torch::nn::GroupNormOptions(o.norm_num_groups(), o.query_dim())
                                 .eps(o.eps())
                                 .affine(true)));
  }
  to_q_ = register_module("to_q",
                          Linear(torch::nn::LinearOptions(o.query_dim(), inner).bias(o.bias())));
  to_k_ = register_module("to_k", Linear(torch::nn::LinearOptions(kv_dim, inner).bias(o.bias())));
  to_v_ = register_module("to_v", Linear(torch::nn::LinearOptions(kv_dim, inner).bias(o.bias())));
  to_out_ = register_module("to_out", torch::nn::ModuleList());
  to_out_->push_back(Linear(torch::nn::LinearOptions(inner, o.query_dim()).bias(o.out_bias())));
  to_out_->push_back(torch::nn::Dropout(o.dropout()));
}

torch::Tensor AttentionImpl::forward_impl(const torch::Tensor& x, const torch::Tensor& context) {
  torch::Tensor residual = x;
  torch::Tensor h = x;
  const bool spatial = x.dim() == 4;
  int64_t B = 0, C = 0, H = 0, W = 0;
  if (spatial) {
    B = x.size(0), C = x.size(1), H = x.size(2), W = x.size(3);
    // A view for contiguous and channels-last maps alike ([B, N, C] is then contiguous).
    h = x.flatten(2).transpose(1, 2);
  }
  TORCH_CHECK(h.dim() == 3, "Attention expects [B, N, C] or [B, C, H, W], got ", x.sizes());
  if (!group_norm_.is_empty()) {
    const auto& gn = group_norm_->options;
    h = group_norm_silu(h.transpose(1, 2), gn.num_groups(), group_norm_->weight, group_norm_->bias,
                        gn.eps(), /*silu=*/false)
            .transpose(1, 2);
  }
  // One copy into [B, N, C] rows: on a transposed view LibTorch's linear falls back to matmul's
  // batched path, which expands the weight and runs one small GEMM per sample (forward and both
  // backward products), three times over (to_q, to_k, to_v).
  if (!h.is_contiguous()) h = h.contiguous();
  if (options.cross_attention_dim() > 0) {
    TORCH_CHECK(context.defined(), "cross-attention needs encoder_hidden_states [B, S, ",
                options.cross_attention_dim(), "]");
    TORCH_CHECK(context.dim() == 3 && context.size(0) == h.size(0) &&
                    context.size(2) == options.cross_attention_dim(),
                "encoder_hidden_states must be [B=", h.size(0), ", S, ",
                options.cross_attention_dim(), "], got ", context.sizes());
  }
  const torch::Tensor& kv_in = options.cross_attention_dim() > 0 ? context : h;
  torch::Tensor out = multi_head_attention(to_q_(h), to_k_(kv_in), to_v_(kv_in), options.heads(),
                                           options.upcast_attention(), options.upcast_softmax());
  out = to_out_->ptr<LinearImpl>(0)->forward(out);
  out = maybe_dropout(out, options.dropout(), is_training());
  if (spatial) out = out.transpose(-1, -2).reshape({B, C, H, W});
  if (options.residual_connection()) out = out + residual;
  if (options.rescale_output_factor() != 1.0) out = out / options.rescale_output_factor();
  return out;
}

// ------------------------------------------------------------------ FeedForward

FeedForwardImpl::FeedForwardImpl(int64_t dim, std::string activation_fn, int64_t mult,
                                 double dropout)
    : activation_fn_(std::move(activation_fn)), dropout_(dropout) {
  const int64_t inner = dim * mult;
  int64_t proj_out = inner;
  if (activation_fn_ == "geglu") {
    proj_out = 2 * inner;
  } else if (activation_fn_ != "gelu" && activation_fn_ != "gelu-approximate" &&
             activation_fn_ != "geglu-approximate") {
    throw Error("unknown feed-forward activation \"" + activation_fn_ +
                "\"; supported: geglu, gelu, gelu-approximate, geglu-approximate");
  }
  // net.0 is the activation module holding `proj`, net.1 dropout, net.2 the output Linear.
  auto net = register_module("net", torch::nn::ModuleList());
  auto act = std::make_shared<torch::nn::Module>("GEGLU");
  proj_ = act->register_module("proj", Linear(dim, proj_out));
  net->push_back(act);
  net->push_back(torch::nn::Dropout(dropout));
  out_ = Linear(inner, dim);
  net->push_back(out_);
}

torch::Tensor FeedForwardImpl::forward(const torch::Tensor& x) {
  torch::Tensor h = proj_(x);
  if (activation_fn_ == "geglu") {
    auto parts = h.chunk(2, -1);
    h = parts[0] * models::gelu(parts[1]);
  } else if (activation_fn_ == "gelu") {
    h = models::gelu(h);
  } else if (activation_fn_ == "gelu-approximate") {
    h = models::gelu(h, /*tanh_approximation=*/true);
  } else {
    h = h * torch::sigmoid(1.702 * h);
  }
  h = maybe_dropout(h, dropout_, is_training());
  return out_(h);
}

// ------------------------------------------------------------------ BasicTransformerBlock

BasicTransformerBlockImpl::BasicTransformerBlockImpl(int64_t dim, int64_t heads, int64_t dim_head,
                                                     int64_t cross_attention_dim,
                                                     bool only_cross_attention,
                                                     bool upcast_attention, bool attention_bias,
                                                     double dropout)
    : only_cross_attention_(only_cross_attention) {
  auto ln = [&] { return torch::nn::LayerNorm(torch::nn::LayerNormOptions({dim}).eps(1e-5)); };
  norm1_ = register_module("norm1", ln());
  attn1_ = register_module(
      "attn1", Attention(AttentionOptions(dim, heads, dim_head)
                             .cross_attention_dim(only_cross_attention ? cross_attention_dim : 0)
                             .bias(attention_bias)
                             .upcast_attention(upcast_attention)
                             .dropout(dropout)));
  if (cross_attention_dim > 0) {
    norm2_ = register_module("norm2", ln());
    attn2_ = register_module("attn2", Attention(AttentionOptions(dim, heads, dim_head)
                                                    .cross_attention_dim(cross_attention_dim)
                                                    .bias(attention_bias)
                                                    .upcast_attention(upcast_attention)
                                                    .dropout(dropout)));
  }
  norm3_ = register_module("norm3", ln());
  ff_ = register_module("ff", FeedForward(dim, "geglu", 4, dropout));
}

torch::Tensor BasicTransformerBlockImpl::forward(torch::Tensor x, const torch::Tensor& context) {
  x = attn1_(norm1_(x), only_cross_attention_ ? context : torch::Tensor()) + x;
  if (!attn2_.is_empty()) x = attn2_(norm2_(x), context) + x;
  return ff_(norm3_(x)) + x;
}

// ------------------------------------------------------------------ Transformer2DModel

Transformer2DModelImpl::Transformer2DModelImpl(int64_t heads, int64_t dim_head, int64_t in_channels,
                                               int64_t num_layers, int64_t cross_attention_dim,
                                               int64_t norm_num_groups, bool use_linear_projection,
                                               bool only_cross_attention, bool upcast_attention,
                                               double dropout)
    : use_linear_projection_(use_linear_projection) {
  const int64_t inner = heads * dim_head;
  norm_ = register_module(
      "norm",
      torch::nn::GroupNorm(
          torch::nn::GroupNormOptions(norm_num_groups, in_channels).eps(1e-6).affine(true)));
  if (use_linear_projection) {
    proj_in_linear_ = register_module("proj_in", Linear(in_channels, inner));
  } else {
    proj_in_conv_ =
        register_module("proj_in", Conv2d(torch::nn::Conv2dOptions(in_channels, inner, 1)));
  }
  transformer_blocks_ = register_module("transformer_blocks", torch::nn::ModuleList());
  for (int64_t i = 0; i < num_layers; ++i) {
    transformer_blocks_->push_back(BasicTransformerBlock(inner, heads, dim_head,
                                                         cross_attention_dim, only_cross_attention,
                                                         upcast_attention, false, dropout));
  }
  if (use_linear_projection) {
    proj_out_linear_ = register_module("proj_out", Linear(inner, in_channels));
  } else {
    proj_out_conv_ =
        register_module("proj_out", Conv2d(torch::nn::Conv2dOptions(inner, in_channels, 1)));
  }
}

torch::Tensor Transformer2DModelImpl::forward_impl(const torch::Tensor& x,
                                                   const torch::Tensor& context) {
  TORCH_CHECK(x.dim() == 4, "Transformer2DModel expects [B, C, H, W], got ", x.sizes());
  const int64_t B = x.size(0), H = x.size(2), W = x.size(3);
  torch::Tensor h = norm_(x);
  int64_t inner = 0;
  if (use_linear_projection_) {
    inner = h.size(1);
    h = h.permute({0, 2, 3, 1}).reshape({B, H * W, inner});
    h = proj_in_linear_(h);
    inner = h.size(2);
  } else {
    h = proj_in_conv_(h);
    inner = h.size(1);
    h = h.permute({0, 2, 3, 1}).reshape({B, H * W, inner});
  }
  for (const auto& block : *transformer_blocks_) {
    h = block->as<BasicTransformerBlockImpl>()->forward(h, context);
  }
  if (use_linear_projection_) {
    h = proj_out_linear_(h);
    h = h.reshape({B, H, W, -1}).permute({0, 3, 1, 2}).contiguous();
  } else {
    h = h.reshape({B, H, W, inner}).permute({0, 3, 1, 2}).contiguous();
    h = proj_out_conv_(h);
  }
  return h + x;
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& x, const torch::Tensor& context) {
  core::ForwardScope scope(*this);
  return scope.output(forward_impl(x, context));
}

torch::Tensor Transformer2DModelImpl::forward(const torch::Tensor& x,
                                              const torch::Tensor& context) {
  core::ForwardScope scope(*this);
  return scope.output(forward_impl(x, context));
}

}  // namespace difftrain::models
