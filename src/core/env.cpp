#include "difftrain/core/env.h"

#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace difftrain {

bool env_switch(const char* name, bool fallback) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return fallback;
  return std::strcmp(value, "0") != 0;
}

std::string shell_command(const std::vector<std::string>& argv) {
  std::string out;
  for (const auto& word : argv) {
    if (!out.empty()) out += ' ';
    const bool plain = !word.empty() && word.find_first_not_of(
                                            "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                            "0123456789_-+=/.,:@%") == std::string::npos;
    if (plain) {
      out += word;
      continue;
    }
    out += '\'';
    for (char c : word) out += c == '\'' ? std::string("'\\''") : std::string(1, c);
    out += '\'';
  }
  return out;
}

void remember_user_command(int argc, char** argv) {
  ::setenv("DIFFTRAIN_COMMAND", shell_command(std::vector<std::string>(argv, argv + argc)).c_str(),
           /*overwrite=*/0);
}

std::string user_command() {
  const char* c = std::getenv("DIFFTRAIN_COMMAND");
  return c ? c : "";
}

}  // namespace difftrain
