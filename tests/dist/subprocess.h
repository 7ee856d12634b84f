#pragma once

// Runs real processes for the dist tests: output captured, a hard time limit, and the whole
// process group killed when the limit is hit, so a hanging launcher fails a test instead of CI.

#include <sys/types.h>

#include <map>
#include <string>
#include <vector>

namespace difftrain::testing {

struct ProcessResult {
  int exit_code = -1;   ///< exit status, or 128 + signal
  int term_signal = 0;  ///< signal that ended it, if any
  bool timed_out = false;
  double seconds = 0;
  std::string out, err;
  /// Both streams, for failure messages.
  std::string log() const { return "--- stdout ---\n" + out + "--- stderr ---\n" + err; }
};

class Process {
 public:
  /// Starts `argv` with the current environment plus `env` (a value of "" unsets the variable).
  Process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {});
  ~Process();
  pid_t pid() const { return pid_; }
  /// Waits up to `timeout_s`; past it, SIGKILLs the process group and marks timed_out.
  ProcessResult wait(double timeout_s);
  void signal(int signo);

 private:
  pid_t pid_ = -1;
  int out_fd_ = -1, err_fd_ = -1;
  double started_ = 0;
  bool done_ = false;
};

ProcessResult run(const std::vector<std::string>& argv,
                  const std::map<std::string, std::string>& env = {}, double timeout_s = 120);

/// True while `pid` exists and is not a zombie.
bool alive(pid_t pid);

/// A fresh temporary folder.
std::string make_temp_dir(const std::string& tag);

}  // namespace difftrain::testing
