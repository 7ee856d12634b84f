#pragma once
// Fused CPU kernels for the UNet's hot spots, with their own backward: multi-head attention that
// never stores the [B*heads, N, S] probability matrix, and GroupNorm followed by SiLU in one pass.
// They run for float32 CPU tensors only (the GELU for bf16 ones); anything else (CUDA, bf16, fp16,
// float64) takes LibTorch's ops, so callers may call them unconditionally. The results equal
// LibTorch's to float rounding (tests/unit/fused_ops_test.cpp checks them against a float64
// recomputation).
//
// On by default; DIFFTRAIN_FUSED_KERNELS=0 in the environment (or set_fused_kernels_enabled(false))
// turns them off, for an A/B comparison or to rule them out; the same switch governs the DiT
// blocks' one-pass RoPE and RMSNorm (transformers/dit_blocks.h: float32, bf16 and fp16 there)
// and the bf16 GELU (fused_gelu, behind models::gelu).
#include <torch/nn/modules/normalization.h>
#include <torch/types.h>

#include <string>
#include <utility>

namespace difftrain::models {

/// Whether the fused kernels (and channels-last UNet activations on the CPU) are used.
bool fused_kernels_enabled();
/// Overrides DIFFTRAIN_FUSED_KERNELS for this process (tests, benchmarks).
void set_fused_kernels_enabled(bool enabled);
/// The instruction set the kernels were dispatched to on this CPU: "avx2" or "generic".
std::string fused_kernels_isa();

/// softmax(scale * q k^T) v per head, on Diffusers' projected layout (heads side by side):
/// q: [B, N, heads*d], k, v: [B, S, heads*d] -> [B, N, heads*d]. Differentiable in q, k and v.
/// Fused for float32 CPU tensors with heads of at most 64 channels; otherwise an undefined tensor
/// is returned and the caller uses its own path.
torch::Tensor fused_attention(const torch::Tensor& q, const torch::Tensor& k,
                              const torch::Tensor& v, int64_t heads, double scale);

/// gelu(x) (tanh approximation or exact) for a bf16 CPU tensor: one pass each way, computed in
/// float32 and rounded once (LibTorch 1.13's bf16 GELU is scalar and rounds every intermediate to
/// bf16; 2.x computes as this does). Differentiable in x. Undefined where it does not apply
/// (kernels off, another dtype or device): models::gelu then takes torch's.
torch::Tensor fused_gelu(const torch::Tensor& x, bool tanh_approximation);

/// Attention's softmax for bf16 scores on the CPU (attention_core's bf16 path): scores [n, rows, S]
/// contiguous (bmm(q, k^T), unscaled), masked [n or 1, 1, S] bool (true: masked) or undefined;
/// returns softmax(scale * scores) over S in bf16, computed in float32 and rounded once, masked
/// keys at 0. One pass where the tensor ops make six ([rows, S] each: the scaling, the float32
/// copy, the softmax, the bf16 copy). Not differentiable (attention_core's Function calls it).
/// Undefined where it does not apply (kernels off, another dtype, device or shape).
torch::Tensor attention_softmax_bf16(const torch::Tensor& scores, double scale,
                                     const torch::Tensor& masked);

/// Its backward with the probabilities recomputed from the same scores: {probs, dscores} where
/// probs is as above and dscores = scale * p (dprobs - sum(p dprobs)) per row (the gradient of
/// the unscaled scores), in bf16. dprobs: bf16 [n, rows, S]. Both undefined where it does not
/// apply.
std::pair<torch::Tensor, torch::Tensor> attention_softmax_backward_bf16(
    const torch::Tensor& scores, const torch::Tensor& dprobs, double scale,
    const torch::Tensor& masked);

/// group_norm(x, groups, weight, bias, eps), then silu when `silu`. x: [N, C, *] in contiguous or
/// channels-last memory (the output keeps x's layout); weight, bias: [C] or undefined.
/// Differentiable in x, weight and bias. Fused for float32 CPU tensors when enabled; otherwise
/// LibTorch's group_norm (and silu).
torch::Tensor group_norm_silu(const torch::Tensor& x, int64_t groups, const torch::Tensor& weight,
                              const torch::Tensor& bias, double eps, bool silu);

/// group_norm_silu on x in oneDNN's blocked channel layout (nChw16c), the layout the Winograd
/// convolutions compute in: x [N, C / 16, *, 16], channel c of [n, h, w] at [n, c / 16, h, w,
/// c % 16]; weight, bias: [C] or undefined. The output has x's layout; differentiable in x, weight
/// and bias. Undefined where the fused kernels do not apply (off, not float32 on the CPU).
torch::Tensor group_norm_silu_blocked(const torch::Tensor& x, int64_t groups,
                                      const torch::Tensor& weight, const torch::Tensor& bias,
                                      double eps, bool silu);

/// group_norm_silu_blocked(x, ...) and x itself, as {y, x'}: x' is x (a view) whose gradient
/// comes back to the GroupNorm's node, which adds it to its own input gradient in its last pass.
/// For an x with a second consumer (ResnetBlock2D: norm1 and the residual or shortcut): that
/// consumer takes x', and autograd's separate sum of the two gradients goes. Same numbers as
/// using x twice. Both undefined where group_norm_silu_blocked does not apply.
std::pair<torch::Tensor, torch::Tensor> group_norm_silu_blocked_pass_input(
    const torch::Tensor& x, int64_t groups, const torch::Tensor& weight, const torch::Tensor& bias,
    double eps, bool silu);

/// conv2d(x, weight, bias, stride 1, padding) for a 3x3 layer with 1 to 4 output channels (a
/// UNet's or VAE's conv_out), vectorised along the rows: x [N, C, H, W] float32 CPU, weight
/// [O, C, 3, 3], bias [O] or undefined, padding 0 or 1. Differentiable in x, weight and bias.
/// Undefined where it does not apply (kernels off, other dtype, device or geometry).
torch::Tensor small_out_conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                               const torch::Tensor& bias, int64_t padding);

/// The GroupNorm module `norm` applied to x, then the activation `act` (a name models::activation
/// knows, or "" for none): group_norm_silu when act is silu/swish or empty, so ResnetBlock2D's
/// `nonlinearity(norm(x))` is one fused pass. x: [N, C, *].
torch::Tensor group_norm_act(const torch::nn::GroupNormImpl& norm, const std::string& act,
                             const torch::Tensor& x);

/// Whether a UNet runs its activations in channels-last memory for this input: float32 on the
/// CPU with the fused kernels on and DIFFTRAIN_CHANNELS_LAST=1 (the fused GroupNorm keeps the
/// layout; LibTorch's own CPU GroupNorm would copy back to contiguous). Off by default: it did
/// not speed up a training step here (docs/PERFORMANCE.md).
bool use_channels_last(const torch::Tensor& sample);

/// x.contiguous() (x: [B, C, H, W] channels-last) whose backward hands the gradient on in
/// channels-last memory, so the network's backward stays channels-last too.
torch::Tensor leave_channels_last(const torch::Tensor& x);

}  // namespace difftrain::models
