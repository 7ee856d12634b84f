#include "difftrain/data/data_loader.h"

#include "difftrain/core/error.h"
#include "prefetcher.h"

#include <ATen/CPUGeneratorImpl.h>
#include <c10/util/Exception.h>
#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <utility>

namespace difftrain::data {

// One pass over an epoch. Shared by the Iterator copies; the loader only watches it (weak_ptr),
// so the workers stop when the user's loop lets go of its iterator.
struct DataLoader::Iteration {
  DataLoader* loader = nullptr;  // null once the loader moved on (the pass is stale)
  int64_t epoch = 0;
  int64_t total = 0;  // batches this rank yields in the epoch
  int64_t next = 0;   // index of the next batch to fetch
  bool done = false;
  // Detached before the pass finished (the loader was repositioned, re-sharded or destroyed):
  // such an iterator is not at its end, and using it throws the invalidation message.
  bool stale = false;
  Batch current;
  torch::Device device = torch::kCPU;
  std::unique_ptr<Prefetcher> prefetcher;  // last member: its workers stop before the rest dies

  void detach() {
    if (!done) stale = true;
    loader = nullptr;
    done = true;
    if (prefetcher) prefetcher->stop();
  }
};

namespace {

std::string one_line(std::string text) {
  std::replace(text.begin(), text.end(), '\n', ' ');
  return text;
}

}  // namespace

// ------------------------------------------------------------------ LoaderState json

void to_json(nlohmann::json& json, const LoaderState& state) {
  json = nlohmann::json{{"epoch", state.epoch}, {"batches_consumed", state.batches_consumed}};
}

void from_json(const nlohmann::json& json, LoaderState& state) {
  for (const char* key : {"epoch", "batches_consumed"}) {
    if (!json.is_object() || !json.contains(key) || !json.at(key).is_number_integer()) {
      throw Error(
          fmt::format("loader state {} has no integer '{}': expected "
                      "{{\"epoch\": e, \"batches_consumed\": n}} as DataLoader saves it",
                      json.dump(), key));
    }
    if (json.at(key).get<int64_t>() < 0) {
      throw Error(fmt::format("loader state field '{}' is {}: it must be >= 0", key,
                              json.at(key).get<int64_t>()));
    }
  }
  state.epoch = json.at("epoch").get<int64_t>();
  state.batches_consumed = json.at("batches_consumed").get<int64_t>();
}

// ------------------------------------------------------------------ DataLoader

DataLoader::DataLoader(std::shared_ptr<Dataset> dataset, DataLoaderOptions options)
    : dataset_(std::move(dataset)), options_(std::move(options)) {
  if (!dataset_) throw Error("DataLoader got a null dataset: pass a std::shared_ptr<Dataset>");
  if (options_.batch_size < 1) {
    throw Error(
        fmt::format("DataLoader batch_size is {}: it must be at least 1", options_.batch_size));
  }
  if (options_.num_workers < 0) {
    throw Error(
        fmt::format("DataLoader num_workers is {}: use 0 (load in the calling thread) or "
                    "more",
                    options_.num_workers));
  }
  if (options_.prefetch_factor < 1) {
    throw Error(fmt::format("DataLoader prefetch_factor is {}: it must be at least 1",
                            options_.prefetch_factor));
  }
  if (!options_.collate) options_.collate = default_collate;
}

DataLoader::~DataLoader() { detach_live_iteration(); }

void DataLoader::detach_live_iteration() {
  if (auto live = live_.lock()) live->detach();
  live_.reset();
}

void DataLoader::shard(const ShardOptions& shard) {
  check_shard(shard, options_.batch_size);
  detach_live_iteration();
  shard_ = shard;
}

int64_t DataLoader::size() const {
  return num_shard_batches(dataset_->size(), options_.batch_size, options_.drop_last, shard_);
}

int64_t DataLoader::common_size() const {
  return common_shard_batches(dataset_->size(), options_.batch_size, options_.drop_last, shard_);
}

int64_t DataLoader::total_batch_size() const {
  return shard_.split_batches ? options_.batch_size
                              : options_.batch_size * static_cast<int64_t>(shard_.world_size);
}

std::vector<int64_t> DataLoader::epoch_order(int64_t epoch) const {
  const int64_t n = dataset_->size();
  if (options_.sampler) {
    auto order = options_.sampler(epoch);
    if (static_cast<int64_t>(order.size()) != n) {
      throw Error("DataLoader: the sampler gave " + std::to_string(order.size()) +
                  " indices for a dataset of " + std::to_string(n));
    }
    return order;
  }
  torch::Tensor order;
  if (options_.shuffle) {
    auto generator = at::detail::createCPUGenerator(options_.seed + static_cast<uint64_t>(epoch));
    order = torch::randperm(n, generator, torch::TensorOptions().dtype(torch::kLong));
  } else {
    order = torch::arange(n, torch::TensorOptions().dtype(torch::kLong));
  }
  const int64_t* data = order.data_ptr<int64_t>();
  return std::vector<int64_t>(data, data + n);
}

std::vector<std::vector<int64_t>> DataLoader::epoch_batches(int64_t epoch) const {
  return shard_batches(epoch_order(epoch), options_.batch_size, options_.drop_last, shard_);
}

void DataLoader::set_epoch(int64_t epoch) {
  if (epoch < 0) throw Error(fmt::format("set_epoch({}): the epoch must be >= 0", epoch));
  detach_live_iteration();
  epoch_ = epoch;
  consumed_ = 0;
  abandon_pending_ = false;
}

void DataLoader::skip_first_batches(int64_t n) {
  if (n < 0) throw Error(fmt::format("skip_first_batches({}): n must be >= 0", n));
  detach_live_iteration();
  consumed_ = n;
  abandon_pending_ = false;
}

void DataLoader::load_state(const LoaderState& state) {
  if (state.epoch < 0 || state.batches_consumed < 0) {
    throw Error(fmt::format("load_state got epoch {} and batches_consumed {}: both must be >= 0",
                            state.epoch, state.batches_consumed));
  }
  detach_live_iteration();
  epoch_ = state.epoch;
  consumed_ = state.batches_consumed;
  abandon_pending_ = false;
}

DataLoader::Iterator DataLoader::begin() {
  detach_live_iteration();
  if (abandon_pending_) {  // the previous pass was left mid-epoch: like torch, it is over
    ++epoch_;
    consumed_ = 0;
  }
  auto batches = std::make_shared<const std::vector<std::vector<int64_t>>>(epoch_batches(epoch_));
  auto iteration = std::make_shared<Iteration>();
  iteration->loader = this;
  iteration->epoch = epoch_;
  iteration->total = static_cast<int64_t>(batches->size());
  iteration->next = std::min(consumed_, iteration->total);
  iteration->device = shard_.device;

  const int64_t epoch = epoch_;
  auto load = [dataset = dataset_, collate = options_.collate, batches, epoch](int64_t index) {
    try {
      const auto& indices = (*batches)[static_cast<size_t>(index)];
      std::vector<Example> examples;
      examples.reserve(indices.size());
      for (const int64_t i : indices) examples.push_back(dataset->get(i));
      return collate(examples);
    } catch (const c10::Error& e) {
      throw Error(fmt::format("batch {} of epoch {}: {}", index, epoch,
                              one_line(e.what_without_backtrace())));
    } catch (const std::exception& e) {
      throw Error(fmt::format("batch {} of epoch {}: {}", index, epoch, one_line(e.what())));
    }
  };
  // No more workers than batches left to load.
  const int workers =
      static_cast<int>(std::min<int64_t>(options_.num_workers, iteration->total - iteration->next));
  iteration->prefetcher = std::make_unique<Prefetcher>(
      std::move(load), iteration->next, iteration->total, workers,
      static_cast<int64_t>(options_.prefetch_factor) * options_.num_workers);

  position_ = iteration->next;
  end_of_epoch_ = false;
  in_uneven_tail_ = false;
  abandon_pending_ = true;
  live_ = iteration;
  advance(*iteration);
  return Iterator(std::move(iteration));
}

void DataLoader::advance(Iteration& iteration) {
  if (iteration.next >= iteration.total) {
    iteration.done = true;
    iteration.current.clear();
    iteration.prefetcher->stop();
    ++epoch_;
    consumed_ = 0;
    abandon_pending_ = false;
    return;
  }
  try {
    iteration.current = iteration.prefetcher->next();
  } catch (...) {
    // The pass is dead, as a torch iterator after an exception; the next begin() starts the
    // next epoch unless the loader is positioned explicitly.
    iteration.done = true;
    iteration.current.clear();
    iteration.prefetcher->stop();
    throw;
  }
  for (auto& [key, tensor] : iteration.current) tensor = tensor.to(iteration.device);
  ++iteration.next;
  position_ = iteration.next;
  consumed_ = iteration.next;
  end_of_epoch_ = iteration.next == iteration.total;
  in_uneven_tail_ = iteration.next > common_size();
}

// ------------------------------------------------------------------ Iterator

void DataLoader::Iterator::throw_invalidated() {
  throw Error(
      "a DataLoader iterator was used after its loader started another pass, was repositioned "
      "(load_state, skip_first_batches, set_epoch), re-sharded or destroyed: call begin() again");
}

bool DataLoader::Iterator::at_end() const {
  return !iteration_ || (iteration_->done && !iteration_->stale);
}

bool DataLoader::Iterator::operator==(const Iterator& other) const {
  if (at_end() || other.at_end()) return at_end() == other.at_end();
  return iteration_ == other.iteration_ && iteration_->next == other.iteration_->next;
}

const Batch& DataLoader::Iterator::operator*() const {
  if (iteration_ && iteration_->stale) throw_invalidated();
  if (at_end()) throw Error("dereferenced a DataLoader iterator at its end");
  return iteration_->current;
}

DataLoader::Iterator& DataLoader::Iterator::operator++() {
  if (!iteration_) throw Error("incremented the DataLoader end iterator");
  if (!iteration_->loader) throw_invalidated();
  if (!iteration_->done) iteration_->loader->advance(*iteration_);
  return *this;
}

}  // namespace difftrain::data
