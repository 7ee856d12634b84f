#include "difftrain/data/idx.h"

#include "difftrain/core/error.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <fmt/format.h>
#include <torch/torch.h>
#include <zlib.h>

#ifdef DIFFTRAIN_HAVE_LIBDEFLATE
#include <libdeflate.h>
#endif

#include <array>
#include <cerrno>
#include <climits>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <vector>

namespace difftrain::data {
namespace {

namespace fs = std::filesystem;

std::string dims_str(const std::vector<int64_t>& dims) {
  return fmt::format("[{}]", fmt::join(dims, ", "));
}

// One IDX file through zlib's gz* API, which reads gzip streams and raw files alike.
class IdxReader {
 public:
  explicit IdxReader(const std::string& path) : path_(path) {
    file_ = gzopen(path.c_str(), "rb");
    if (file_ == nullptr) {
      throw Error(path + ": cannot open the file (" + std::strerror(errno) +
                  "); check permissions");
    }
  }
  ~IdxReader() { gzclose(file_); }
  IdxReader(const IdxReader&) = delete;
  IdxReader& operator=(const IdxReader&) = delete;

  // Reads up to n bytes into dst and returns how many it got (fewer only at the end of the data,
  // including the end of a truncated gzip stream). Throws for corrupt gzip data.
  int64_t read(void* dst, int64_t n) {
    int64_t got = 0;
    auto* out = static_cast<char*>(dst);
    while (got < n) {
      const auto chunk = static_cast<unsigned>(std::min<int64_t>(n - got, int64_t{1} << 30));
      const int r = gzread(file_, out + got, chunk);
      if (r < 0) {
        int code = Z_OK;
        const char* message = gzerror(file_, &code);
        // Z_BUF_ERROR is zlib's "unexpected end of file": a cut-off gzip stream.
        if (code == Z_BUF_ERROR) break;
        throw Error(path_ + ": corrupt gzip data (zlib: " + (message ? message : "unknown") +
                    "); re-download the file");
      }
      if (r == 0) break;
      got += r;
    }
    return got;
  }

  // The bytes that remain, counted without keeping them, up to `limit`.
  int64_t count_remaining(int64_t limit) {
    std::array<char, 1 << 16> scratch;
    int64_t total = 0;
    while (total < limit) {
      const int64_t r = read(scratch.data(), std::min<int64_t>(scratch.size(), limit - total));
      if (r == 0) break;
      total += r;
    }
    return total;
  }

  bool is_raw() { return gzdirect(file_) != 0; }
  void rewind() { gzrewind(file_); }

