#include "program_paths.h"

namespace difftrain_test {

const char* difftrain_bin() { return DIFFTRAIN_BIN; }
const char* dist_worker_bin() { return DIST_WORKER_BIN; }
const char* accel_worker_bin() { return ACCEL_WORKER_BIN; }
const char* examples_dir() { return EXAMPLES_DIR; }
const char* listen_probe_lib() { return LISTEN_PROBE_LIB; }

}  // namespace difftrain_test
