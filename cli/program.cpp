// difftrain: distributed training of diffusion models. The program is the command line
// (difftrain/cli/run.h); a program with families of its own calls the same
// (examples/custom_family).
#include "difftrain/cli/run.h"
#include "difftrain/core/exit.h"

// Everything run_cli made is gone when it returns: skip the static destructors (exit.h).
int main(int argc, char** argv) { difftrain::exit_process(difftrain::cli::run_cli(argc, argv)); }
