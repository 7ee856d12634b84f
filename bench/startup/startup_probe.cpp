// What every difftrain process does before its own work: load LibTorch (and the ~290 libraries
// Debian's build pulls in), start the log, run one tensor operation, leave. Built twice, with the
// library order of scripts/link_order (startup_probe) and with the linker's natural order
// (startup_probe_natural): bench/startup.sh times both side by side, and
// tests/link_order_check.sh checks that every symbol binds to the same library in both.
#include "difftrain/core/exit.h"
#include "difftrain/core/log.h"

#include <torch/torch.h>

#include <cstdio>

int main() {
  difftrain::log::init();
  const float sum = torch::ones({4, 4}).sum().item<float>();
  std::printf("startup_probe: sum %.0f\n", sum);
  difftrain::exit_process(sum == 16.0f ? 0 : 1);
}
