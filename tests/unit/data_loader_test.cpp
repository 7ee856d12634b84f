// The DataLoader: batches, epochs, sharding across ranks, worker threads, resume. Datasets hold
// each example's index, so batches are compared exactly (tolerance 0) as index lists.

#include "difftrain/data/data_loader.h"
#include "difftrain/core/error.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <future>
#include <set>
#include <thread>

namespace difftrain::data {
namespace {

using Indices = std::vector<std::vector<int64_t>>;

// Example i = {"index": i (int64 scalar), "value": [2] float}; counts get() calls, can throw at
// one index and can sleep to scramble the order in which workers finish.
class IndexDataset : public Dataset {
 public:
  explicit IndexDataset(int64_t n, int64_t throw_at = -1, bool slow = false)
      : n_(n), throw_at_(throw_at), slow_(slow) {}
  int64_t size() const override { return n_; }
  Example get(int64_t index) const override {
    ++gets_;
    if (index == throw_at_)
      throw std::runtime_error("cannot decode image " + std::to_string(index));
    if (slow_) std::this_thread::sleep_for(std::chrono::microseconds((index * 7919) % 3000));
    return {{"index", torch::tensor(index, torch::kLong)},
            {"value", torch::full({2}, static_cast<float>(index))}};
  }
  int64_t gets() const { return gets_; }

