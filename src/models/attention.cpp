#include "difftrain/models/attention.h"

#include "difftrain/core/error.h"
#include "difftrain/models/kernels/fused_ops.h"
#include "difftrain/models/layers.h"

#include <torch/nn/functional/activation.h>
#include <torch/nn/functional/dropout.h>
#include <torch/nn/modules/dropout.h>

#include <algorithm>
#include <cmath>

namespace difftrain::models {

namespace F = torch::nn::functional;

namespace {

torch::Tensor maybe_dropout(const torch::Tensor& x, double p, bool training) {
  if (p <= 0 || !training) return x;
  return F::dropout(x, F::DropoutFuncOptions().p(p).training(true));
}

}  // namespace

// ------------------------------------------------------------------ Attention

torch::Tensor multi_head_attention(const torch::Tensor& q, const torch::Tensor& k,
                                   const torch::Tensor& v, int64_t heads, bool upcast_attention,
                                   bool upcast_softmax) {
  const int64_t B = q.size(0), N = q.size(1), S = k.size(1), inner = q.size(2);
  TORCH_CHECK(inner % heads == 0, "attention width ", inner, " is not a multiple of ", heads,
              " heads");
  const int64_t d = inner / heads;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  // float32 on the CPU: one fused kernel on the projected layout (upcasting is a no-op there).
  if (torch::Tensor fused = fused_attention(q, k, v, heads, scale); fused.defined()) return fused;
  // [B, N, h*d] -> [B*h, N, d], as Diffusers' head_to_batch_dim.
  auto split = [&](const torch::Tensor& t, int64_t len) {
    return t.reshape({B, len, heads, d}).permute({0, 2, 1, 3}).reshape({B * heads, len, d});
  };
  torch::Tensor qh = split(q, N), kh = split(k, S), vh = split(v, S);
  const auto out_dtype = qh.scalar_type();
  if (upcast_attention) {
    qh = qh.to(torch::kFloat32);
    kh = kh.to(torch::kFloat32);
  }
  torch::Tensor kt = kh.transpose(1, 2);
  // Chunk the queries so the [B*h, chunk, S] score matrix stays near 64 MiB (4 bytes each).
  const int64_t budget = int64_t{16} << 20;
  const int64_t chunk =
      std::max<int64_t>(1, std::min<int64_t>(N, budget / std::max<int64_t>(1, B * heads * S)));
  std::vector<torch::Tensor> outs;
  for (int64_t start = 0; start < N; start += chunk) {
    const int64_t len = std::min(chunk, N - start);
    // bmm then the scale: LibTorch 1.13's CPU baddbmm with beta = 0 reads its uninitialised
    // input on some small bf16 / float64 shapes (NaN scores).
    torch::Tensor scores = torch::bmm(qh.narrow(1, start, len), kt) * scale;
    if (upcast_softmax) scores = scores.to(torch::kFloat32);
    torch::Tensor probs = scores.softmax(-1).to(out_dtype);
    outs.push_back(torch::bmm(probs, vh));
  }
  torch::Tensor out = outs.size() == 1 ? outs[0] : torch::cat(outs, 1);
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