 private:
  std::string path_;
  gzFile file_ = nullptr;
};

// The uncompressed size modulo 2^32 that a single-member gzip file stores in its last 4 bytes.
uint32_t gzip_isize(const std::string& path) {
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in || in.tellg() < 4) return 0;
  in.seekg(-4, std::ios::end);
  std::array<unsigned char, 4> b{};
  in.read(reinterpret_cast<char*>(b.data()), 4);
  return uint32_t{b[0]} | uint32_t{b[1]} << 8 | uint32_t{b[2]} << 16 | uint32_t{b[3]} << 24;
}

const char* idx_type_name(int code) {
  switch (code) {
    case 0x08: return "unsigned byte";
    case 0x09: return "signed byte";
    case 0x0B: return "int16";
    case 0x0C: return "int32";
    case 0x0D: return "float32";
    case 0x0E: return "float64";
    default: return "unknown";
  }
}

// A well-formed single-member gzip file decompressed in one call by libdeflate (about 3x zlib's
// streaming gzread) into a new tensor of exactly `total` bytes, the IDX header included. Returns
// an undefined tensor for anything else (libdeflate missing, unreadable, corrupt, cut off, longer,
// several members): the zlib path then reads the file and gives its precise error.
torch::Tensor inflate_whole(const std::string& path, int64_t total) {
#ifdef DIFFTRAIN_HAVE_LIBDEFLATE
  std::ifstream in(path, std::ios::binary | std::ios::ate);
  if (!in) return {};
  const std::streamoff size = in.tellg();
  if (size <= 0) return {};
  std::vector<char> compressed(static_cast<size_t>(size));
  in.seekg(0);
  if (!in.read(compressed.data(), size)) return {};
  auto out = torch::empty({total}, torch::kUInt8);
  libdeflate_decompressor* d = libdeflate_alloc_decompressor();
  if (d == nullptr) return {};
  size_t in_used = 0, out_used = 0;
  const libdeflate_result r = libdeflate_gzip_decompress_ex(
      d, compressed.data(), compressed.size(), out.data_ptr<uint8_t>(), static_cast<size_t>(total),
      &in_used, &out_used);
  libdeflate_free_decompressor(d);
  if (r != LIBDEFLATE_SUCCESS || in_used != compressed.size() ||
      out_used != static_cast<size_t>(total)) {
    return {};
  }
  return out;
#else
  (void)path;
  (void)total;
  return {};
#endif
}

// A raw file's payload mapped copy-on-write (MAP_PRIVATE): no copy, and only the pages a run
// touches are read (from the page cache when the file was read before). Undefined if mmap fails.
torch::Tensor map_payload(const std::string& path, int64_t header_bytes, int64_t numel,
                          const std::vector<int64_t>& dims) {
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) return {};
  const auto length = static_cast<size_t>(header_bytes + numel);
  void* base = ::mmap(nullptr, length, PROT_READ | PROT_WRITE, MAP_PRIVATE, fd, 0);
  ::close(fd);
  if (base == MAP_FAILED) return {};
  return torch::from_blob(
      static_cast<uint8_t*>(base) + header_bytes, dims,
      [base, length](void*) { ::munmap(base, length); }, torch::kUInt8);
}

constexpr int kMaxIdxDims = 8;
// deflate's largest expansion (~1032:1): a gzip file of n bytes holds at most this many times n.
constexpr int64_t kMaxDeflateRatio = 1032;
// How many bytes past the declared data are counted for an error message.
constexpr int64_t kExtraCounted = int64_t{1} << 20;

}  // namespace

