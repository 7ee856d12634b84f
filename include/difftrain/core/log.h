#pragma once

#include <spdlog/spdlog.h>

#include <string>

namespace difftrain::log {

/// Sets up the process-wide logger for rank `rank` of `world_size`.
/// Info-level messages are printed by the main rank (rank 0) only; warnings and errors by every
/// rank. Lines carry a `[rank r/w]` prefix unless the process runs under `difftrain launch`, whose
/// own `[rank r]` prefix already names the rank (DIFFTRAIN_LAUNCHED=1). Safe to call again, e.g.
/// once the process group knows the real rank.
void init(int rank = 0, int world_size = 1);

/// Rank the logger was last initialised with.
int rank();

/// Info on the main rank only (Accelerate's `logger.info(..., main_process_only=True)`).
template <typename... Args>
void info(fmt::format_string<Args...> format, Args&&... args) {
  if (rank() == 0) spdlog::info(format, std::forward<Args>(args)...);
}

/// Info on every rank (`main_process_only=False`).
template <typename... Args>
void info_all(fmt::format_string<Args...> format, Args&&... args) {
  spdlog::info(format, std::forward<Args>(args)...);
}

template <typename... Args>
void warn(fmt::format_string<Args...> format, Args&&... args) {
  spdlog::warn(format, std::forward<Args>(args)...);
}

template <typename... Args>
void error(fmt::format_string<Args...> format, Args&&... args) {
  spdlog::error(format, std::forward<Args>(args)...);
}

}  // namespace difftrain::log
