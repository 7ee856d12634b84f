#pragma once

// Internal to the launcher: a rank's pipes as the launcher reads them (its stdout and stderr,
// relayed line by line with a prefix, and its status pipe: phase and progress, core/phase.h).

#include <sys/types.h>
#include <unistd.h>

#include <chrono>
#include <string>

namespace difftrain::launch {

/// One pipe from a rank (its stdout or stderr): bytes are cut into whole lines, and each line is
/// written with one write() so lines of different ranks never interleave mid-line.
struct Stream {
  int fd = -1;
  int target = STDOUT_FILENO;
  std::string pending;
};

/// One local rank as the launcher sees it.
struct Rank {
  int local_rank = 0;
  int global_rank = 0;
  pid_t pid = -1;
  bool running = false;
  int status = 0;
  Stream out, err;
  // What the rank reports through its status pipe (core/phase.h): its phase ("" while
  // training) and when it last said its work moved on.
  Stream report;
  std::string phase;
  std::chrono::steady_clock::time_point last_progress{};
  // CPU seconds the rank had used when last looked at (a rank that computes makes progress).
  double cpu_seen = -1;
  int log_fd = -1;
  std::string prefix;
};

/// Writes all of `data` to `fd`, retrying short writes; gives up quietly on a closed terminal or
/// log (which must not stop the job).
void write_all(int fd, const std::string& data);

/// Writes the complete lines `stream` holds, each prefixed with the rank's prefix, to the
/// stream's target and the rank's log; with `flush_partial`, an unfinished last line too.
void emit(Rank& rank, Stream& stream, bool flush_partial);

/// Reads what is available from one of the rank's output pipes; returns false at end of stream.
bool pump(Rank& rank, Stream& stream);

/// Reads the rank's status lines ("phase <text>", "progress"); returns false at end of stream.
bool pump_report(Rank& rank);

/// CPU seconds (user + system, every thread) process `pid` has used, or -1.
double cpu_seconds(pid_t pid);

}  // namespace difftrain::launch
