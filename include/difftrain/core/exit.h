#pragma once

namespace difftrain {

/// Ends the process with `rc` once its own work is done: flushes C and C++ standard streams and
/// the log, then leaves with _exit, skipping static destructors. LibTorch's (deregistering its
/// thousands of operators one by one) took about 60 ms of `difftrain --version` and up to 0.2 s
/// after a training run here. Call it only after every object that writes files or talks to
/// other processes has been destroyed. Sanitizer builds and DIFFTRAIN_QUICK_EXIT=0 use
/// std::exit instead (leak checks run at exit).
[[noreturn]] void exit_process(int rc);

}  // namespace difftrain