 private:
  int64_t n_;
  int64_t throw_at_;
  bool slow_;
  mutable std::atomic<int64_t> gets_{0};
};

std::vector<int64_t> to_vector(const torch::Tensor& t) {
  const auto c = t.contiguous();
  return std::vector<int64_t>(c.data_ptr<int64_t>(), c.data_ptr<int64_t>() + c.numel());
}

// One pass, as index lists; checks every batch's "value" column agrees with its indices.
Indices run_pass(DataLoader& loader) {
  Indices out;
  for (const Batch& batch : loader) {
    const auto indices = batch.at("index");
    EXPECT_TRUE(torch::equal(batch.at("value").select(1, 0), indices.to(torch::kFloat)));
    out.push_back(to_vector(indices));
  }
  return out;
}

DataLoaderOptions options(int64_t batch_size, bool shuffle = false, int num_workers = 0) {
  DataLoaderOptions o;
  o.batch_size = batch_size;
  o.shuffle = shuffle;
  o.num_workers = num_workers;
  o.seed = 1234;
  return o;
}

// Runs fn in its own thread and aborts the test binary if it takes longer than `limit`, so a
// hang is a failure with a message rather than a stuck ctest.
void within(std::chrono::seconds limit, const std::function<void()>& fn) {
  auto task = std::make_shared<std::packaged_task<void()>>(fn);
  auto done = task->get_future();
  std::thread([task] { (*task)(); }).detach();
  if (done.wait_for(limit) != std::future_status::ready) {
    std::fprintf(stderr, "timed out after %lld s (hang)\n", static_cast<long long>(limit.count()));
    std::abort();
  }
  done.get();
}

TEST(DataTensorDataset, RowsAndMismatchedColumnsNameTheKey) {
  TensorDataset ds({{"x", torch::arange(6).view({3, 2})}, {"y", torch::arange(3)}});
  EXPECT_EQ(ds.size(), 3);
  EXPECT_TRUE(torch::equal(ds.get(1).at("x"), torch::tensor({2, 3})));
  EXPECT_THROW(ds.get(3), Error);
  try {
    TensorDataset bad({{"a", torch::zeros({4})}, {"labels", torch::zeros({5})}});
    FAIL() << "expected difftrain::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("'labels' has 5 rows"), std::string::npos) << e.what();
  }
}

TEST(DataCollate, StacksAlongANewDimZero) {
  const Batch b = default_collate({{{"x", torch::ones({2, 3})}}, {{"x", torch::zeros({2, 3})}}});
  ASSERT_EQ(b.at("x").sizes(), (std::vector<int64_t>{2, 2, 3}));
  EXPECT_EQ(b.at("x").sum().item<float>(), 6.0f);
}

TEST(DataCollate, ShapeMismatchAndMissingKeyNameTheKey) {
  try {
    default_collate({{{"pixels", torch::ones({2, 3})}}, {{"pixels", torch::ones({2, 4})}}});
    FAIL() << "expected difftrain::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("'pixels'"), std::string::npos) << message;
    EXPECT_NE(message.find("[2, 4]"), std::string::npos) << message;
  }
  try {
    default_collate({{{"x", torch::ones(1)}, {"y", torch::ones(1)}}, {{"x", torch::ones(1)}}});
    FAIL() << "expected difftrain::Error";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("no key 'y'"), std::string::npos) << e.what();
  }
  EXPECT_THROW(default_collate({{{"x", torch::ones(1)}}, {{"z", torch::ones(1)}}}), Error);
}

TEST(DataLoaderIteration, PlainBatchesKeepOrDropTheLastPartialBatch) {
  auto ds = std::make_shared<IndexDataset>(7);
  DataLoader keep(ds, options(3));
  EXPECT_EQ(keep.size(), 3);
  EXPECT_EQ(run_pass(keep), (Indices{{0, 1, 2}, {3, 4, 5}, {6}}));
  auto o = options(3);
  o.drop_last = true;
  DataLoader drop(ds, o);
  EXPECT_EQ(drop.size(), 2);
  EXPECT_EQ(run_pass(drop), (Indices{{0, 1, 2}, {3, 4, 5}}));
}

TEST(DataLoaderIteration, CustomCollateIsUsed) {
  auto o = options(4);
  o.collate = [](const std::vector<Example>& examples) {
    return Batch{{"count", torch::tensor(static_cast<int64_t>(examples.size()))}};
  };
  DataLoader loader(std::make_shared<IndexDataset>(6), o);
  std::vector<int64_t> counts;
  for (const Batch& b : loader) counts.push_back(b.at("count").item<int64_t>());
  EXPECT_EQ(counts, (std::vector<int64_t>{4, 2}));
}

TEST(DataLoaderIteration, SameOrderOnEveryRankAndNewOrderNextEpoch) {
  const int world = 3;
  auto ds = std::make_shared<IndexDataset>(30);
  std::vector<std::unique_ptr<DataLoader>> ranks;
  for (int r = 0; r < world; ++r) {
    ranks.push_back(std::make_unique<DataLoader>(ds, options(2, /*shuffle=*/true)));
    ShardOptions s;
    s.rank = r;
    s.world_size = world;
    ranks.back()->shard(s);
  }
  const auto order0 = ranks[0]->epoch_order(0);
  for (int r = 1; r < world; ++r) EXPECT_EQ(ranks[static_cast<size_t>(r)]->epoch_order(0), order0);
  EXPECT_NE(ranks[0]->epoch_order(1), order0);
  std::vector<int64_t> sorted = order0;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < 30; ++i) ASSERT_EQ(sorted[static_cast<size_t>(i)], i);

  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    std::multiset<int64_t> seen;
    for (auto& loader : ranks) {
      EXPECT_EQ(loader->state().epoch, epoch);
      const Indices pass = run_pass(*loader);
      EXPECT_EQ(pass, loader->epoch_batches(epoch));
      EXPECT_EQ(static_cast<int64_t>(pass.size()), 5);
      for (const auto& b : pass) seen.insert(b.begin(), b.end());
    }
    // 30 examples = 5 global steps of 6: disjoint shards covering the epoch.
    std::multiset<int64_t> all;
    for (int64_t i = 0; i < 30; ++i) all.insert(i);
    EXPECT_EQ(seen, all) << "epoch " << epoch;
  }
}

TEST(DataLoaderWorkers, YieldTheSameBatchesInOrderAsTheCallingThread) {
  auto ds = std::make_shared<IndexDataset>(53, -1, /*slow=*/true);
  DataLoader reference(ds, options(4, /*shuffle=*/true));
  const Indices want0 = run_pass(reference);
  const Indices want1 = run_pass(reference);
  ASSERT_EQ(want0.size(), 14u);
  for (int workers : {1, 2, 3}) {
    for (int prefetch : {1, 2, 4}) {
      auto o = options(4, /*shuffle=*/true, workers);
      o.prefetch_factor = prefetch;
      DataLoader loader(ds, o);
      EXPECT_EQ(run_pass(loader), want0) << workers << " workers, prefetch " << prefetch;
      EXPECT_EQ(run_pass(loader), want1) << workers << " workers, prefetch " << prefetch;
    }
  }
}

