#include "commands.h"
#include "difftrain/launch/self_check.h"

#include <iostream>

namespace difftrain::cli {

CLI::App* add_test_command(CLI::App& app) {
  return app.add_subcommand(
      "test",
      "Multi-rank self-check (like `accelerate test`): run it under `difftrain launch "
      "--num_processes N difftrain test`; prints [PASS]/[FAIL] per check");
}

int run_test() { return launch::run_self_check(std::cout) == 0 ? 0 : 1; }

}  // namespace difftrain::cli
