#include "difftrain/core/env.h"

#include <cstdlib>
#include <cstring>

namespace difftrain {

bool env_switch(const char* name, bool fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::strcmp(value, "0") != 0;
}

}  // namespace difftrain