TEST(DataLoaderWorkers, ExceptionSurfacesAtItsBatchWithItsMessage) {
  for (int workers : {0, 2}) {
    // Example 9 is in batch 4 (batches of 2, no shuffle).
    DataLoader loader(std::make_shared<IndexDataset>(20, /*throw_at=*/9),
                      options(2, false, workers));
    int64_t yielded = 0;
    try {
      within(std::chrono::seconds(30), [&] {
        for (const Batch& b : loader) {
          (void)b;
          ++yielded;
        }
      });
      FAIL() << "expected difftrain::Error";
    } catch (const Error& e) {
      const std::string message = e.what();
      EXPECT_NE(message.find("batch 4 of epoch 0"), std::string::npos) << message;
      EXPECT_NE(message.find("cannot decode image 9"), std::string::npos) << message;
    }
    EXPECT_EQ(yielded, 4) << workers << " workers";
    EXPECT_EQ(loader.position(), 4);
  }
}

TEST(DataLoaderWorkers, BreakingOutAndDestroyingDoNotHang) {
  within(std::chrono::seconds(30), [] {
    auto ds = std::make_shared<IndexDataset>(400, -1, /*slow=*/true);
    auto o = options(2, /*shuffle=*/true, /*num_workers=*/3);
    {
      DataLoader loader(ds, o);
      for (const Batch& b : loader) {  // break at once: workers are mid-load and window-full
        (void)b;
        break;
      }
      int64_t n = 0;
      for (const Batch& b : loader) {  // a second pass while nothing holds the first
        (void)b;
        if (++n == 3) break;
      }
      EXPECT_EQ(loader.state().epoch, 1);
    }
    // The loader dies while an iterator of a live pass still exists.
    DataLoader::Iterator survivor;
    {
      DataLoader loader(ds, o);
      survivor = loader.begin();
    }
    EXPECT_THROW(++survivor, Error);
  });
}

// An iterator whose loader was repositioned says so when used, for every way of repositioning;
// before, dereferencing it said "at its end" and a loop comparing it with end() stopped silently.
TEST(DataLoaderIteration, InvalidatedIteratorSaysSoInsteadOfAtItsEnd) {
  auto ds = std::make_shared<IndexDataset>(12);
  const std::vector<std::function<void(DataLoader&)>> repositions = {
      [](DataLoader& l) {
        l.load_state({0, 1});
      },
      [](DataLoader& l) { l.skip_first_batches(2); },
      [](DataLoader& l) { l.set_epoch(3); },
      [](DataLoader& l) { (void)l.begin(); },
  };
  for (int workers : {0, 2}) {
    for (size_t i = 0; i < repositions.size(); ++i) {
      DataLoader loader(ds, options(3, /*shuffle=*/false, workers));
      auto it = loader.begin();
      repositions[i](loader);
      EXPECT_TRUE(it != loader.end()) << "reposition " << i;
      for (const bool deref : {true, false}) {
        std::string message;
        try {
          if (deref) {
            (void)*it;
          } else {
            ++it;
          }
        } catch (const Error& e) {
          message = e.what();
        }
        EXPECT_NE(message.find("was repositioned"), std::string::npos)
            << "reposition " << i << (deref ? " deref: " : " increment: ") << message;
      }
    }
  }
  // A pass that really ended still says so.
  DataLoader loader(ds, options(3, /*shuffle=*/false, 0));
  auto it = loader.begin();
  for (int k = 0; k < 4; ++k) ++it;
  EXPECT_TRUE(it == loader.end());
  try {
    (void)*it;
    ADD_FAILURE() << "dereferencing the end did not throw";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("at its end"), std::string::npos) << e.what();
  }
}

