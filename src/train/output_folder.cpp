// The run's output folder: checked against the inputs, against another run's files, and locked.
#include "difftrain/train/output_folder.h"

#include "difftrain/core/error.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <ctime>
#include <filesystem>
#include <string>

namespace difftrain::train {
namespace fs = std::filesystem;

namespace {

// The absolute path with symlinks and `..` resolved as far as the path exists.
fs::path resolved(const std::string& path) {
  std::error_code ec;
  fs::path p = fs::weakly_canonical(fs::absolute(path), ec);
  if (ec) p = fs::absolute(path).lexically_normal();
  std::string s = p.string();
  while (s.size() > 1 && s.back() == '/') s.pop_back();  // "a/b/" and "a/b" are one folder
  return fs::path(s);
}

// True when `inner` is `outer` or lies somewhere inside it.
bool within(const fs::path& inner, const fs::path& outer) {
  auto [o, i] = std::mismatch(outer.begin(), outer.end(), inner.begin(), inner.end());
  return o == outer.end();
}

}  // namespace

void check_output_dir_against_inputs(const std::string& output_dir,
                                     const std::vector<RunInput>& inputs) {
  const fs::path out = resolved(output_dir);
  for (const auto& input : inputs) {
    std::error_code ec;
    if (input.path.empty() || !fs::exists(input.path, ec)) continue;
    const fs::path in = resolved(input.path);
    std::string relation;
    if (in == out) {
      relation = "is the same folder as";
    } else if (within(in, out)) {
      relation = "contains";
    } else if (within(out, in)) {
      relation = "lies inside";
    } else {
      continue;
    }
    throw Error("--output_dir '" + output_dir + "' " + relation + " --" + input.option + " '" +
                input.path +
                "': the run writes (and with --overwrite_output_dir deletes) files there; pass an "
                "--output_dir outside every input folder");
  }
}

std::vector<std::string> output_dir_entries(const std::string& output_dir) {
  std::vector<std::string> names;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return names;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    const std::string name = entry.path().filename().string();
    if (name != kOutputLockName) names.push_back(name);
  }
  std::sort(names.begin(), names.end());
  return names;
}

size_t clear_output_dir(const std::string& output_dir, const std::vector<std::string>& keep) {
  size_t removed = 0;
  for (const auto& name : output_dir_entries(output_dir)) {
    if (std::find(keep.begin(), keep.end(), name) != keep.end()) continue;
    ++removed;
    const fs::path path = fs::path(output_dir) / name;
    std::error_code ec;
    fs::remove_all(path, ec);
    if (ec) {
      throw Error("--overwrite_output_dir: cannot remove '" + path.string() + "': " + ec.message() +
                  "; remove it by hand or pick another --output_dir");
    }
  }
  return removed;
}

std::unique_ptr<OutputDirLock> OutputDirLock::acquire(const std::string& output_dir) {
  std::error_code ec;
  fs::create_directories(output_dir, ec);
  if (ec) {
    throw Error("cannot create output_dir '" + output_dir + "': " + ec.message() +
                "; pass a writable --output_dir");
  }
  const std::string path = (fs::path(output_dir) / kOutputLockName).string();
  const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  if (fd < 0) {
    throw Error("cannot create the lock file '" + path + "': " + std::strerror(errno) +
                "; pass a writable --output_dir");
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char buf[256] = {};
    const ssize_t n = ::pread(fd, buf, sizeof buf - 1, 0);
    ::close(fd);
    std::string holder = n > 0 ? std::string(buf, static_cast<size_t>(n)) : "";
    while (!holder.empty() && (holder.back() == '\n' || holder.back() == ' ')) holder.pop_back();
    if (err != EWOULDBLOCK) {
      throw Error("cannot lock '" + path + "': " + std::strerror(err) +
                  "; the file system of --output_dir must support flock (a local disk or NFSv4)");
    }
    throw Error("--output_dir '" + output_dir + "' is in use by another difftrain run (" +
                (holder.empty() ? std::string("its pid is not recorded yet") : holder) +
                "); wait for it to end, or pass another --output_dir");
  }
  char host[256] = {};
  ::gethostname(host, sizeof host - 1);
  char when[32] = {};
  const std::time_t now = std::time(nullptr);
  std::strftime(when, sizeof when, "%Y-%m-%d %H:%M:%S UTC", std::gmtime(&now));
  const std::string text =
      "pid " + std::to_string(::getpid()) + " on host " + host + ", started " + when + "\n";
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, text.data(), text.size(), 0) < 0) {
    // The lock itself is held; only the holder's description is missing.
  }
  return std::unique_ptr<OutputDirLock>(new OutputDirLock(fd));
}

OutputDirLock::~OutputDirLock() { ::close(fd_); }

}  // namespace difftrain::train
