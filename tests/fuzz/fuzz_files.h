#pragma once
// For the few fuzz targets whose parser reads a folder or a path (gzopen, a tokenizer folder, an
// image folder): one scratch folder per process under /dev/shm (RAM, no disk wear), created once.

#include <unistd.h>

#include <array>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <string_view>

namespace difftrain::fuzz {

/// /dev/shm/difftrain-fuzz-<pid>, created on first use and removed when the process exits.
inline const std::string& scratch_dir() {
  static const std::string dir = [] {
    std::string d = "/dev/shm/difftrain-fuzz-" + std::to_string(::getpid());
    std::filesystem::create_directories(d);
    std::atexit([] {
      std::error_code ec;
      std::filesystem::remove_all("/dev/shm/difftrain-fuzz-" + std::to_string(::getpid()), ec);
    });
    return d;
  }();
  return dir;
}

/// Writes `bytes` to `scratch_dir()/name` (replacing it) and returns the path.
inline std::string write_scratch(const std::string& name, std::string_view bytes) {
  const std::string path = scratch_dir() + "/" + name;
  std::filesystem::create_directories(std::filesystem::path(path).parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  return path;
}

/// Splits a fuzz input into up to `n` parts at the separator line "\n--8<--\n" (the last part
/// takes the rest; missing parts are empty), so one input can carry several files.
template <size_t n>
std::array<std::string_view, n> split_parts(std::string_view bytes) {
  constexpr std::string_view kSep = "\n--8<--\n";
  std::array<std::string_view, n> parts{};
  for (size_t i = 0; i < n; ++i) {
    const size_t at = i + 1 < n ? bytes.find(kSep) : std::string_view::npos;
    if (at == std::string_view::npos) {
      parts[i] = bytes;
      break;
    }
    parts[i] = bytes.substr(0, at);
    bytes = bytes.substr(at + kSep.size());
  }
  return parts;
}

}  // namespace difftrain::fuzz
