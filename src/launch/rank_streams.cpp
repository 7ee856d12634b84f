// The launcher's side of a rank's pipes: output relayed whole lines at a time, status reports
// read, and the CPU time the rank used (a stopping rank that still computes makes progress).
#include "rank_streams.h"

#include <fcntl.h>

#include <cerrno>
#include <cstdio>
#include <cstring>

namespace difftrain::launch {

void write_all(int fd, const std::string& data) {
  size_t offset = 0;
  while (offset < data.size()) {
    const ssize_t n = write(fd, data.data() + offset, data.size() - offset);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return;  // a closed terminal or log must not stop the job
    offset += static_cast<size_t>(n);
  }
}

// CPU seconds (user + system, every thread) process `pid` has used, or -1.
double cpu_seconds(pid_t pid) {
  std::FILE* f = std::fopen(("/proc/" + std::to_string(pid) + "/stat").c_str(), "r");
  if (f == nullptr) return -1;
  char buffer[1024];
  const size_t n = std::fread(buffer, 1, sizeof(buffer) - 1, f);
  std::fclose(f);
  buffer[n] = '\0';
  // Fields after the command name (in parentheses, which may hold spaces): state is field 3,
  // utime 14 and stime 15.
  const char* p = std::strrchr(buffer, ')');
  if (p == nullptr) return -1;
  unsigned long long utime = 0, stime = 0;
  if (std::sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &utime,
                  &stime) != 2) {
    return -1;
  }
  return static_cast<double>(utime + stime) / static_cast<double>(sysconf(_SC_CLK_TCK));
}

// Reads the rank's status lines ("phase <text>", "progress"); returns false at end of stream.
bool pump_report(Rank& rank) {
  char buffer[4096];
  bool open = true;
  while (true) {
    const ssize_t n = read(rank.report.fd, buffer, sizeof(buffer));
    if (n > 0) {
      rank.report.pending.append(buffer, static_cast<size_t>(n));
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    close(rank.report.fd);
    rank.report.fd = -1;
    open = false;
    break;
  }
  for (auto newline = rank.report.pending.find('\n'); newline != std::string::npos;
       newline = rank.report.pending.find('\n')) {
    const std::string line = rank.report.pending.substr(0, newline);
    rank.report.pending.erase(0, newline + 1);
    if (line.rfind("phase ", 0) == 0) rank.phase = line.substr(6);
    rank.last_progress = std::chrono::steady_clock::now();
  }
  if (rank.report.pending.size() > 4096) rank.report.pending.clear();
  return open;
}

void emit(Rank& rank, Stream& stream, bool flush_partial) {
  std::string block;
  size_t start = 0;
  while (true) {
    const auto newline = stream.pending.find('\n', start);
    if (newline == std::string::npos) break;
    block += rank.prefix;
    block.append(stream.pending, start, newline - start + 1);
    start = newline + 1;
  }
  stream.pending.erase(0, start);
  // A line with no end in sight is cut rather than buffered without bound.
  if ((flush_partial && !stream.pending.empty()) || stream.pending.size() > (1 << 16)) {
    block += rank.prefix + stream.pending + "\n";
    stream.pending.clear();
  }
  if (block.empty()) return;
  write_all(stream.target, block);
  if (rank.log_fd >= 0) write_all(rank.log_fd, block);
}

// Reads what is available; returns false at end of stream.
bool pump(Rank& rank, Stream& stream) {
  char buffer[8192];
  while (true) {
    const ssize_t n = read(stream.fd, buffer, sizeof(buffer));
    if (n > 0) {
      stream.pending.append(buffer, static_cast<size_t>(n));
      if (static_cast<size_t>(n) < sizeof(buffer)) break;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    emit(rank, stream, true);
    close(stream.fd);
    stream.fd = -1;
    return false;
  }
  emit(rank, stream, false);
  return true;
}

}  // namespace difftrain::launch
