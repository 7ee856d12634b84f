#pragma once
// The IDX format of LeCun's MNIST files (and Fashion-MNIST, KMNIST, EMNIST): a 4-byte magic
// 0x00 0x00 <dtype code> <ndim>, ndim big-endian int32 sizes, then the values in row-major order.

#include <torch/types.h>

#include <cstdint>
#include <functional>
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

/// read_idx of a gzip-compressed file through an uncompressed copy in `cache_dir` (Hugging Face
/// `datasets` keeps decoded copies the same way): the first read decompresses and checks the file
/// with read_idx and writes the copy atomically (a temporary file renamed into place); later reads
/// take the copy, about 4x faster for Fashion-MNIST's 47 MB of images. The copy's name holds the
/// file's name and a hash of its absolute path, size and modification time, so a changed file gets
/// a new copy. Raw files and an empty `cache_dir` are read directly; a copy that cannot be written
/// or read back is skipped (and a bad one removed), never an error. `note`, when given, gets one
/// line when a copy is written or cannot be.
torch::Tensor read_idx_cached(const std::string& path, const std::string& cache_dir,
                              const std::function<void(const std::string&)>& note = {});

}  // namespace difftrain::data
