#pragma once

#include <functional>
#include <string>

namespace difftrain::core {

/// What this process is doing when it is not training: "saving checkpoint-7", "validation at
/// step 8", "caching text embeddings". Those who wait on it read it: `difftrain launch` (a rank
/// that still makes progress after SIGTERM is given time to finish), and the other ranks (a
/// collective that times out names what the slow rank was doing). "" while training.
void set_phase(const std::string& what);
/// The phase set last ("" while training).
std::string phase();

/// Says the current work moved on (a tensor written, a sampler step, a micro-batch). Cheap: at
/// most a few notes per second leave the process.
void note_progress();

/// Called with every new phase, on the thread that set it (the process group posts it to the
/// rendezvous store). Returns an id for remove_phase_listener.
int add_phase_listener(std::function<void(const std::string&)> listener);
void remove_phase_listener(int id);

/// Sets a phase for a scope and puts the previous one back at its end.
class PhaseScope {
 public:
  explicit PhaseScope(const std::string& what);
  ~PhaseScope();
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  std::string previous_;
};

/// The environment variable naming the pipe (a file descriptor) a rank reports its phase and
/// progress to; `difftrain launch` sets it. Lines: "phase <text>" and "progress".
inline constexpr const char* kStatusFdEnv = "DIFFTRAIN_STATUS_FD";

}  // namespace difftrain::core
