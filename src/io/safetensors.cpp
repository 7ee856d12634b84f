#include "difftrain/io/safetensors.h"

#include "difftrain/core/error.h"
#include "difftrain/core/phase.h"
#include "difftrain/io/atomic_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <vector>

namespace difftrain::io {
namespace {

constexpr uint64_t kMaxHeaderBytes = 100ull << 20;

struct DtypeInfo {
  const char* name;
  torch::Dtype dtype;
  int64_t size;
};

constexpr DtypeInfo kDtypes[] = {
    {"F64", torch::kFloat64, 8},   {"F32", torch::kFloat32, 4}, {"F16", torch::kFloat16, 2},
    {"BF16", torch::kBFloat16, 2}, {"I64", torch::kInt64, 8},   {"I32", torch::kInt32, 4},
    {"I16", torch::kInt16, 2},     {"I8", torch::kInt8, 1},     {"U8", torch::kUInt8, 1},
    {"BOOL", torch::kBool, 1},
};

const DtypeInfo* find_dtype(const std::string& name) {
  for (const auto& d : kDtypes) {
    if (name == d.name) return &d;
  }
  return nullptr;
}

[[noreturn]] void bad_safetensors(const std::string& file, const std::string& what) {
  throw Error("invalid safetensors file '" + file + "': " + what +
              "; the file is corrupt or not safetensors — re-create or re-download it");
}

// One tensor entry of the header, checked.
struct Entry {
  std::string name;
  const DtypeInfo* dtype;
  std::vector<int64_t> shape;
  uint64_t begin;
  uint64_t end;
};

uint64_t read_u64_le(const unsigned char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}

// Parses and validates the header of a buffer of `size` bytes. Returns the entries (sorted by
// offset), the metadata, and the data buffer's start.
std::vector<Entry> parse_header(const unsigned char* bytes, uint64_t size, const std::string& file,
                                Metadata& metadata, uint64_t& data_start) {
  // A clone without git-lfs (or with GIT_LFS_SKIP_SMUDGE=1) leaves a small text file in place of
  // each weight file.
  static constexpr std::string_view kLfs = "version https://git-lfs.github.com/spec/";
  if (size >= kLfs.size() && std::memcmp(bytes, kLfs.data(), kLfs.size()) == 0) {
    throw Error("'" + file + "' is a Git LFS pointer (" + std::to_string(size) +
                " bytes), not the weights: run `git lfs install && git lfs pull` in its "
                "repository, or download the file itself");
  }
  if (size < 8)
    bad_safetensors(
        file, "it is " + std::to_string(size) + " bytes, shorter than the 8-byte header length");
  uint64_t header_len = read_u64_le(bytes);
  if (header_len > kMaxHeaderBytes) {
    bad_safetensors(file,
                    "header length " + std::to_string(header_len) + " exceeds the 100 MiB limit");
  }
  if (header_len > size - 8) {
    bad_safetensors(file, "header length " + std::to_string(header_len) +
                              " runs past the end of the " + std::to_string(size) + "-byte file");
  }
  data_start = 8 + header_len;
  const uint64_t data_size = size - data_start;
  nlohmann::json header;
  try {
    header = nlohmann::json::parse(bytes + 8, bytes + 8 + header_len);
  } catch (const nlohmann::json::exception& e) {
    bad_safetensors(file, std::string("header is not valid JSON (") + e.what() + ")");
  }
  if (!header.is_object()) bad_safetensors(file, "header is not a JSON object");

  std::vector<Entry> entries;
  for (auto it = header.begin(); it != header.end(); ++it) {
    const std::string& key = it.key();
    const auto& value = it.value();
    if (key == "__metadata__") {
      if (!value.is_object()) bad_safetensors(file, "__metadata__ is not an object of strings");
      for (auto m = value.begin(); m != value.end(); ++m) {
        if (!m.value().is_string())
          bad_safetensors(file, "__metadata__ value of '" + m.key() + "' is not a string");
        metadata[m.key()] = m.value().get<std::string>();
      }
      continue;
    }
    const std::string where = "tensor '" + key + "'";
    if (!value.is_object()) bad_safetensors(file, where + " is not an object");
    auto dtype_it = value.find("dtype");
    auto shape_it = value.find("shape");
    auto offsets_it = value.find("data_offsets");
    if (dtype_it == value.end() || !dtype_it->is_string())
      bad_safetensors(file, where + " has no string dtype");
    if (shape_it == value.end() || !shape_it->is_array())
      bad_safetensors(file, where + " has no shape array");
    if (offsets_it == value.end() || !offsets_it->is_array() || offsets_it->size() != 2) {
      bad_safetensors(file, where + " has no data_offsets [begin, end]");
    }
    Entry e;
    e.name = key;
    e.dtype = find_dtype(dtype_it->get<std::string>());
    if (!e.dtype) {
      bad_safetensors(file, where + " has unsupported dtype '" + dtype_it->get<std::string>() +
                                "' (supported: F64 F32 F16 BF16 I64 I32 I16 I8 U8 BOOL)");
    }
    uint64_t numel = 1;
    for (const auto& dim : *shape_it) {
      if (!dim.is_number_unsigned())
        bad_safetensors(file, where + " has a shape entry that is not a non-negative integer");
      uint64_t d = dim.get<uint64_t>();
      if (d > (1ull << 62) || __builtin_mul_overflow(numel, d, &numel)) {
        bad_safetensors(file, where + " has a shape whose element count overflows");
      }
      e.shape.push_back(static_cast<int64_t>(d));
    }
    for (const auto& off : *offsets_it) {
      if (!off.is_number_unsigned())
        bad_safetensors(file, where + " has a data offset that is not a non-negative integer");
    }
    e.begin = (*offsets_it)[0].get<uint64_t>();
    e.end = (*offsets_it)[1].get<uint64_t>();
    if (e.end < e.begin) bad_safetensors(file, where + " has data_offsets with end before begin");
    if (e.end > data_size) {
      bad_safetensors(file, where + " has data_offsets [" + std::to_string(e.begin) + ", " +
                                std::to_string(e.end) + "] past the " + std::to_string(data_size) +
                                "-byte data buffer (truncated file?)");
    }
    uint64_t nbytes = 0;
    if (__builtin_mul_overflow(numel, static_cast<uint64_t>(e.dtype->size), &nbytes) ||
        nbytes != e.end - e.begin) {
      bad_safetensors(file, where + " has shape and dtype needing " + std::to_string(nbytes) +
                                " bytes but data_offsets span " + std::to_string(e.end - e.begin));
    }
    entries.push_back(std::move(e));
  }
  std::sort(entries.begin(), entries.end(), [](const Entry& a, const Entry& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t expected = 0;
  for (const auto& e : entries) {
    if (e.begin < expected)
      bad_safetensors(file, "tensor '" + e.name + "' overlaps the tensor before it");
    if (e.begin > expected) {
      bad_safetensors(file, "the data buffer has a gap of " + std::to_string(e.begin - expected) +
                                " bytes before tensor '" + e.name + "'");
    }
    expected = e.end;
  }
  if (expected != data_size) {
    bad_safetensors(file, "the data buffer has " + std::to_string(data_size - expected) +
                              " bytes that no tensor covers");
  }
  return entries;
}

// A private, writable (copy-on-write) mapping shared by the tensors that view it.
struct Mapping {
  void* addr = MAP_FAILED;
  size_t size = 0;
  ~Mapping() {
    if (addr != MAP_FAILED) ::munmap(addr, size);
  }
};

}  // namespace

const char* safetensors_dtype_name(torch::Dtype dtype) {
  for (const auto& d : kDtypes) {
    if (d.dtype == dtype) return d.name;
  }
  throw Error(std::string("safetensors cannot hold dtype ") + c10::toString(dtype) +
              "; convert the tensor to float32, float16, bfloat16 or an integer type first");
}

Safetensors parse_safetensors(std::string_view bytes, const std::string& name) {
  Safetensors out;
  uint64_t data_start = 0;
  const auto* base = reinterpret_cast<const unsigned char*>(bytes.data());
  auto entries = parse_header(base, bytes.size(), name, out.metadata, data_start);
  for (const auto& e : entries) {
    auto t = torch::empty(e.shape, torch::TensorOptions().dtype(e.dtype->dtype));
    if (e.end > e.begin) std::memcpy(t.data_ptr(), base + data_start + e.begin, e.end - e.begin);
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

namespace {

// `path` mapped copy-on-write (empty files map nothing).
std::shared_ptr<Mapping> map_file(const std::string& path) {
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) {
    throw Error("cannot open safetensors file '" + path + "': " + std::strerror(errno) +
                "; check the path");
  }
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd);
    throw Error("'" + path + "' is not a regular file; pass a .safetensors file");
  }
  auto map = std::make_shared<Mapping>();
  map->size = static_cast<size_t>(st.st_size);
  if (map->size > 0) {
    map->addr = ::mmap(nullptr, map->size, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  }
  ::close(fd);
  if (map->size > 0 && map->addr == MAP_FAILED) {
    throw Error("cannot map '" + path + "' into memory: " + std::strerror(errno));
  }
  return map;
}

}  // namespace

SafetensorsHeader read_safetensors_header(const std::string& path) {
  const auto map = map_file(path);
  static const unsigned char kEmpty[1] = {0};
  const auto* base = static_cast<unsigned char*>(map->size > 0 ? map->addr : nullptr);
  SafetensorsHeader out;
  uint64_t data_start = 0;
  for (const auto& e :
       parse_header(base ? base : kEmpty, map->size, path, out.metadata, data_start)) {
    out.tensors.emplace(e.name, SafetensorsEntry{e.dtype->dtype, e.shape});
  }
  return out;
}

Safetensors load_safetensors(const std::string& path) {
  const auto map = map_file(path);
  const auto* base = static_cast<unsigned char*>(map->size > 0 ? map->addr : nullptr);
  static const unsigned char kEmpty[1] = {0};
  Safetensors out;
  uint64_t data_start = 0;
  auto entries = parse_header(base ? base : kEmpty, map->size, path, out.metadata, data_start);
  for (const auto& e : entries) {
    auto options = torch::TensorOptions().dtype(e.dtype->dtype);
    unsigned char* ptr = static_cast<unsigned char*>(map->addr) + data_start + e.begin;
    torch::Tensor t;
    // Offsets are not guaranteed to be aligned to the element size; kernels expect alignment.
    if (e.end == e.begin || reinterpret_cast<uintptr_t>(ptr) % e.dtype->size != 0) {
      t = torch::empty(e.shape, options);
      if (e.end > e.begin) std::memcpy(t.data_ptr(), ptr, e.end - e.begin);
    } else {
      t = torch::from_blob(
          ptr, e.shape, [map](void*) {}, options);
    }
    out.tensors.emplace(e.name, std::move(t));
  }
  return out;
}

std::string serialize_safetensors(const TensorMap& tensors, const Metadata& metadata) {
  nlohmann::json header = nlohmann::json::object();
  if (!metadata.empty()) header["__metadata__"] = metadata;
  std::vector<torch::Tensor> data;
  uint64_t offset = 0;
  for (const auto& [name, tensor] : tensors) {
    if (name.empty() || name == "__metadata__") {
      throw Error("cannot save a tensor named '" + name + "' to safetensors; rename it");
    }
    if (!tensor.defined())
      throw Error("cannot save undefined tensor '" + name + "' to safetensors");
    const char* dtype = safetensors_dtype_name(tensor.scalar_type());
    auto t = tensor.detach().to(torch::kCPU).contiguous();
    uint64_t nbytes = static_cast<uint64_t>(t.numel()) * t.element_size();
    header[name] = {
        {"dtype", dtype}, {"shape", t.sizes().vec()}, {"data_offsets", {offset, offset + nbytes}}};
    offset += nbytes;
    data.push_back(std::move(t));
  }
  std::string json = header.dump();
  // Pad with spaces so the data buffer starts 8-byte aligned, as the reference writer does.
  json.append((8 - json.size() % 8) % 8, ' ');
  std::string out;
  out.reserve(8 + json.size() + offset);
  uint64_t len = json.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((len >> (8 * i)) & 0xff));
  out += json;
  for (const auto& t : data) {
    out.append(static_cast<const char*>(t.data_ptr()),
               static_cast<size_t>(t.numel()) * t.element_size());
    core::note_progress();
  }
  return out;
}

void save_safetensors(const std::string& path, const TensorMap& tensors, const Metadata& metadata) {
  write_file_atomic(path, serialize_safetensors(tensors, metadata));
}

}  // namespace difftrain::io
