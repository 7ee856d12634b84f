#include "commands.h"
#include "difftrain/distributed/process_group.h"
#include "difftrain/launch/env_report.h"
#include "difftrain/models/kernels/fused_ops.h"
#include "difftrain/models/kernels/packed_matmul.h"
#include "difftrain/models/kernels/winograd_conv.h"

#include <iostream>
#include <string>

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
  std::string report = launch::environment_report(g_probe_seconds);
  // The model-level CPU paths, right under the CPU line (the launch layer does not see models).
  const std::string kernels = "- CPU kernels: fused attention and GroupNorm+SiLU " +
                              std::string(models::fused_kernels_enabled() ? "on" : "off") + " (" +
                              models::fused_kernels_isa() + "); " + models::winograd_conv_status() +
                              "; " + models::packed_linear_grad_status() + "\n";
  const auto cpu = report.find("- CPU: ");
  const auto eol = cpu == std::string::npos ? std::string::npos : report.find('\n', cpu);
  if (eol == std::string::npos) {
    report += kernels;
  } else {
    report.insert(eol + 1, kernels);
  }
  std::cout << "Copy-and-paste the text below in your bug report.\n\n" << report;
  return 0;
}

}  // namespace difftrain::cli
