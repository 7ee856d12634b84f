#include "commands.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/launch/env_report.h"

#include <iostream>

namespace difftrain::cli {

namespace {
double g_probe_seconds = 1.0;
}

CLI::App* add_env_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "env",
      "Print versions, BLAS and its measured speed, threads, CPU, CUDA/NCCL and the default "
      "config, for bug reports (like `accelerate env`)");
  cmd->add_option("--probe_seconds,--probe-seconds", g_probe_seconds,
                  "How long the matmul GFLOP/s probe runs (0 skips it)")
      ->check(CLI::Range(0.0, 60.0));
  return cmd;
}

int run_env() {
  distributed::configure_threads();
  std::cout << "Copy-and-paste the text below in your bug report.\n\n"
            << launch::environment_report(g_probe_seconds);
  return 0;
}

}  // namespace difftrain::cli
