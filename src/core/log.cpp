#include "difftrain/core/log.h"

#include <spdlog/sinks/stdout_sinks.h>

#include <atomic>
#include <cstdlib>
#include <cstring>

namespace difftrain::log {

namespace {
std::atomic<int> g_rank{0};
}

void init(int rank, int world_size) {
  g_rank = rank;
  const char* launched = std::getenv("DIFFTRAIN_LAUNCHED");
  const bool under_launcher = launched != nullptr && std::strcmp(launched, "1") == 0;
  // stderr for everything keeps stdout free for a program's own results (e.g. `difftrain env`).
  auto logger = spdlog::get("difftrain");
  if (!logger) {
    logger = spdlog::stderr_logger_mt("difftrain");
  }
  std::string pattern = "%^%l%$: %v";
  if (!under_launcher && world_size > 1) {
    pattern = "[rank " + std::to_string(rank) + "/" + std::to_string(world_size) + "] " + pattern;
  }
  logger->set_pattern(pattern);
  logger->set_level(spdlog::level::info);
  logger->flush_on(spdlog::level::info);
  spdlog::set_default_logger(logger);
}

int rank() { return g_rank.load(); }

}  // namespace difftrain::log
