#pragma once
// Block-wise dynamic 8-bit quantisation (bitsandbytes' `quantize_blockwise` with its "dynamic"
// code maps), used for AdamW8bit's optimizer state.

#include <torch/types.h>

#include <array>
#include <cstdint>

namespace difftrain::optim {

/// Elements per quantisation block (one fp32 absmax each), as bitsandbytes' 8-bit optimizers.
constexpr int64_t kQuantBlockSize = 2048;

/// The 256 sorted values of bitsandbytes' `create_dynamic_map(signed)` (max_exponent_bits 7):
/// a dynamic exponent from 1e-7 to 1 with the remaining bits as a linear fraction; includes 0
/// and 1. Signed spans [-0.993, 1] (first moment), unsigned [0, 1] (second moment).
const std::array<float, 256>& dynamic_code_map(bool is_signed);

/// The index of the code nearest to `x` (already divided by its block's absmax).
uint8_t quantize_nearest(float x, bool is_signed);

/// Codes [same shape as x, uint8] and absmax [ceil(numel / block), float].
struct QuantizedBlocks {
  torch::Tensor codes;
  torch::Tensor absmax;
};

/// Quantises a float tensor block by block: absmax = max |x| of the block, code = nearest map
/// value to x / absmax (a block of zeros keeps absmax 0). bitsandbytes:
/// `quantize_blockwise(x, code=create_dynamic_map(signed), blocksize=block)`.
QuantizedBlocks quantize_blockwise(const torch::Tensor& x, bool is_signed,
                                   int64_t block = kQuantBlockSize);

/// code[codes] × absmax of the block, as float32 shaped like codes.
torch::Tensor dequantize_blockwise(const QuantizedBlocks& q, bool is_signed,
                                   int64_t block = kQuantBlockSize);

}  // namespace difftrain::optim
