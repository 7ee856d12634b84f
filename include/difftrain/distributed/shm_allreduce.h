#pragma once

#include "difftrain/core/torch_compat.h"

#include <torch/types.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

namespace difftrain::distributed {

/// Sum all-reduce through shared memory, for a group whose ranks all run on one machine (the
/// `difftrain launch --num_processes N` layout on a CPU box). Gloo would carry the same bytes
/// through loopback TCP: four kernel copies, socket wake-ups and its own threads, all on the
/// cores the ranks compute on. Here every rank copies its chunk into its slot of one shared
/// segment, rank r sums segment r of every slot in rank order into a shared result, and every
/// rank copies the result back: two barriers per chunk (a futex on a shared counter).
/// The sum of an element is computed once, in rank order, so every rank gets the same bits; with
/// two ranks it equals Gloo's (a + b == b + a).
///
/// Work runs on one thread per group, in launch order, so async all-reduces overlap the
/// backward as Gloo's do. A rank that exits mid-collective is noticed within ~0.1 s (its pid is
/// gone) and every later collective on this transport fails at once with an error naming it;
/// a rank that is alive but stuck fails after the group's collective timeout.
class ShmAllReduce {
 public:
  /// Tries to set up the transport for `rank` of `world` through `store` (every rank must call
  /// this, in the same order with respect to other store traffic). Returns nullptr on every rank
  /// when any rank cannot (another machine, no /dev/shm, DIFFTRAIN_SHM_ALLREDUCE=0), so all
  /// ranks agree on the transport. `chunk_bytes`: bytes per rank's slot (default 4 MiB).
  static std::unique_ptr<ShmAllReduce> create(c10d::Store& store, int rank, int world,
                                              std::chrono::milliseconds timeout,
                                              int64_t chunk_bytes = int64_t{4} << 20);
  ~ShmAllReduce();
  ShmAllReduce(const ShmAllReduce&) = delete;
  ShmAllReduce& operator=(const ShmAllReduce&) = delete;

  /// False when DIFFTRAIN_SHM_ALLREDUCE is 0, false or off in this process's environment.
  static bool enabled_by_environment();
  /// Whether `tensor` can go this way: a contiguous float32 or float64 CPU tensor.
  static bool accepts(const torch::Tensor& tensor);
  /// Starts an in-place sum of `tensor` over the ranks; wait on the returned Work.
  c10::intrusive_ptr<c10d::Work> launch(torch::Tensor tensor);
  /// Bytes of the shared segment (every rank maps the same one).
  int64_t segment_bytes() const { return segment_bytes_; }

 private:
  struct Header;
  ShmAllReduce(int rank, int world, std::chrono::milliseconds timeout, int64_t chunk_bytes,
               void* base, int64_t bytes);
  struct Job;
  void run();
  void reduce(torch::Tensor& tensor);
  template <typename T>
  void reduce_typed(T* data, int64_t numel);
  void barrier();

  int rank_;
  int world_;
  std::chrono::milliseconds timeout_;
  int64_t chunk_bytes_;
  void* base_;
  int64_t segment_bytes_;
  Header* header_;
  uint32_t barriers_ = 0;  // barriers this rank has passed

  std::mutex mutex_;
  std::condition_variable cv_;
  std::deque<std::shared_ptr<Job>> queue_;
  std::atomic<bool> stopping_{false};  // set under mutex_ by the destructor
  std::string broken_;                 // set once a collective failed: later ones fail at once
  std::thread worker_;
};

}  // namespace difftrain::distributed