namespace {

// read_idx; map_raw: a raw file's payload is mapped rather than read (only for files that are
// replaced by rename and never rewritten in place: a file cut short under a mapping faults).
torch::Tensor read_idx_impl(const std::string& path, bool map_raw) {
  std::error_code ec;
  const auto status = fs::status(path, ec);
  if (!fs::exists(status)) {
    throw Error(path +
                ": no such IDX file; check the path (MNIST-style files are named e.g. "
                "train-images-idx3-ubyte.gz)");
  }
  if (fs::is_directory(status)) {
    throw Error(path + ": is a folder; expected an IDX file such as train-images-idx3-ubyte.gz");
  }
  IdxReader reader(path);

  std::array<unsigned char, 4> magic{};
  const int64_t got = reader.read(magic.data(), 4);
  if (got < 4 || magic[0] != 0 || magic[1] != 0 || magic[3] == 0 || magic[3] > kMaxIdxDims ||
      std::string(idx_type_name(magic[2])) == "unknown") {
    const std::string seen =
        got == 0
            ? "it is empty"
            : fmt::format("first bytes {:02x}", fmt::join(magic.begin(), magic.begin() + got, " "));
    throw Error(fmt::format(
        "{}: not an IDX file ({}; IDX files start with 00 00 08 <ndim>); expected an MNIST-style "
        "file such as train-images-idx3-ubyte(.gz)",
        path, seen));
  }
  if (magic[2] != 0x08) {
    throw Error(fmt::format(
        "{}: IDX dtype code 0x{:02x} ({}) is not supported; only 0x08 (unsigned byte, as in "
        "MNIST) is",
        path, magic[2], idx_type_name(magic[2])));
  }
  const int ndim = magic[3];
  std::vector<unsigned char> header(4 * static_cast<size_t>(ndim));
  if (reader.read(header.data(), static_cast<int64_t>(header.size())) !=
      static_cast<int64_t>(header.size())) {
    throw Error(
        fmt::format("{}: truncated inside the IDX header ({} dimensions declared); "
                    "re-download the file",
                    path, ndim));
  }
  std::vector<int64_t> dims(ndim);
  int64_t numel = 1;
  for (int d = 0; d < ndim; ++d) {
    const unsigned char* b = header.data() + 4 * d;
    dims[d] = int64_t{b[0]} << 24 | int64_t{b[1]} << 16 | int64_t{b[2]} << 8 | int64_t{b[3]};
    // Sizes are < 2^32 each, so the product only overflows after passing the limit.
    numel *= dims[d];
    if (numel > kMaxIdxBytes) {
      throw Error(
          fmt::format("{}: IDX header declares sizes {} — more than the 2 GiB read_idx "
                      "accepts; the file is corrupt or not a dataset difftrain can load",
                      path, dims_str(std::vector<int64_t>(dims.begin(), dims.begin() + d + 1))));
    }
  }
  const int64_t header_bytes = 4 + 4 * int64_t{ndim};
  auto size_error = [&](int64_t present) {
    if (present < numel) {
      return Error(
          fmt::format("{}: truncated: the IDX header declares {} ({} bytes of data) but "
                      "only {} bytes follow; re-download the file",
                      path, dims_str(dims), numel, present));
    }
    return Error(
        fmt::format("{}: {} bytes follow the {} values its IDX header declares ({}); "
                    "the file is corrupt or not a single IDX array",
                    path, present - numel, numel, dims_str(dims)));
  };

  // Check the payload size against what the file holds before allocating it.
  const bool raw = reader.is_raw();
  if (!raw && gzip_isize(path) == static_cast<uint32_t>(header_bytes + numel) &&
      numel <= kMaxDeflateRatio * static_cast<int64_t>(fs::file_size(path, ec))) {
    if (auto whole = inflate_whole(path, header_bytes + numel); whole.defined()) {
      return whole.narrow(0, header_bytes, numel).view(dims);
    }
  }
  if (raw) {
    const auto file_bytes = static_cast<int64_t>(fs::file_size(path, ec));
    if (!ec && file_bytes - header_bytes != numel) throw size_error(file_bytes - header_bytes);
    if (!ec && numel > 0 && map_raw) {
      if (auto mapped = map_payload(path, header_bytes, numel, dims); mapped.defined()) {
        return mapped;
      }
    }
  } else if (gzip_isize(path) != static_cast<uint32_t>(header_bytes + numel) ||
             numel > kMaxDeflateRatio * static_cast<int64_t>(fs::file_size(path, ec))) {
    // The gzip trailer disagrees (a cut-off or multi-member stream), or the header declares more
    // than the compressed file can hold (the trailer is only the size modulo 2^32 and is not
    // checked by anyone): count the real bytes before allocating.
    const int64_t present = reader.count_remaining(numel + kExtraCounted);
    if (present != numel) throw size_error(present);
    reader.rewind();
    std::vector<unsigned char> skip(static_cast<size_t>(header_bytes));
    reader.read(skip.data(), header_bytes);
  }

  auto data = torch::empty(dims, torch::kUInt8);
  const int64_t read = reader.read(data.data_ptr<uint8_t>(), numel);
  if (read != numel) throw size_error(read);
  unsigned char extra = 0;
  if (reader.read(&extra, 1) != 0) {
    throw size_error(numel + 1 + reader.count_remaining(kExtraCounted - 1));
  }
  return data;
}

}  // namespace

torch::Tensor read_idx(const std::string& path) { return read_idx_impl(path, false); }

