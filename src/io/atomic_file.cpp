#include "difftrain/io/atomic_file.h"

#include "difftrain/core/error.h"
#include "difftrain/core/phase.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>

namespace difftrain::io {
namespace fs = std::filesystem;

namespace {

std::string errno_text() { return std::strerror(errno); }

// What failed writing `path`, with the fix when the disk (or a quota or file-size limit) is full.
std::string write_error(const std::string& what, const std::string& path) {
  const int code = errno;
  std::string message = what + " '" + path + "': " + std::strerror(code);
  if (code == ENOSPC || code == EFBIG || code == EDQUOT) {
    message +=
        " (the disk is full or a quota or file-size limit was reached); free space or "
        "write to another folder, then retry";
  }
  return message;
}

// Writes everything or throws; short writes are retried. In pieces of 16 MiB, each handed to
// the disk as it is written (so the final fsync has little left to wait for) and each noted as
// progress: a rank saving a large checkpoint after SIGTERM shows `difftrain launch` it is not
// stuck.
void write_all(int fd, std::string_view bytes, const std::string& path) {
  constexpr size_t kPiece = size_t{16} << 20;
  const char* p = bytes.data();
  size_t left = bytes.size();
  off_t written = 0;
  while (left > 0) {
    ssize_t n = ::write(fd, p, std::min(left, kPiece));
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw Error(write_error("cannot write", path));
    if (bytes.size() > kPiece) {
      ::sync_file_range(fd, written, n, SYNC_FILE_RANGE_WRITE);
      core::note_progress();
    }
    p += n;
    written += n;
    left -= static_cast<size_t>(n);
  }
}

}  // namespace

void write_file_atomic(const std::string& path, std::string_view bytes) {
  fs::path target(path);
  fs::path parent = target.parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    fs::create_directories(parent, ec);
    if (ec) {
      throw Error("cannot create folder '" + parent.string() + "' for '" + path +
                  "': " + ec.message() + "; check the output path and its permissions");
    }
  }
  // A fresh private name (mkostemp: O_EXCL, mode 0600), so a planted file or symlink at a
  // predictable temporary name is never followed or overwritten; readable by others (0644) only
  // once complete.
  std::string temp = path + ".tmp.XXXXXX";
  int fd = ::mkostemp(temp.data(), O_CLOEXEC);
  if (fd < 0) {
    throw Error("cannot create a temporary file next to '" + path + "': " + errno_text() +
                "; check that the folder is writable");
  }
  try {
    if (::fchmod(fd, 0644) != 0)
      throw Error("cannot set the mode of '" + temp + "': " + errno_text());
    write_all(fd, bytes, path);
    if (::fsync(fd) != 0) throw Error(write_error("cannot flush to disk", path));
  } catch (...) {
    ::close(fd);
    ::unlink(temp.c_str());
    throw;
  }
  if (::close(fd) != 0) {
    std::string why = write_error("cannot write", path);
    ::unlink(temp.c_str());
    throw Error(why);
  }
  if (::rename(temp.c_str(), path.c_str()) != 0) {
    std::string why = errno_text();
    ::unlink(temp.c_str());
    throw Error("cannot move '" + temp + "' to '" + path + "': " + why);
  }
  // The rename is durable only once the folder entry is on disk.
  std::string dir = parent.empty() ? "." : parent.string();
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    ::fsync(dfd);
    ::close(dfd);
  }
}

std::string read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error("cannot open '" + path +
                "': " + (fs::exists(path) ? "permission denied or not a file" : "no such file"));
  }
  std::ostringstream buffer;
  buffer << in.rdbuf();
  if (in.bad()) throw Error("cannot read '" + path + "'");
  return buffer.str();
}

void write_folder_atomic(const fs::path& out, const std::string& what, const std::string& shown,
                         const std::function<void(const fs::path&)>& fill) {
  const fs::path staging = out.string() + ".partial-" + std::to_string(::getpid());
  try {
    fs::remove_all(staging);
    fs::create_directories(staging);
    fill(staging);
    fs::rename(staging, out);
  } catch (const fs::filesystem_error& e) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw Error("cannot write " + what + " '" + shown + "': " + e.code().message() + " (" +
                e.path1().string() + "); check the space and permissions there");
  } catch (...) {
    std::error_code ignored;
    fs::remove_all(staging, ignored);
    throw;
  }
}

}  // namespace difftrain::io
