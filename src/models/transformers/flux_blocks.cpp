#include "difftrain/models/transformers/flux_blocks.h"

#include "difftrain/models/layers.h"

#include <torch/torch.h>

namespace difftrain::models {

// ------------------------------------------------------------------ double-stream block

FluxTransformerBlockImpl::FluxTransformerBlockImpl(int64_t dim, int64_t heads, int64_t head_dim) {
  norm1_ = register_module("norm1", AdaLayerNormZero(dim, 6));
  norm1_context_ = register_module("norm1_context", AdaLayerNormZero(dim, 6));
  attn_ = register_module("attn", DiTAttention(dim, heads, head_dim, /*joint=*/true));
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
  auto [a_img, a_txt] = attn_(modulate(img, m[0], m[1]), modulate(txt, c[0], c[1]), rope);
  torch::Tensor h = img + m[2].unsqueeze(1) * a_img;
  h = h + m[5].unsqueeze(1) * ff_(modulate(h, m[3], m[4]));
  torch::Tensor e = txt + c[2].unsqueeze(1) * a_txt;
  e = e + c[5].unsqueeze(1) * ff_context_(modulate(e, c[3], c[4]));
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
  attn_ = register_module("attn", DiTAttention(dim, heads, head_dim, /*joint=*/false));
}

torch::Tensor FluxSingleTransformerBlockImpl::forward(const torch::Tensor& h,
                                                      const torch::Tensor& temb,
                                                      const RotaryTables& rope, int64_t keep_from) {
  core::ForwardScope scope(*this);
  const std::vector<torch::Tensor> m = norm_(temb);  // shift, scale, gate
  torch::Tensor n = modulate(h, m[0], m[1]);
  const int64_t rows = h.size(1) - keep_from;
  torch::Tensor kept = keep_from > 0 ? token_rows(n, keep_from, rows) : n;
  torch::Tensor mlp = gelu(proj_mlp_(kept), /*tanh_approximation=*/true);
  // Every row's keys and values; queries only for the kept rows.
  torch::Tensor a = attn_(n, torch::Tensor(), rope, torch::Tensor(), keep_from).first;
  torch::Tensor residual = keep_from > 0 ? h.narrow(1, keep_from, rows) : h;
  torch::Tensor out = residual + m[2].unsqueeze(1) * proj_out_(torch::cat({a, mlp}, 2));
  if (out.scalar_type() == torch::kFloat16) out = out.clamp(-65504, 65504);
  return scope.output(out);
}

}  // namespace difftrain::models
