#pragma once
// safetensors (https://github.com/huggingface/safetensors): difftrain's only tensor file format.
// Layout: u64 little-endian header length N, N bytes of JSON header
// {"name": {"dtype": "F32", "shape": [..], "data_offsets": [begin, end]}, ...,
//  "__metadata__": {"key": "value"}}, then the data buffer the offsets index.

#include <torch/types.h>

#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace difftrain::io {

/// Named tensors in key order, as read from or written to a safetensors file.
using TensorMap = std::map<std::string, torch::Tensor>;
/// The string-to-string `__metadata__` of a safetensors header.
using Metadata = std::map<std::string, std::string>;

/// What a safetensors file holds.
struct Safetensors {
  TensorMap tensors;
  Metadata metadata;
};

/// Reads `path` (memory-mapped; tensors share the mapping, copy-on-write, so writing to them
/// never touches the file). Validated strictly: header length within the file and ≤ 100 MiB,
/// well-formed JSON, known dtypes (F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL), shape × dtype size
/// equal to each byte range, ranges inside the data buffer, non-overlapping and covering it.
/// Any violation throws difftrain::Error naming the file and the tensor. Python:
/// `safetensors.torch.load_file(path)` plus `safe_open(path).metadata()`.
Safetensors load_safetensors(const std::string& path);

/// One tensor's entry in a safetensors header.
struct SafetensorsEntry {
  torch::Dtype dtype;
  std::vector<int64_t> shape;
};

/// What a safetensors file holds, from its header alone.
struct SafetensorsHeader {
  std::map<std::string, SafetensorsEntry> tensors;
  Metadata metadata;
};

/// Reads the header of `path` with load_safetensors()'s checks, without reading the tensors'
/// data (the file is mapped, and only the header's pages are touched). Python:
/// `safe_open(path).keys()` / `.get_slice(k).get_shape()`.
SafetensorsHeader read_safetensors_header(const std::string& path);

/// Parses safetensors bytes already in memory (tensors are copies); `name` is used in errors.
Safetensors parse_safetensors(std::string_view bytes, const std::string& name);

/// The bytes of a safetensors file holding `tensors` (any device, any layout; written
/// contiguous, little-endian, in key order) and `metadata`. Names must be non-empty and not
/// `__metadata__`; dtypes must be one of the supported ones.
std::string serialize_safetensors(const TensorMap& tensors, const Metadata& metadata = {});

/// Writes a safetensors file atomically (see write_file_atomic). Python:
/// `safetensors.torch.save_file(tensors, path, metadata)`.
void save_safetensors(const std::string& path, const TensorMap& tensors,
                      const Metadata& metadata = {});

/// "F32", "BF16", ... for a torch dtype; throws for dtypes safetensors cannot hold here.
const char* safetensors_dtype_name(torch::Dtype dtype);

}  // namespace difftrain::io
