#pragma once

// Internal to src/data: the worker threads of one DataLoader pass.

#include "difftrain/data/collate.h"

#include <condition_variable>
#include <cstdint>
#include <exception>
#include <functional>
#include <map>
#include <mutex>
#include <thread>
#include <vector>

namespace difftrain::data {

/// Produces load(begin), load(begin + 1), ..., load(end - 1), delivered strictly in that order.
/// With num_workers > 0, that many threads load ahead, at most `capacity` batches past the one
/// the consumer waits for (torch: `num_workers * prefetch_factor` batches in flight); with 0,
/// next() loads in the calling thread. An exception thrown by load() is rethrown by next() at
/// that batch.
class Prefetcher {
 public:
  using LoadFn = std::function<Batch(int64_t)>;
  Prefetcher(LoadFn load, int64_t begin, int64_t end, int num_workers, int64_t capacity);
  /// stop().
  ~Prefetcher();
  Prefetcher(const Prefetcher&) = delete;
  Prefetcher& operator=(const Prefetcher&) = delete;

  /// The batch at the next index (blocking until a worker has it). Requires index < end.
  Batch next();
  /// Tells the workers to finish the batch they are loading and exit, and joins them.
  /// Idempotent; next() must not be called afterwards.
  void stop();

 private:
  struct Slot {
    Batch batch;
    std::exception_ptr error;
  };
  void work();

  LoadFn load_;
  const int64_t end_;
  const int64_t capacity_;
  std::mutex mutex_;
  std::condition_variable space_;  // workers wait for room in the window (or stop)
  std::condition_variable ready_;  // the consumer waits for its batch
  int64_t next_;                   // index the consumer takes next
  int64_t scheduled_;              // next index a worker will claim
  bool stopping_ = false;
  std::map<int64_t, Slot> done_;  // loaded, not yet taken
  std::vector<std::thread> workers_;
};

}  // namespace difftrain::data
