#pragma once

#include "difftrain/data/collate.h"
#include "difftrain/data/dataset.h"
#include "difftrain/data/sharding.h"

#include <nlohmann/json_fwd.hpp>

#include <cstddef>
#include <cstdint>
#include <functional>
#include <iterator>
#include <memory>
#include <vector>

namespace difftrain::data {

/// Options of a DataLoader (torch: the `DataLoader(...)` keyword arguments).
struct DataLoaderOptions {
  /// Examples per batch (per rank, or global with ShardOptions::split_batches). torch default 1.
  int64_t batch_size = 1;
  /// Reshuffle every epoch (torch `shuffle`).
  bool shuffle = false;
  /// Drop the last short batch (torch `drop_last`; with sharding, the last partial global step).
  bool drop_last = false;
  /// Background prefetch threads; 0 loads in the calling thread (torch `num_workers`, but
  /// threads instead of processes).
  int num_workers = 0;
  /// Batches buffered per worker (torch `prefetch_factor`, default 2).
  int prefetch_factor = 2;
  /// The order of epoch e is torch::randperm(N) from a CPU generator seeded `seed + e`, identical
  /// on every rank (Accelerate's `SeedableRandomSampler`, `data_seed`).
  uint64_t seed = 0;
  /// Turns a batch's examples into a Batch (torch `collate_fn`); empty means default_collate.
  CollateFn collate;
  /// A custom sampler (torch `sampler`): the order of epoch e, dataset->size() indices; set, it
  /// replaces `shuffle` (aspect-ratio buckets, data/buckets.h). It must depend on e alone so
  /// every rank and every resume sees the same order.
  std::function<std::vector<int64_t>(int64_t epoch)> sampler;
};

/// A checkpointable position: the epoch, and how many batches this rank has consumed in it
/// (Accelerate saves it as the sampler's epoch plus `skip_first_batches(n)` on resume).
struct LoaderState {
  int64_t epoch = 0;
  int64_t batches_consumed = 0;
};

/// {"epoch": e, "batches_consumed": n} (nlohmann ADL hook, so `json j = state` works).
void to_json(nlohmann::json& json, const LoaderState& state);
/// Reads what to_json wrote; throws difftrain::Error naming a missing or negative field.
void from_json(const nlohmann::json& json, LoaderState& state);

/// Batches over a map-style Dataset, optionally shuffled, sharded across ranks and prefetched by
/// worker threads (torch `DataLoader`; once sharded, Accelerate's `DataLoaderShard`).
///
///     for (const Batch& batch : loader) { ... }   // one epoch
///
/// Each begin() runs one epoch, starting at state(): after a complete pass the epoch advances;
/// a pass abandoned mid-epoch (break) also counts as finished at the next begin(), unless
/// load_state(), skip_first_batches() or set_epoch() positioned the loader since. Those calls and
/// shard() invalidate live iterators and stop their workers: an invalidated iterator is not at its
/// end, and dereferencing or incrementing it throws difftrain::Error saying it was invalidated.
/// Not thread-safe itself: iterate a loader from one thread at a time.
class DataLoader {
 public:
  /// One pass (internal, defined in data_loader.cpp): the epoch's batches, its prefetch
  /// workers and the current batch.
  struct Iteration;

  /// Input iterator over one pass; *it is valid until the next ++it. Copies share the pass;
  /// the pass's workers stop and join when the last copy is destroyed (e.g. on break).
  class Iterator {
   public:
    using iterator_category = std::input_iterator_tag;
    using value_type = Batch;
    using difference_type = std::ptrdiff_t;
    using pointer = const Batch*;
    using reference = const Batch&;

    /// The end iterator.
    Iterator() = default;
    /// The current batch, already on ShardOptions::device.
    const Batch& operator*() const;
    const Batch* operator->() const { return &**this; }
    /// Loads the next batch (rethrowing a worker's exception for it) or reaches the end.
    Iterator& operator++();
    bool operator==(const Iterator& other) const;
    bool operator!=(const Iterator& other) const { return !(*this == other); }

