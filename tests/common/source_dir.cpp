#include "source_dir.h"

namespace difftrain_test {

const char* source_dir() { return DIFFTRAIN_SOURCE_DIR; }

}  // namespace difftrain_test
