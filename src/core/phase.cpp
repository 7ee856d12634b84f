// The rank's side of the status pipe to `difftrain launch`, and the phase listeners.
#include "difftrain/core/phase.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <map>
#include <mutex>

namespace difftrain::core {
namespace {

using Clock = std::chrono::steady_clock;

struct State {
  std::mutex mutex;
  bool opened = false;
  int fd = -1;  // the status pipe, or -1
  std::string phase;
  Clock::time_point last_note{};
  std::map<int, std::function<void(const std::string&)>> listeners;
  int next_id = 1;
};

State& state() {
  static State* s = new State;  // never destroyed: used by whatever runs at exit
  return *s;
}

// The launcher's pipe, checked once: a descriptor that is not a pipe (a stale variable) is left
// alone.
int status_fd(State& s) {
  if (s.opened) return s.fd;
  s.opened = true;
  const char* value = std::getenv(kStatusFdEnv);
  if (value == nullptr || *value == '\0') return -1;
  char* end = nullptr;
  const long fd = std::strtol(value, &end, 10);
  struct stat st {};
  if (end == value || *end != '\0' || fd < 3 || fstat(static_cast<int>(fd), &st) != 0 ||
      !S_ISFIFO(st.st_mode)) {
    return -1;
  }
  s.fd = static_cast<int>(fd);
  // Never block on the launcher, never pass the pipe to a child, and a launcher that is gone
  // must not kill the rank with SIGPIPE (its own SIGKILL on the launcher's death does that).
  fcntl(s.fd, F_SETFL, fcntl(s.fd, F_GETFL) | O_NONBLOCK);
  fcntl(s.fd, F_SETFD, FD_CLOEXEC);
  struct sigaction current {};
  if (sigaction(SIGPIPE, nullptr, &current) == 0 && current.sa_handler == SIG_DFL) {
    signal(SIGPIPE, SIG_IGN);
  }
  return s.fd;
}

void send(State& s, const std::string& line) {
  const int fd = status_fd(s);
  if (fd < 0) return;
  // One write of a short line is atomic on a pipe; a full pipe drops it (the next one counts).
  [[maybe_unused]] const auto n = ::write(fd, line.data(), line.size());
}

}  // namespace

void set_phase(const std::string& what) {
  State& s = state();
  std::map<int, std::function<void(const std::string&)>> listeners;
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.phase == what) return;
    s.phase = what;
    std::string line = "phase " + what;
    for (char& c : line) {
      if (c == '\n' || c == '\r') c = ' ';
    }
    send(s, line.substr(0, 400) + "\n");
    s.last_note = Clock::now();
    listeners = s.listeners;
  }
  for (const auto& [id, listener] : listeners) {
    try {
      listener(what);
    } catch (...) {
      // A listener that cannot post (the store is gone) must not stop the work itself.
    }
  }
}

std::string phase() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  return s.phase;
}

void note_progress() {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  const auto now = Clock::now();
  if (now - s.last_note < std::chrono::milliseconds(200)) return;
  s.last_note = now;
  send(s, "progress\n");
}

int add_phase_listener(std::function<void(const std::string&)> listener) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  const int id = s.next_id++;
  s.listeners[id] = std::move(listener);
  return id;
}

void remove_phase_listener(int id) {
  State& s = state();
  std::lock_guard<std::mutex> lock(s.mutex);
  s.listeners.erase(id);
}

PhaseScope::PhaseScope(const std::string& what) : previous_(phase()) { set_phase(what); }

PhaseScope::~PhaseScope() { set_phase(previous_); }

}  // namespace difftrain::core