TEST(DataLoaderResume, SkipFirstBatchesYieldsTheTailWithoutLoadingTheSkipped) {
  auto ds = std::make_shared<IndexDataset>(23);
  for (int workers : {0, 2}) {
    DataLoader full(ds, options(3, /*shuffle=*/true, workers));
    const Indices pass = run_pass(full);
    ASSERT_EQ(pass.size(), 8u);
    DataLoader loader(ds, options(3, /*shuffle=*/true, workers));
    loader.skip_first_batches(5);
    const int64_t before = ds->gets();
    const Indices tail = run_pass(loader);
    EXPECT_EQ(tail, Indices(pass.begin() + 5, pass.end()));
    EXPECT_EQ(ds->gets() - before, 23 - 15) << "the skipped examples were loaded";
    EXPECT_EQ(loader.state().epoch, 1);
    EXPECT_EQ(loader.state().batches_consumed, 0);
  }
}

TEST(DataLoaderResume, StateRoundTripResumesExactlyMidEpoch) {
  auto ds = std::make_shared<IndexDataset>(40);
  auto o = options(4, /*shuffle=*/true, /*num_workers=*/2);
  DataLoader reference(ds, o);
  const Indices epoch0 = run_pass(reference);
  const Indices epoch1 = run_pass(reference);

  DataLoader first(ds, o);
  nlohmann::json saved;
  Indices got;
  for (const Batch& b : first) {
    got.push_back(to_vector(b.at("index")));
    if (got.size() == 3) {
      saved = first.state();  // checkpoint inside the loop, after the third batch
      break;
    }
  }
  EXPECT_EQ(saved, (nlohmann::json{{"epoch", 0}, {"batches_consumed", 3}}));

  DataLoader resumed(ds, o);
  resumed.load_state(saved.get<LoaderState>());
  EXPECT_EQ(resumed.state().batches_consumed, 3);
  const Indices rest = run_pass(resumed);
  EXPECT_EQ(rest, Indices(epoch0.begin() + 3, epoch0.end()));
  EXPECT_EQ(resumed.state().epoch, 1);
  EXPECT_EQ(run_pass(resumed), epoch1);
}

TEST(DataLoaderResume, StateRoundTripAcrossTheEpochBoundary) {
  auto ds = std::make_shared<IndexDataset>(10);
  auto o = options(4, /*shuffle=*/true);
  DataLoader reference(ds, o);
  run_pass(reference);
  const Indices epoch1 = run_pass(reference);
  const Indices epoch2 = run_pass(reference);

  // Saved inside the loop at the epoch's last batch: {0, 3}. Resuming finishes epoch 0 at once.
  DataLoader a(ds, o);
  LoaderState at_last;
  for (const Batch& b : a) {
    (void)b;
    if (a.end_of_epoch()) at_last = a.state();
  }
  EXPECT_EQ(at_last.epoch, 0);
  EXPECT_EQ(at_last.batches_consumed, 3);
  EXPECT_EQ(a.state().epoch, 1);  // after the pass ran to its end
  EXPECT_EQ(a.state().batches_consumed, 0);

  DataLoader b(ds, o);
  b.load_state(at_last);
  EXPECT_TRUE(run_pass(b).empty());
  EXPECT_EQ(run_pass(b), epoch1);

  // Saved after a complete pass: {1, 0}.
  DataLoader c(ds, o);
  c.load_state(LoaderState{1, 0});
  EXPECT_EQ(run_pass(c), epoch1);
  EXPECT_EQ(run_pass(c), epoch2);
}

TEST(DataLoaderResume, AbandonedPassCountsAsFinishedAndSetEpochPositions) {
  auto ds = std::make_shared<IndexDataset>(12);
  auto o = options(2, /*shuffle=*/true);
  DataLoader reference(ds, o);
  run_pass(reference);
  const Indices epoch1 = run_pass(reference);
  const Indices epoch2 = run_pass(reference);

  DataLoader loader(ds, o);
  for (const Batch& b : loader) {
    (void)b;
    break;
  }
  EXPECT_EQ(loader.state().epoch, 0);
  EXPECT_EQ(loader.state().batches_consumed, 1);
  EXPECT_EQ(run_pass(loader), epoch1);  // the break ended epoch 0
  loader.set_epoch(1);
  EXPECT_EQ(run_pass(loader), epoch1);
  EXPECT_EQ(run_pass(loader), epoch2);
}

