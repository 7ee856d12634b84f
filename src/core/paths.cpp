#include "difftrain/core/paths.h"

#include <unistd.h>

#include <cstdlib>
#include <filesystem>

namespace difftrain {

std::string user_cache_dir() {
  namespace fs = std::filesystem;
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg && *xdg) {
    return (fs::path(xdg) / "difftrain").string();
  }
  if (const char* home = std::getenv("HOME"); home && *home) {
    return (fs::path(home) / ".cache" / "difftrain").string();
  }
  // Shared temp folder: a per-user name; callers make it private (0700) when they create it.
  return (fs::temp_directory_path() / ("difftrain-cache-" + std::to_string(::getuid()))).string();
}

}  // namespace difftrain
