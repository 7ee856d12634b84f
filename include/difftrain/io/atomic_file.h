#pragma once
// Crash-safe file writes: a temporary file beside the target, fsync, then rename.

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

}  // namespace difftrain::io