TEST(DataLoaderResume, LoaderStateJsonRejectsMissingFields) {
  const LoaderState s = nlohmann::json{{"epoch", 4}, {"batches_consumed", 7}}.get<LoaderState>();
  EXPECT_EQ(s.epoch, 4);
  EXPECT_EQ(s.batches_consumed, 7);
  EXPECT_THROW((nlohmann::json{{"epoch", 4}}.get<LoaderState>()), Error);
  EXPECT_THROW((nlohmann::json{{"epoch", -1}, {"batches_consumed", 0}}.get<LoaderState>()), Error);
}

TEST(DataLoaderSharding, ProgressFlagsWithUnevenBatches) {
  // N=10, B=2, W=3, even_batches=false: 5 chunks -> ranks yield 2, 2, 1 batches.
  auto ds = std::make_shared<IndexDataset>(10);
  const std::vector<int64_t> sizes = {2, 2, 1};
  for (int r = 0; r < 3; ++r) {
    DataLoader loader(ds, options(2));
    ShardOptions s;
    s.rank = r;
    s.world_size = 3;
    s.even_batches = false;
    loader.shard(s);
    EXPECT_EQ(loader.size(), sizes[static_cast<size_t>(r)]);
    EXPECT_EQ(loader.common_size(), 1);
    EXPECT_EQ(loader.total_batch_size(), 6);
    std::vector<std::tuple<int64_t, bool, bool>> seen;
    for (const Batch& b : loader) {
      (void)b;
      seen.emplace_back(loader.position(), loader.end_of_epoch(), loader.in_uneven_tail());
    }
    if (r < 2) {
      EXPECT_EQ(seen,
                (std::vector<std::tuple<int64_t, bool, bool>>{{1, false, false}, {2, true, true}}))
          << "rank " << r;
    } else {
      EXPECT_EQ(seen, (std::vector<std::tuple<int64_t, bool, bool>>{{1, true, false}}));
    }
  }
}

TEST(DataLoaderSharding, EvenBatchesPadAndSplitBatchesCut) {
  auto ds = std::make_shared<IndexDataset>(10);
  // Even batches: ceil(10 / 6) = 2 full batches on every rank, padded from the start.
  DataLoader even(ds, options(2));
  ShardOptions s;
  s.rank = 2;
  s.world_size = 3;
  even.shard(s);
  EXPECT_EQ(even.size(), 2);
  EXPECT_EQ(even.common_size(), 2);
  EXPECT_EQ(run_pass(even), (Indices{{4, 5}, {0, 1}}));
  // Split batches: global batch 4 cut into 2 parts of 2; the short last global batch {8, 9}
  // gives rank 1 nothing without even_batches.
  DataLoader split(ds, options(4));
  s = ShardOptions{};
  s.rank = 1;
  s.world_size = 2;
  s.split_batches = true;
  s.even_batches = false;
  split.shard(s);
  EXPECT_EQ(split.total_batch_size(), 4);
  EXPECT_EQ(run_pass(split), (Indices{{2, 3}, {6, 7}}));
}

TEST(DataLoaderSharding, SplitBatchesWithIndivisibleBatchSizeThrowsAtShard) {
  DataLoader loader(std::make_shared<IndexDataset>(10), options(3));
  ShardOptions s;
  s.world_size = 2;
  s.split_batches = true;
  try {
    loader.shard(s);
    FAIL() << "expected difftrain::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("batch_size 3"), std::string::npos) << message;
    EXPECT_NE(message.find("world size 2"), std::string::npos) << message;
  }
}

TEST(DataLoaderIteration, InvalidOptionsThrow) {
  auto ds = std::make_shared<IndexDataset>(4);
  EXPECT_THROW(DataLoader(nullptr, options(1)), Error);
  EXPECT_THROW(DataLoader(ds, options(0)), Error);
  auto o = options(1);
  o.num_workers = -1;
  EXPECT_THROW(DataLoader(ds, o), Error);
  o.num_workers = 1;
  o.prefetch_factor = 0;
  EXPECT_THROW(DataLoader(ds, o), Error);
}

}  // namespace
}  // namespace difftrain::data
