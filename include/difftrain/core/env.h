#pragma once

#include <atomic>
#include <string>
#include <vector>

namespace difftrain {

/// An on/off environment variable: unset or empty gives `fallback`, "0" is off, any other value
/// is on (DIFFTRAIN_WINOGRAD=0, DIFFTRAIN_LAUNCH_EXEC=1, ...).
bool env_switch(const char* name, bool fallback);

/// A process-wide on/off setting read from env_switch(name, fallback) on first use, which code
/// (tests, benchmarks) can override with set(). Safe to use from several threads.
class EnvSwitch {
 public:
  constexpr EnvSwitch(const char* name, bool fallback) : name_(name), fallback_(fallback) {}
  bool get() {
    int v = state_.load();
    if (v < 0) {
      v = env_switch(name_, fallback_) ? 1 : 0;
      state_.store(v);
    }
    return v == 1;
  }
  void set(bool on) { state_.store(on ? 1 : 0); }

 private:
  const char* name_;
  bool fallback_;
  std::atomic<int> state_{-1};  // -1: not read from the environment yet
};

/// `argv` as one shell command line: words quoted with '' where the shell would split or
/// expand them.
std::string shell_command(const std::vector<std::string>& argv);

/// Records the command the user typed in DIFFTRAIN_COMMAND, unless an outer difftrain process
/// (`difftrain launch`) already did: its ranks inherit the launcher's command line.
void remember_user_command(int argc, char** argv);

/// The command recorded by remember_user_command ("" when none was).
std::string user_command();

}  // namespace difftrain
