#pragma once
// The programs the multi-process and CLI tests start, by absolute path in the build folder
// (program_paths.cpp, compiled with their paths; see source_dir.h for why).

namespace difftrain_test {

/// The `difftrain` command-line program.
const char* difftrain_bin();
/// tests/dist/worker/dist_worker.cpp's program.
const char* dist_worker_bin();
/// tests/dist/worker/accel_worker.cpp's program.
const char* accel_worker_bin();
/// The folder of the built examples (example_custom_loop, ...).
const char* examples_dir();
/// The LD_PRELOAD library that logs listen() calls (the security test).
const char* listen_probe_lib();

}  // namespace difftrain_test
