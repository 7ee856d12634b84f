#pragma once
// difftrain's command line as a library call: a program of its own that registers more model
// families (families/family.h: register_family) runs every difftrain command with them
// (examples/custom_family). The `difftrain` program is this call and nothing else.

namespace difftrain::cli {

/// Runs `argv` as the `difftrain` program would (argv[0] is the program): parses the command and
/// its flags, runs it, and returns the exit code (0 on success; 1 with a one-line
/// "difftrain: error: ..." on stderr for bad input). Under `difftrain launch` with this program
/// as the ranks' program, each rank is a fork of it that calls run_cli again, so the families it
/// registered are there too.
int run_cli(int argc, char** argv);

}  // namespace difftrain::cli
