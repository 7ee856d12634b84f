// checksums.json: the size and CRC32 of every file of a checkpoint, written at save and checked
// at load, so a damaged checkpoint is an error that names the file instead of a crash or a
// silently wrong resume.

#include "difftrain/accel/checkpoint_manifest.h"

#include "difftrain/core/error.h"
#include "difftrain/core/phase.h"
#include "difftrain/io/atomic_file.h"

#include <zlib.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <vector>

namespace difftrain::accel {
namespace fs = std::filesystem;
namespace {

struct FileSum {
  uint64_t size = 0;
  uint32_t crc = 0;
};

// Streams the file in 1 MiB blocks: checkpoints can be far larger than memory should hold twice.
FileSum sum_file(const fs::path& path) {
  std::FILE* f = std::fopen(path.c_str(), "rb");
  if (f == nullptr) {
    throw Error("cannot read checkpoint file '" + path.string() + "': " + std::strerror(errno));
  }
  std::vector<unsigned char> buffer(1 << 20);
  FileSum sum;
  uLong crc = crc32(0L, Z_NULL, 0);
  while (true) {
    const size_t n = std::fread(buffer.data(), 1, buffer.size(), f);
    if (n > 0) crc = crc32(crc, buffer.data(), static_cast<uInt>(n));
    sum.size += n;
    core::note_progress();  // a large checkpoint's sums take seconds (see core/phase.h)
    if (n < buffer.size()) break;
  }
  const bool failed = std::ferror(f) != 0;
  std::fclose(f);
  if (failed) throw Error("cannot read checkpoint file '" + path.string() + "': read error");
  sum.crc = static_cast<uint32_t>(crc);
  return sum;
}

std::string earlier_hint() {
  return "resume from an earlier checkpoint with --resume_from_checkpoint <folder> (or latest, "
         "which skips damaged ones)";
}

}  // namespace

void write_checkpoint_manifest(const std::string& dir) {
  std::vector<std::string> names;
  for (const auto& entry : fs::recursive_directory_iterator(dir)) {
    if (!entry.is_regular_file()) continue;
    const std::string rel = fs::relative(entry.path(), dir).generic_string();
    if (rel == kChecksumsFile) continue;
    names.push_back(rel);
  }
  std::sort(names.begin(), names.end());
  nlohmann::json files = nlohmann::json::array();
  for (const auto& rel : names) {
    const FileSum sum = sum_file(fs::path(dir) / rel);
    files.push_back({{"path", rel}, {"size", sum.size}, {"crc32", sum.crc}});
  }
  const nlohmann::json manifest = {{"format", "difftrain-checksums-1"}, {"files", files}};
  io::write_file_atomic((fs::path(dir) / kChecksumsFile).string(), manifest.dump(1) + "\n");
}

bool verify_checkpoint(const std::string& dir) {
  const fs::path manifest_path = fs::path(dir) / kChecksumsFile;
  if (!fs::exists(manifest_path)) return false;
  struct Entry {
    std::string path;
    uint64_t size = 0;
    uint32_t crc = 0;
  };
  std::vector<Entry> entries;
  try {
    const auto manifest = nlohmann::json::parse(io::read_file(manifest_path.string()));
    for (const auto& item : manifest.at("files")) {
      entries.push_back({item.at("path").get<std::string>(), item.at("size").get<uint64_t>(),
                         item.at("crc32").get<uint32_t>()});
    }
  } catch (const std::exception& e) {
    throw Error("checkpoint manifest '" + manifest_path.string() + "' is unreadable (" + e.what() +
                "); the checkpoint is damaged: " + earlier_hint());
  }
  for (const auto& entry : entries) {
    const fs::path path = fs::path(dir) / entry.path;
    std::error_code ec;
    if (!fs::is_regular_file(path, ec)) {
      throw Error("checkpoint file '" + path.string() + "' is missing (listed in " +
                  kChecksumsFile + " at save); " + earlier_hint());
    }
    const FileSum sum = sum_file(path);
    if (sum.size != entry.size) {
      throw Error("checkpoint file '" + path.string() + "' is corrupted (size " +
                  std::to_string(sum.size) + " bytes, " + kChecksumsFile + " recorded " +
                  std::to_string(entry.size) + " at save); " + earlier_hint());
    }
    if (sum.crc != entry.crc) {
      throw Error("checkpoint file '" + path.string() + "' is corrupted (crc32 mismatch with " +
                  kChecksumsFile + " recorded at save); " + earlier_hint());
    }
  }
  return true;
}

}  // namespace difftrain::accel
