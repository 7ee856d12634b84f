#pragma once
// Where the tests and benchmarks find the source tree's files (tests/golden, configs) and the
// programs they start. Each path comes from one small file compiled with it (source_dir.cpp,
// program_paths.cpp), not from a definition on every test file, so that a clone in another folder
// shares ccache's results (CMakeLists.txt, ccache).

namespace difftrain_test {

/// The source tree's root (the folder of the top-level CMakeLists.txt), absolute.
const char* source_dir();

}  // namespace difftrain_test
