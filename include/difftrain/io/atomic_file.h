#pragma once
// Crash-safe file writes: a temporary file beside the target, fsync, then rename.

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace difftrain::io {

/// Writes `bytes` to `path` so that a reader sees either the old file or the complete new one,
/// never a partial file: the bytes go to `<path>.tmp.<pid>` in the same folder, are fsync'ed,
/// renamed over `path`, and the folder is fsync'ed. Parent folders are created. On failure
/// (disk full, permission) the temporary file is removed, `path` is untouched, and a
/// difftrain::Error names the path and the system's reason.
void write_file_atomic(const std::string& path, std::string_view bytes);

/// Reads a whole file; a difftrain::Error names the path when it cannot be opened or read.
std::string read_file(const std::string& path);

/// Builds the folder `out` so that it appears whole or not at all: `fill(staging)` writes
/// everything into `<out>.partial-<pid>` beside it, which is then renamed to `out` (replacing
/// an empty folder there). On any failure the staging folder is removed; a filesystem error
/// becomes a difftrain::Error "cannot write <what> '<shown>': <reason> (<path>); check the
/// space and permissions there", any other exception passes through.
void write_folder_atomic(const std::filesystem::path& out, const std::string& what,
                         const std::string& shown,
                         const std::function<void(const std::filesystem::path&)>& fill);

}  // namespace difftrain::io
