#pragma once
// 3x3 stride-1 convolutions through oneDNN's Winograd F(4x4, 3x3) kernels, forward and both
// backwards, for float32 CPU tensors. A Winograd convolution does about a quarter of the
// multiplications of a direct one; on an AVX-512 CPU it halves the time of a UNet's 3x3 layers
// (docs/PERFORMANCE.md). LibTorch calls oneDNN's direct algorithm only.
//
// Results differ from a direct convolution by float rounding (relative 1e-6 to 1e-5 per layer;
// tests/unit/winograd_conv_test.cpp checks against float64), so Conv2d takes this path only in a
// training step: grad mode on, or inside a checkpointed function
// (models/linear.cpp). no_grad inference and sampling keep LibTorch's direct
// convolution, whose numbers match Diffusers'.
//
// Available where difftrain was built with oneDNN (Debian's libdnnl-dev) and oneDNN has a Winograd
// implementation for this CPU: oneDNN 2.x (Debian 12, LibTorch 1.13) on AVX-512 CPUs; oneDNN 3.x
// (Debian 13, LibTorch 2.6) has no f32 Winograd kernels, so there the path always declines. On by
// default where available; DIFFTRAIN_WINOGRAD=0 in the
// environment (or set_winograd_conv_enabled(false)) turns it off.
#include <torch/types.h>

#include <string>

namespace difftrain::models {

/// Whether this build and CPU can run oneDNN's Winograd convolution (probed once).
bool winograd_conv_available();
/// Whether Conv2d uses it: available, and not turned off (DIFFTRAIN_WINOGRAD=0).
bool winograd_conv_enabled();
/// Overrides DIFFTRAIN_WINOGRAD for this process (tests, benchmarks).
void set_winograd_conv_enabled(bool enabled);
/// Whether ResnetBlock2D may keep the activations between its two convolutions in the Winograd
/// kernels' blocked layout where they take the Winograd path (fewer conversions, same maths to
/// float rounding): on by default; DIFFTRAIN_WINOGRAD_BLOCKED=0 in the environment turns it off.
bool winograd_blocked_layout_enabled();
/// Overrides DIFFTRAIN_WINOGRAD_BLOCKED for this process (tests, benchmarks).
void set_winograd_blocked_layout_enabled(bool enabled);
/// One line for `difftrain env` and logs: "oneDNN 2.6.3, Winograd: on" or why it is off.
std::string winograd_conv_status();

/// conv2d(x, weight, bias, stride 1, padding, dilation 1, groups 1) by Winograd F(4x4, 3x3).
/// x: [N, C, H, W] float32 CPU; weight: [O, C, 3, 3]; bias: [O] or undefined; padding 0 or 1 ->
/// [N, O, H + 2 padding - 2, W + 2 padding - 2], differentiable in x, weight and bias.
/// C and O must be multiples of 16 (oneDNN's vector width; others would be padded up and run
/// slower than the direct algorithm). Returns an undefined tensor when the path does not apply
/// (not enabled, other dtype or device, other geometry or channel counts); the caller then uses
/// torch::conv2d.
///
/// x_blocked / y_blocked: the input / output (and so its gradient) is in oneDNN's blocked layout
/// nChw16c, the one its kernels compute in, as a [N, C / 16, H, W, 16] tensor (channel c at
/// [n, c / 16, h, w, c % 16]): a caller whose neighbouring ops work in that layout too
/// (group_norm_silu_blocked) saves the conversions a plain tensor costs on each side.
torch::Tensor winograd_conv2d(const torch::Tensor& x, const torch::Tensor& weight,
                              const torch::Tensor& bias, int64_t padding, bool x_blocked = false,
                              bool y_blocked = false);

/// Whether winograd_conv2d applies to an input of these (plain [N, C, H, W]) sizes with this
/// weight, bias and padding: enabled, float32 CPU, geometry and a oneDNN kernel for it.
bool winograd_conv_applies(torch::IntArrayRef x_sizes, const torch::Tensor& weight,
                           const torch::Tensor& bias, int64_t padding);

/// conv2d(x, weight, bias) of a 1x1, stride-1, unpadded layer (a ResnetBlock2D's conv_shortcut)
/// with input and output in the blocked layout: x [N, C / 16, H, W, 16], weight [O, C, 1, 1],
/// bias [O] or undefined -> [N, O / 16, H, W, 16], differentiable in all three; oneDNN's direct
/// 1x1 kernel, so the numbers are a direct convolution's. Undefined where it does not apply
/// (pointwise_conv_blocked_applies).
torch::Tensor pointwise_conv2d_blocked(const torch::Tensor& x, const torch::Tensor& weight,
                                       const torch::Tensor& bias);
/// Whether pointwise_conv2d_blocked applies to an input of these plain sizes ([N, C, H, W]): the
/// Winograd path enabled (it is the blocked layout's switch too), float32 CPU, a 1x1 weight and
/// channel counts that are multiples of 16.
bool pointwise_conv_blocked_applies(torch::IntArrayRef x_sizes, const torch::Tensor& weight,
                                    const torch::Tensor& bias);

/// [N, C, H, W] -> [N, C / 16, H, W, 16] (the blocked layout above; C a multiple of 16) and back,
/// differentiable, by oneDNN's reorder (LibTorch's strided copy in a build without oneDNN).
torch::Tensor to_channel_blocks(const torch::Tensor& x);
torch::Tensor from_channel_blocks(const torch::Tensor& x);
/// to_channel_blocks(torch::cat({a, b}, 1)) without writing the plain concatenation: each
/// [N, C_i, H, W] part (C_i a multiple of 16, one N, H, W) is converted straight into its channel
/// blocks of the result; differentiable in both.
torch::Tensor cat_to_channel_blocks(const torch::Tensor& a, const torch::Tensor& b);

}  // namespace difftrain::models
