#include "prefetcher.h"

#include <utility>

namespace difftrain::data {

Prefetcher::Prefetcher(LoadFn load, int64_t begin, int64_t end, int num_workers, int64_t capacity)
    : load_(std::move(load)),
      end_(end),
      capacity_(capacity < 1 ? 1 : capacity),
      next_(begin),
      scheduled_(begin) {
  workers_.reserve(static_cast<size_t>(num_workers));
  for (int i = 0; i < num_workers; ++i) workers_.emplace_back([this] { work(); });
}

Prefetcher::~Prefetcher() { stop(); }

void Prefetcher::stop() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
  }
  space_.notify_all();
  for (auto& worker : workers_) {
    if (worker.joinable()) worker.join();
  }
  workers_.clear();
}

void Prefetcher::work() {
  std::unique_lock<std::mutex> lock(mutex_);
  while (true) {
    space_.wait(lock,
                [&] { return stopping_ || scheduled_ >= end_ || scheduled_ < next_ + capacity_; });
    if (stopping_ || scheduled_ >= end_) return;
    const int64_t index = scheduled_++;
    lock.unlock();
    Slot slot;
    try {
      slot.batch = load_(index);
    } catch (...) {
      slot.error = std::current_exception();
    }
    lock.lock();
    done_.emplace(index, std::move(slot));
    ready_.notify_all();
  }
}

Batch Prefetcher::next() {
  if (workers_.empty()) return load_(next_++);
  Slot slot;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    const int64_t index = next_;
    ready_.wait(lock, [&] { return done_.count(index) > 0; });
    auto found = done_.find(index);
    slot = std::move(found->second);
    done_.erase(found);
    ++next_;
  }
  space_.notify_all();
  if (slot.error) std::rethrow_exception(slot.error);
  return std::move(slot.batch);
}

}  // namespace difftrain::data
