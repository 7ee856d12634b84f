#pragma once
// The CPU float32 kernels behind models/fused_ops.h, compiled twice from fused_kernels_impl.h:
// once for the build's baseline CPU (namespace generic) and, where the compiler and Sleef allow,
// with AVX2 + FMA (namespace avx2, fused_kernels_avx2.cpp). fused_ops.cpp picks one at run time
// from the CPU's features. Every pointer is a dense float32 buffer (GELU: float32 or bf16);
// shapes are stated per function.
#include <cstdint>

namespace difftrain::models::kernels {

/// Multi-head attention on the projected layout, heads side by side as Diffusers' to_q output:
/// q: [B, N, heads*d], k, v: [B, S, heads*d], o: [B, N, heads*d], lse: [B, heads, N] (the log of
/// each softmax row's normaliser, kept for the backward). o = softmax(scale q k^T) v per head.
struct AttentionShape {
  int64_t batch, queries, keys, heads, head_dim;
  float scale;
};

/// GroupNorm over x viewed as [N, C, L] (L = product of the spatial sizes). The memory is
/// [N, C, L] by default; [N, L, C] with channels_last (PyTorch's channels_last / a transposed
/// [B, L, C] sequence); [N, C / block, L, block] with block > 0 (oneDNN's nChw16c for block 16, the
/// layout its convolutions compute in; C a multiple of block). x, y, dy and dx share the layout.
struct GroupNormShape {
  int64_t batch, channels, length, groups;
  bool channels_last;
  float eps;
  bool silu;  ///< y = silu(group_norm(x)) instead of group_norm(x)
  int64_t block = 0;
};

/// A 3x3 stride-1 convolution with few output channels (a UNet's or VAE's conv_out: 1 to 4),
/// zero padding `pad` on every side: x [N, C, H, W], weight [O, C, 3, 3], y [N, O, H + 2 pad - 2,
/// W + 2 pad - 2]. oneDNN's direct kernels vectorise over output channels and reach a tenth of
/// their speed at O = 1; these vectorise along the rows instead.
struct SmallConvShape {
  int64_t batch, in_channels, out_channels, height, width, pad;
};

/// Attention's softmax over bf16 scores (a bmm's output, [heads, rows, cols] dense, as bits):
/// p = softmax(scale * scores) per row in float32, keys where mask[h * mask_head_stride + c] is
/// nonzero at exactly 0 (mask null: none; stride 0: one mask for every head).
struct AttentionSoftmaxShape {
  int64_t heads, rows, cols;
  float scale;
  const uint8_t* mask;
  int64_t mask_head_stride;
};

#define DIFFTRAIN_FUSED_KERNEL_DECLS                                                               \
  void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,  \
                         float* o, float* lse);                                                    \
  /* dq, dk, dv are overwritten. */                                                                \
  void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v, \
                          const float* o, const float* lse, const float* dout, float* dq,          \
                          float* dk, float* dv);                                                   \
  /* mean, rstd: [N, groups] */                                                                    \
  void group_norm_forward(const GroupNormShape& s, const float* x, const float* gamma,             \
                          const float* beta, float* y, float* mean, float* rstd);                  \
  /* dx: [N, C, L] in x's layout; dgamma, dbeta: [C] (overwritten); dx_add: null, or (blocked */   \
  /* layout of 16 only) a gradient in x's layout added to dx in the last pass                  */  \
  void group_norm_backward(const GroupNormShape& s, const float* dy, const float* x,               \
                           const float* mean, const float* rstd, const float* gamma,               \
                           const float* beta, float* dx, float* dgamma, float* dbeta,              \
                           const float* dx_add);                                                   \
  /* bias may be null */                                                                           \
  void small_conv_forward(const SmallConvShape& s, const float* x, const float* weight,            \
                          const float* bias, float* y);                                            \
  /* gx: [N, C, H, W], overwritten */                                                              \
  void small_conv_backward_data(const SmallConvShape& s, const float* gy, const float* weight,     \
                                float* gx);                                                        \
  /* gw: [O, C, 3, 3], gb: [O] or null, overwritten */                                             \
  void small_conv_backward_weights(const SmallConvShape& s, const float* gy, const float* x,       \
                                   float* gw, float* gb);                                          \
  /* y = gelu(x) over n values: float32, or bf16 (their bits) when bf16; computed in float32,  */  \
  /* rounded once; the tanh approximation or the exact (erf) form                              */  \
  void gelu_forward(const void* x, void* y, int64_t n, bool bf16, bool tanh_approximation);        \
  /* dx = dy * gelu'(x), the same dtypes                                                       */  \
  void gelu_backward(const void* dy, const void* x, void* dx, int64_t n, bool bf16,                \
                     bool tanh_approximation);                                                     \
  /* probs: p rounded to bf16 */                                                                   \
  void attention_softmax_bf16(const AttentionSoftmaxShape& s, const uint16_t* raw,                 \
                              uint16_t* probs);                                                    \
  /* recomputes p from raw; probs as above, ds = scale * p (dp - sum(p dp)) per row, in bf16 */    \
  void attention_softmax_backward_bf16(const AttentionSoftmaxShape& s, const uint16_t* raw,        \
                                       const uint16_t* dp, uint16_t* probs, uint16_t* ds);

namespace generic {
DIFFTRAIN_FUSED_KERNEL_DECLS
}  // namespace generic

#ifdef DIFFTRAIN_HAVE_AVX2_KERNELS
namespace avx2 {
DIFFTRAIN_FUSED_KERNEL_DECLS
}  // namespace avx2
#endif

#undef DIFFTRAIN_FUSED_KERNEL_DECLS

}  // namespace difftrain::models::kernels
