#pragma once
// The input gradient of a frozen bf16 linear layer, g @ W, through oneDNN with W reordered for the
// call into the blocked layout its AVX-512 bf16 kernel reads.
//
// LibTorch hands oneDNN W in its plain [out, in] layout, which the kernel re-blocks as it goes:
// measured on an AVX-512-bf16 CPU (bench/flux_vs_diffusers.sh, docs/PERFORMANCE.md), the input
// gradient of FLUX.1's layers then runs 8-13% slower than the forward product of the same size.
// One reorder of W per call (about 10 ms for a 3072 x 12288 bf16 weight) buys that back from
// about 512 rows on: the LoRA step's base layers (every DiT family), whose weights do not train
// and whose backward computes only this product. Fewer rows, or no oneDNN kernel for the CPU:
// LibTorch's matmul, as before.
//
// Same maths as g.matmul(W) (bf16 products, float32 sums, a bf16 result), summed in another
// order: they differ by bf16 rounding (tests/unit/packed_matmul_test.cpp checks against float64).
// On by default where available; DIFFTRAIN_PACKED_GRAD=0 in the environment (or
// set_packed_linear_grad_enabled(false)) turns it off.
#include <torch/types.h>

#include <string>

namespace difftrain::models {

/// Rows (the product of g's leading sizes) from which the packed path is taken.
constexpr int64_t kPackedGradMinRows = 512;

/// Whether this build and CPU have oneDNN's bf16 matmul kernel that reads a packed weight
/// (probed once).
bool packed_linear_grad_available();
/// Available and not turned off (DIFFTRAIN_PACKED_GRAD=0).
bool packed_linear_grad_enabled();
/// Overrides DIFFTRAIN_PACKED_GRAD for this process (tests, benchmarks).
void set_packed_linear_grad_enabled(bool enabled);
/// One line for `difftrain env`: "packed linear gradients: on" or why they are off.
std::string packed_linear_grad_status();

/// Whether linear_input_grad takes the packed path for a gradient of `rows` rows of W's out
/// features, W [out, in]: enabled, both bf16 on the CPU, W contiguous, rows >= kPackedGradMinRows.
bool packed_linear_grad_applies(int64_t rows, const torch::Tensor& weight, torch::Dtype g_dtype);

/// How many products this process has run through the packed path (tests, benchmarks).
int64_t packed_linear_grad_calls();

/// g @ W: g [..., out], W [out, in] -> [..., in] in g's dtype; the packed path where it applies,
/// else g.matmul(W). Where autograd would record the product (grad mode on and g or W requiring
/// grad: a backward with create_graph) always g.matmul(W), which is differentiable.
torch::Tensor linear_input_grad(const torch::Tensor& g, const torch::Tensor& weight);

}  // namespace difftrain::models
