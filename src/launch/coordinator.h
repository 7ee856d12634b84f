#pragma once

// Internal to the launcher: how the launchers of a multi-machine job meet and tell each other
// about failures, through a c10d TCPStore that machine 0's launcher hosts.

#include <torch/csrc/distributed/c10d/Store.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>

namespace difftrain::launch {

/// What one launcher learned from another: the group must stop, and either restart or end.
struct RemoteAbort {
  bool restart = false;  ///< true: restart the group; false: the job is over
  int exit_code = 1;     ///< the failing rank's code, for a final abort
  std::string message;   ///< "rank 3 on machine 1 exited with status 7"
};

class Coordinator {
 public:
  /// Machine 0 hosts the store on `port` (all interfaces, as c10d's TCPStore does); every machine
  /// then registers and waits up to `join_timeout` for all others, naming the missing ones.
  Coordinator(const std::string& host, int port, int num_machines, int machine_rank,
              std::chrono::milliseconds join_timeout);
  ~Coordinator();

  /// Starts watching generation `generation` for aborts from other machines.
  void watch(int generation);
  /// An abort posted by another machine for the watched generation, if any.
  std::optional<RemoteAbort> remote_abort();
  /// Tells the other machines to stop generation `generation` (bounded: never blocks for long).
  void post_abort(int generation, const RemoteAbort& abort);
  /// Marks this machine's ranks of `generation` as finished; then waits until every machine's are,
  /// or an abort arrives (returned), or the store is gone (the job is then over for us).
  std::optional<RemoteAbort> finish(int generation, const std::function<bool()>& interrupted);

 private:
  /// What the watcher thread shares with the launcher. The thread holds its own reference, so a
  /// watcher still inside a store call when the launcher ends never touches freed memory.
  struct Watch {
    c10::intrusive_ptr<c10d::Store> store;  // the watcher's own client
    int machine_rank = 0;
    std::atomic<int> generation{-1};
    std::atomic<bool> store_lost{false};
    std::mutex mutex;
    std::condition_variable wake;
    bool stop = false;                 // under mutex
    bool exited = false;               // under mutex: the thread has left its loop
    std::optional<RemoteAbort> abort;  // under mutex
  };
  static void watch_loop(const std::shared_ptr<Watch>& watch);

  int num_machines_;
  int machine_rank_;
  c10::intrusive_ptr<c10d::Store> server_;  // machine 0 only
  c10::intrusive_ptr<c10d::Store> main_;    // this launcher's client
  std::shared_ptr<Watch> watch_;
  std::thread thread_;
};

}  // namespace difftrain::launch
