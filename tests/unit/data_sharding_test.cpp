// shard_batches against a line-by-line re-implementation of Accelerate's BatchSamplerShard
// generator (_iter_with_no_split / _iter_with_split over a torch BatchSampler), plus the
// properties the Accelerator relies on. Index lists are compared exactly.

#include "difftrain/core/error.h"
#include "difftrain/data/sharding.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <numeric>
#include <random>
#include <set>

namespace difftrain::data {
namespace {

using Batches = std::vector<std::vector<int64_t>>;

// torch.utils.data.BatchSampler over `order`.
Batches torch_batch_sampler(const std::vector<int64_t>& order, int64_t b, bool drop_last) {
  Batches out;
  std::vector<int64_t> batch;
  for (const int64_t i : order) {
    batch.push_back(i);
    if (static_cast<int64_t>(batch.size()) == b) {
      out.push_back(batch);
      batch.clear();
    }
  }
  if (!batch.empty() && !drop_last) out.push_back(batch);
  return out;
}

std::vector<int64_t> py_slice(const std::vector<int64_t>& v, int64_t begin, int64_t end) {
  const auto n = static_cast<int64_t>(v.size());
  begin = std::min(begin, n);
  end = std::min(end, n);
  if (begin >= end) return {};
  return std::vector<int64_t>(v.begin() + begin, v.begin() + end);
}

void append(std::vector<int64_t>& to, const std::vector<int64_t>& from) {
  to.insert(to.end(), from.begin(), from.end());
}

// Accelerate's BatchSamplerShard._iter_with_no_split, statement by statement.
Batches accelerate_no_split(const std::vector<int64_t>& order, int64_t b, bool drop_last, int64_t w,
                            int64_t r, bool even) {
  const Batches inner = torch_batch_sampler(order, b, drop_last);
  Batches out;
  std::vector<int64_t> initial_data, batch_to_yield, batch;
  int64_t idx = 0;
  for (idx = 0; idx < static_cast<int64_t>(inner.size()); ++idx) {
    batch = inner[static_cast<size_t>(idx)];
    if (!drop_last && idx < w) append(initial_data, batch);
    if (idx % w == r) batch_to_yield = batch;
    if (idx % w == w - 1 && static_cast<int64_t>(batch.size()) == b) {
      out.push_back(batch_to_yield);
      batch_to_yield.clear();
    }
  }
  --idx;  // Python's loop variable keeps the last index
  if (!drop_last && !initial_data.empty()) {
    if (!even) {
      if (!batch_to_yield.empty()) out.push_back(batch_to_yield);
    } else {
      if (static_cast<int64_t>(batch_to_yield.size()) == b) out.push_back(batch_to_yield);
      while (static_cast<int64_t>(initial_data.size()) < w * b) {
        const auto copy = initial_data;
        append(initial_data, copy);
      }
      if (static_cast<int64_t>(batch.size()) == b) {
        batch.clear();
        idx += 1;
      }
      int64_t cycle_index = 0;
      while (idx % w != 0 || !batch.empty()) {
        const int64_t end_index = cycle_index + b - static_cast<int64_t>(batch.size());
        append(batch, py_slice(initial_data, cycle_index, end_index));
        if (idx % w == r) out.push_back(batch);
        cycle_index = end_index;
        batch.clear();
        idx += 1;
      }
    }
  }
  return out;
}

// Accelerate's BatchSamplerShard._iter_with_split, statement by statement.
Batches accelerate_split(const std::vector<int64_t>& order, int64_t b, bool drop_last, int64_t w,
                         int64_t r, bool even) {
  const Batches inner = torch_batch_sampler(order, b, drop_last);
  Batches out;
  std::vector<int64_t> initial_data, batch;
  const int64_t batch_length = b / w;
  for (size_t idx = 0; idx < inner.size(); ++idx) {
    batch = inner[idx];
    if (idx == 0) initial_data = batch;
    if (static_cast<int64_t>(batch.size()) == b) {
      out.push_back(py_slice(batch, batch_length * r, batch_length * (r + 1)));
    }
  }
  if (!drop_last && !initial_data.empty() && static_cast<int64_t>(batch.size()) < b) {
    if (!even) {
      if (static_cast<int64_t>(batch.size()) > batch_length * r) {
        out.push_back(py_slice(batch, batch_length * r, batch_length * (r + 1)));
      }
    } else {
      while (static_cast<int64_t>(initial_data.size()) < b) {
        const auto copy = initial_data;
        append(initial_data, copy);
      }
      append(batch, initial_data);
      out.push_back(py_slice(batch, batch_length * r, batch_length * (r + 1)));
    }
  }
  return out;
}

// What a prepared Accelerate loader yields on rank r: no BatchSamplerShard in a world of one.
Batches accelerate_reference(const std::vector<int64_t>& order, int64_t b, bool drop_last,
                             const ShardOptions& s) {
  if (s.world_size == 1) return torch_batch_sampler(order, b, drop_last);
  return s.split_batches
             ? accelerate_split(order, b, drop_last, s.world_size, s.rank, s.even_batches)
             : accelerate_no_split(order, b, drop_last, s.world_size, s.rank, s.even_batches);
}

std::vector<int64_t> shuffled(int64_t n, uint32_t seed) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::shuffle(order.begin(), order.end(), std::mt19937(seed));
  return order;
}

std::string describe(int64_t n, int64_t b, bool drop_last, const ShardOptions& s) {
  return "N=" + std::to_string(n) + " B=" + std::to_string(b) +
         " W=" + std::to_string(s.world_size) + " r=" + std::to_string(s.rank) +
         " drop_last=" + std::to_string(drop_last) + " even=" + std::to_string(s.even_batches) +
         " split=" + std::to_string(s.split_batches);
}

// Calls fn(n, b, drop_last, shard) for every valid combination, N < B*W included.
template <typename Fn>
void for_each_combo(Fn fn, bool every_rank = true) {
  for (int64_t n = 0; n <= 37; ++n) {
    for (int64_t b = 1; b <= 6; ++b) {
      for (int w = 1; w <= 4; ++w) {
        for (int flags = 0; flags < 8; ++flags) {
          ShardOptions s;
          s.world_size = w;
          const bool drop_last = flags & 1;
          s.even_batches = flags & 2;
          s.split_batches = flags & 4;
          if (s.split_batches && b % w != 0) continue;
          for (int r = 0; r < (every_rank ? w : 1); ++r) {
            s.rank = r;
            fn(n, b, drop_last, s);
          }
        }
      }
    }
  }
}

TEST(DataSharding, MatchesAccelerateBatchSamplerShard) {
  int64_t compared = 0;
  for_each_combo([&](int64_t n, int64_t b, bool drop_last, const ShardOptions& s) {
    const auto order = shuffled(n, static_cast<uint32_t>(n * 7 + b));
    const Batches want = accelerate_reference(order, b, drop_last, s);
    const Batches got = shard_batches(order, b, drop_last, s);
    ASSERT_EQ(got, want) << describe(n, b, drop_last, s);
    ++compared;
  });
  EXPECT_GT(compared, 10000);
}

TEST(DataSharding, SizesMatchBatchListsAndCommonIsTheMinimum) {
  for_each_combo(
      [&](int64_t n, int64_t b, bool drop_last, ShardOptions s) {
        const auto order = shuffled(n, 1);
        int64_t minimum = std::numeric_limits<int64_t>::max();
        for (s.rank = 0; s.rank < s.world_size; ++s.rank) {
          const auto count = static_cast<int64_t>(shard_batches(order, b, drop_last, s).size());
          ASSERT_EQ(num_shard_batches(n, b, drop_last, s), count) << describe(n, b, drop_last, s);
          minimum = std::min(minimum, count);
        }
        for (s.rank = 0; s.rank < s.world_size; ++s.rank) {
          ASSERT_EQ(common_shard_batches(n, b, drop_last, s), minimum)
              << describe(n, b, drop_last, s);
        }
      },
      /*every_rank=*/false);
}

TEST(DataSharding, ShardsAreDisjointAndCoverWhenNotPadded) {
  for_each_combo(
      [&](int64_t n, int64_t b, bool drop_last, ShardOptions s) {
        if (s.even_batches && !drop_last && s.world_size > 1) return;  // padded: see below
        const auto order = shuffled(n, 2);
        std::multiset<int64_t> seen;
        for (s.rank = 0; s.rank < s.world_size; ++s.rank) {
          for (const auto& batch : shard_batches(order, b, drop_last, s)) {
            ASSERT_FALSE(batch.empty()) << describe(n, b, drop_last, s);
            seen.insert(batch.begin(), batch.end());
          }
        }
        // Without drop_last every example appears exactly once; with it, exactly the examples
        // of the complete (global) batches, each once.
        const int64_t global = s.world_size == 1 ? b : (s.split_batches ? b : b * s.world_size);
        const int64_t kept = drop_last ? n / global * global : n;
        const std::multiset<int64_t> want(order.begin(), order.begin() + kept);
        ASSERT_EQ(seen, want) << describe(n, b, drop_last, s);
      },
      /*every_rank=*/false);
}

TEST(DataSharding, EvenBatchesGiveEveryRankTheSameFullBatches) {
  for_each_combo(
      [&](int64_t n, int64_t b, bool drop_last, ShardOptions s) {
        if (!s.even_batches || s.world_size == 1) return;
        const auto order = shuffled(n, 3);
        const int64_t part = s.split_batches ? b / s.world_size : b;
        std::set<int64_t> seen;
        std::vector<size_t> counts;
        for (s.rank = 0; s.rank < s.world_size; ++s.rank) {
          const auto batches = shard_batches(order, b, drop_last, s);
          counts.push_back(batches.size());
          for (const auto& batch : batches) {
            ASSERT_EQ(static_cast<int64_t>(batch.size()), part) << describe(n, b, drop_last, s);
            seen.insert(batch.begin(), batch.end());
          }
        }
        ASSERT_TRUE(std::all_of(counts.begin(), counts.end(), [&](size_t c) {
          return c == counts.front();
        })) << describe(n, b, drop_last, s);
        // The wrap-around pads with examples of the epoch, so nothing is lost without drop_last.
        if (!drop_last) {
          ASSERT_EQ(static_cast<int64_t>(seen.size()), n) << describe(n, b, drop_last, s);
        }
      },
      /*every_rank=*/false);
}

TEST(DataSharding, PaddingWrapsAroundFromTheEpochStart) {
  // N=5, B=2, W=2: 2 global steps of 4; the 3 missing examples are order[0..2].
  const std::vector<int64_t> order = {4, 2, 0, 3, 1};
  ShardOptions s;
  s.world_size = 2;
  s.rank = 0;
  EXPECT_EQ(shard_batches(order, 2, false, s), (Batches{{4, 2}, {1, 4}}));
  s.rank = 1;
  EXPECT_EQ(shard_batches(order, 2, false, s), (Batches{{0, 3}, {2, 0}}));
  // N=1 < B*W: the single example is repeated.
  s.rank = 1;
  EXPECT_EQ(shard_batches({7}, 2, false, s), (Batches{{7, 7}}));
}

TEST(DataSharding, SplitBatchesWithIndivisibleBatchSizeThrows) {
  ShardOptions s;
  s.world_size = 2;
  s.split_batches = true;
  try {
    shard_batches({0, 1, 2, 3, 4}, 5, false, s);
    FAIL() << "expected difftrain::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("batch_size 5"), std::string::npos) << message;
    EXPECT_NE(message.find("world size 2"), std::string::npos) << message;
  }
  EXPECT_THROW(num_shard_batches(5, 3, false, s), Error);
}

TEST(DataSharding, InvalidRankOrWorldThrows) {
  ShardOptions s;
  s.world_size = 2;
  s.rank = 2;
  EXPECT_THROW(shard_batches({0, 1}, 1, false, s), Error);
  s.rank = 0;
  s.world_size = 0;
  EXPECT_THROW(shard_batches({0, 1}, 1, false, s), Error);
  s.world_size = 1;
  EXPECT_THROW(shard_batches({0, 1}, 0, false, s), Error);
}

}  // namespace
}  // namespace difftrain::data
