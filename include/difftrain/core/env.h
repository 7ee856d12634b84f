#pragma once

#include <atomic>

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

}  // namespace difftrain