namespace {

bool is_gzip(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::array<unsigned char, 2> m{};
  in.read(reinterpret_cast<char*>(m.data()), 2);
  return in.gcount() == 2 && m[0] == 0x1f && m[1] == 0x8b;
}

// FNV-1a, 64 bit: a name for the cached copy, not a security measure.
uint64_t fnv1a(const std::string& text) {
  uint64_t h = 1469598103934665603ull;
  for (unsigned char c : text) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

bool write_idx_file(const std::string& path, const torch::Tensor& data) {
  std::string header = {'\0', '\0', '\x08', static_cast<char>(data.dim())};
  for (const int64_t d : data.sizes()) {
    for (int shift = 24; shift >= 0; shift -= 8) header.push_back(static_cast<char>(d >> shift));
  }
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(header.data(), static_cast<std::streamsize>(header.size()));
  out.write(reinterpret_cast<const char*>(data.data_ptr<uint8_t>()), data.numel());
  out.close();
  return static_cast<bool>(out);
}

}  // namespace

torch::Tensor read_idx_cached(const std::string& path, const std::string& cache_dir,
                              const std::function<void(const std::string&)>& note) {
  struct stat st {};
  if (cache_dir.empty() || stat(path.c_str(), &st) != 0 || !S_ISREG(st.st_mode) || !is_gzip(path)) {
    return read_idx(path);
  }
  std::error_code ec;
  const std::string absolute = fs::absolute(path, ec).lexically_normal().string();
  const std::string key =
      fmt::format("{}|{}|{}.{:09}", absolute, st.st_size, st.st_mtim.tv_sec, st.st_mtim.tv_nsec);
  std::string stem = fs::path(path).filename().string();
  if (stem.size() > 3 && stem.compare(stem.size() - 3, 3, ".gz") == 0) stem.resize(stem.size() - 3);
  const fs::path dir = fs::path(cache_dir) / "datasets";
  const fs::path copy = dir / fmt::format("{}-{:016x}", stem, fnv1a(key));
  // Only a folder of this user's (a shared temp folder could hold someone else's planted copy).
  auto ours = [](const fs::path& p) {
    struct stat s {};
    return lstat(p.c_str(), &s) == 0 && S_ISDIR(s.st_mode) && s.st_uid == ::geteuid();
  };
  if (!fs::exists(dir, ec)) {
    fs::create_directories(cache_dir, ec);
    if (!ec) fs::create_directory(dir, ec);
    if (!ec) fs::permissions(dir, fs::perms::owner_all, ec);
  }
  if (!ours(cache_dir) || !ours(dir)) {
    if (note) {
      note(fmt::format("dataset cache: {} is not a folder of this user's; reading the gzip file",
                       dir.string()));
    }
    return read_idx(path);
  }
  if (fs::is_regular_file(copy, ec)) {
    try {
      return read_idx_impl(copy.string(), true);  // copies are only ever replaced by rename
    } catch (const Error&) {
      fs::remove(copy, ec);  // damaged: read the original and write it again
    }
  }
  auto data = read_idx(path);
  const std::string tmp = copy.string() + fmt::format(".tmp{}", static_cast<long long>(::getpid()));
  if (write_idx_file(tmp, data)) {
    fs::rename(tmp, copy, ec);
    if (!ec) {
      if (note) {
        note(
            fmt::format("dataset cache: wrote an uncompressed copy of {} to {} ({:.1f} MB; later "
                        "runs read it instead; DIFFTRAIN_DATASET_CACHE=0 turns this off)",
                        path, copy.string(), static_cast<double>(data.numel()) / 1e6));
      }
      return data;
    }
  }
  fs::remove(tmp, ec);
  if (note) {
    note(fmt::format("dataset cache: cannot write {} ({}); reading the gzip file on every run",
                     copy.string(), ec ? ec.message() : std::string(std::strerror(errno))));
  }
  return data;
}

}  // namespace difftrain::data