   private:
    friend class DataLoader;
    explicit Iterator(std::shared_ptr<Iteration> iteration) : iteration_(std::move(iteration)) {}
    bool at_end() const;
    [[noreturn]] static void throw_invalidated();
    std::shared_ptr<Iteration> iteration_;
  };
  using iterator = Iterator;

  /// Throws difftrain::Error for a null dataset, batch_size < 1, num_workers < 0 or
  /// prefetch_factor < 1.
  DataLoader(std::shared_ptr<Dataset> dataset, DataLoaderOptions options);
  /// Stops and joins the workers of a live pass.
  ~DataLoader();
  DataLoader(const DataLoader&) = delete;
  DataLoader& operator=(const DataLoader&) = delete;

  /// Cuts the loader across ranks (called by Accelerator::prepare; Accelerate
  /// `prepare_data_loader`). Throws difftrain::Error for an invalid `shard` (see check_shard).
  void shard(const ShardOptions& shard);
  const ShardOptions& shard_options() const { return shard_; }
  const DataLoaderOptions& options() const { return options_; }
  const std::shared_ptr<Dataset>& dataset() const { return dataset_; }

  /// Batches THIS rank yields per epoch (torch/Accelerate `len(dataloader)`).
  int64_t size() const;
  /// The minimum of size() over every rank; equals size() unless even_batches is false.
  int64_t common_size() const;
  /// Examples per optimizer step over all ranks (Accelerate `total_batch_size`):
  /// batch_size with split_batches, else batch_size * world_size.
  int64_t total_batch_size() const;

  /// Starts a pass over epoch state().epoch at batch state().batches_consumed (see class doc).
  Iterator begin();
  Iterator end() { return Iterator(); }

  /// The next pass runs epoch `epoch` from its first batch (torch `DistributedSampler.set_epoch`,
  /// Accelerate `DataLoaderShard.set_epoch`).
  void set_epoch(int64_t epoch);
  /// The next pass starts at batch n of the current epoch, state().epoch, without loading the
  /// skipped examples (Accelerate `accelerator.skip_first_batches(loader, n)`). Throws for n < 0.
  void skip_first_batches(int64_t n);
  /// Where the next pass would continue: mid-pass, {epoch, batches yielded so far}.
  LoaderState state() const { return {epoch_, consumed_}; }
  /// The next begin() continues exactly at `state`. Throws difftrain::Error for negative fields.
  void load_state(const LoaderState& state);

  /// Batches yielded so far in the current epoch, counting skipped ones (index of the last
  /// yielded batch + 1). position(), end_of_epoch() and in_uneven_tail() describe the most
  /// recently yielded batch and keep their values after a pass ends until the next begin();
  /// state() is where the next pass starts.
  int64_t position() const { return position_; }
  /// The most recently yielded batch is this rank's last of the epoch (Accelerate
  /// `gradient_state.end_of_dataloader`).
  bool end_of_epoch() const { return end_of_epoch_; }
  /// The most recently yielded batch has position() > common_size(): other ranks have run out
  /// (only possible with even_batches = false).
  bool in_uneven_tail() const { return in_uneven_tail_; }

  /// The epoch's example order: randperm(N) seeded seed + epoch when shuffling, else 0..N-1.
  std::vector<int64_t> epoch_order(int64_t epoch) const;
  /// The dataset indices of every batch this rank yields in `epoch` (shard_batches of
  /// epoch_order(epoch)).
  std::vector<std::vector<int64_t>> epoch_batches(int64_t epoch) const;

 private:
  void detach_live_iteration();
  void advance(Iteration& iteration);

  std::shared_ptr<Dataset> dataset_;
  DataLoaderOptions options_;
  ShardOptions shard_;
  int64_t epoch_ = 0;
  int64_t consumed_ = 0;
  // A pass was started and neither finished nor followed by load_state/skip/set_epoch.
  bool abandon_pending_ = false;
  int64_t position_ = 0;
  bool end_of_epoch_ = false;
  bool in_uneven_tail_ = false;
  std::weak_ptr<Iteration> live_;
};

}  // namespace difftrain::data
