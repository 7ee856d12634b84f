#include "difftrain/core/exit.h"

#include "difftrain/core/env.h"

#include <spdlog/spdlog.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <iostream>

#if defined(__SANITIZE_ADDRESS__)
#define DIFFTRAIN_SANITIZED_EXIT 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define DIFFTRAIN_SANITIZED_EXIT 1
#endif
#endif

namespace difftrain {

void exit_process(int rc) {
  std::cout.flush();
  std::cerr.flush();
  std::clog.flush();
  if (auto logger = spdlog::default_logger()) logger->flush();
  std::fflush(nullptr);
#ifdef DIFFTRAIN_SANITIZED_EXIT
  std::exit(rc);
#else
  if (!env_switch("DIFFTRAIN_QUICK_EXIT", true)) std::exit(rc);
  _exit(rc);
#endif
}

}  // namespace difftrain
