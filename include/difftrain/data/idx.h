#pragma once
// The IDX format of LeCun's MNIST files (and Fashion-MNIST, KMNIST, EMNIST): a 4-byte magic
// 0x00 0x00 <dtype code> <ndim>, ndim big-endian int32 sizes, then the values in row-major order.

#include <torch/types.h>

#include <cstdint>
#include <string>

namespace difftrain::data {

/// The largest IDX payload read_idx accepts (2 GiB); MNIST's biggest file holds 47 MB.
constexpr int64_t kMaxIdxBytes = int64_t{1} << 31;

/// Reads an IDX file of unsigned bytes (dtype code 0x08), gzip-compressed (`.gz`, detected by
/// its magic bytes 1f 8b, not by the name) or raw: uint8 [d0, d1, ...] with the file's ndim
/// dimensions, e.g. [N] for labels and [N, H, W] for images (torchvision's `read_sn3_pascalvincent
/// _tensor`). Every size is checked against the bytes actually present before memory is
/// allocated. Throws a difftrain::Error naming the path for a missing file, a file that is not
/// IDX, another dtype, a payload over kMaxIdxBytes, corrupt gzip data, and a truncated file or
/// one with bytes after the data.
torch::Tensor read_idx(const std::string& path);

}  // namespace difftrain::data
