#pragma once
// 8-bit storage of a frozen layer's weight (kohya's --fp8_base, ai-toolkit's `quantize`): int8
// (symmetric, one float32 scale per output channel: scale = max|w_row| / 127) or, where the
// LibTorch has float8 (2.1+), float8_e4m3fn (scale = max|w_row| / 448). The layer's forward and
// its input gradient dequantize the weight for that call only; autograd keeps the 8-bit tensor
// and the scales, never a dequantized copy, so a model never holds more than one layer's weight in
// the compute dtype at a time. The weight itself gets no gradient (it is frozen: LoRA trains on
// top of it). models::Linear and models::Conv2d (linear.h) store their weight this way after
// quantize_weight(); quantize_frozen_weights() does it for a whole model.

#include <torch/nn/module.h>
#include <torch/types.h>

#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::models {

/// How a frozen weight is stored.
enum class WeightStorage {
  kDense,       ///< as loaded (bf16 / fp32)
  kInt8,        ///< int8 + per-output-channel float32 scale
  kFloat8E4M3,  ///< float8_e4m3fn + per-output-channel float32 scale (LibTorch 2.1+)
};

/// "bf16"/"fp32"/"none" (dense), "int8", "fp8_e4m3" (also "float8_e4m3fn"); throws
/// difftrain::Error naming `flag` and the choices, or saying float8 needs LibTorch 2.1+.
WeightStorage parse_weight_storage(const std::string& name, const std::string& flag);
std::string to_string(WeightStorage storage);
/// Whether this LibTorch has float8_e4m3fn.
bool float8_available();

/// Layers with fewer weights than this, or fewer than kMinQuantizedFanIn per output channel, stay
/// as they are: they save under 1 KiB, or their float32 scales would cost a quarter or more of
/// what 8 bits save on a bf16 row, for a per-call dequantization and the precision lost. Every
/// Linear and Conv of FLUX.1, SD and SDXL is above both.
inline constexpr int64_t kMinQuantizedWeights = 1024;
inline constexpr int64_t kMinQuantizedFanIn = 16;

/// The size rule: whether a frozen weight of `numel` elements in `out` output channels is stored
/// in 8 bits.
inline bool quantizes(int64_t numel, int64_t out) {
  return numel >= kMinQuantizedWeights && out > 0 && numel / out >= kMinQuantizedFanIn;
}

/// Bytes such a weight takes stored as `storage`: numel + 4·out (the scales) where the rule
/// quantizes it, else numel·dense_bytes (estimate-memory's count).
inline int64_t stored_weight_bytes(int64_t numel, int64_t out, WeightStorage storage,
                                   int64_t dense_bytes) {
  if (storage == WeightStorage::kDense || !quantizes(numel, out)) return numel * dense_bytes;
  return numel + 4 * out;
}

/// An 8-bit weight and its scales.
struct QuantizedWeight {
  torch::Tensor q;                       ///< the weight's shape, int8 or float8_e4m3fn
  torch::Tensor scale;                   ///< [out] float32
  torch::Dtype dtype = torch::kFloat32;  ///< what dequantize() gives: the weight's former dtype

  bool defined() const { return q.defined(); }
  /// q * scale (per output channel) in `dtype` (computed in float32, rounded once).
  torch::Tensor dequantize() const;
  /// Bytes held: q and the scales.
  int64_t bytes() const;
};

/// Quantizes `w` ([out, ...], any floating dtype) to `storage` (kInt8 or kFloat8E4M3). A row of
/// zeros gets scale 1.
QuantizedWeight quantize(const torch::Tensor& w, WeightStorage storage);

/// y = x W^T + b with W = w.dequantize() for this call (and again for the input gradient in
/// backward). Under autocast the matmul runs in the autocast dtype as a Linear's would.
torch::Tensor quantized_linear(const torch::Tensor& x, const QuantizedWeight& w,
                               const torch::Tensor& bias);

/// conv2d(x, W, b, stride, padding, dilation, groups) with W dequantized per call, likewise.
torch::Tensor quantized_conv2d(const torch::Tensor& x, const QuantizedWeight& w,
                               const torch::Tensor& bias, torch::IntArrayRef stride,
                               torch::IntArrayRef padding, torch::IntArrayRef dilation,
                               int64_t groups);

/// What quantize_frozen_weights() did.
struct QuantizeSummary {
  int64_t layers = 0;        ///< layers now 8-bit
  int64_t kept_dense = 0;    ///< frozen layers below the size rule
  int64_t weights = 0;       ///< weights now 8-bit
  int64_t bytes_before = 0;  ///< their bytes before
  int64_t bytes_after = 0;   ///< their bytes after (8-bit values + scales)
};

/// Stores the weight of every models::Linear and models::Conv2d in `model` whose weight does not
/// require grad and is not below kMinQuantizedWeights / kMinQuantizedFanIn as `storage` (kDense:
/// nothing).
/// Attach LoRA adapters before or after; the adapters and biases stay as they are.
QuantizeSummary quantize_frozen_weights(torch::nn::Module& model, WeightStorage storage);

/// Bytes held by the 8-bit weights and scales of the layers in `model` (counted nowhere else:
/// they are not parameters), and how many weights they hold.
int64_t quantized_weight_bytes(const torch::nn::Module& model);
int64_t quantized_weight_count(const torch::nn::Module& model);

/// Bytes `model`'s parameters would take with its Linear/Conv weights stored as `storage` (the
/// size rule) and every other parameter at `dense_bytes` each: estimate-memory's count of a
/// frozen model built from its config.
int64_t stored_model_bytes(const torch::nn::Module& model, WeightStorage storage,
                           int64_t dense_bytes);

}  // namespace difftrain::models
