#include "difftrain/data/sharding.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>

#include <algorithm>

namespace difftrain::data {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// `length` entries of the epoch order extended cyclically, from position `start` on. The
// wrap-around is Accelerate's: a short tail is completed from the start of the epoch, repeated
// when the epoch has fewer examples than one global step.
std::vector<int64_t> cyclic_slice(const std::vector<int64_t>& order, int64_t start,
                                  int64_t length) {
  const auto n = static_cast<int64_t>(order.size());
  std::vector<int64_t> slice(static_cast<size_t>(length));
  for (int64_t i = 0; i < length; ++i)
    slice[static_cast<size_t>(i)] = order[static_cast<size_t>((start + i) % n)];
  return slice;
}

}  // namespace

void check_shard(const ShardOptions& shard, int64_t batch_size) {
  if (batch_size < 1) {
    throw Error(fmt::format("batch_size is {}: it must be at least 1", batch_size));
  }
  if (shard.world_size < 1) {
    throw Error(fmt::format("world size is {}: it must be at least 1", shard.world_size));
  }
  if (shard.rank < 0 || shard.rank >= shard.world_size) {
    throw Error(fmt::format("rank {} is out of range for world size {}: expected 0 <= rank < {}",
                            shard.rank, shard.world_size, shard.world_size));
  }
  if (shard.split_batches && batch_size % shard.world_size != 0) {
    throw Error(fmt::format(
        "split_batches needs batch_size divisible by the world size, got batch_size {} and world "
        "size {}: use a multiple of {} or split_batches=false",
        batch_size, shard.world_size, shard.world_size));
  }
}

std::vector<std::vector<int64_t>> shard_batches(const std::vector<int64_t>& order,
                                                int64_t batch_size, bool drop_last,
                                                const ShardOptions& shard) {
  check_shard(shard, batch_size);
  const auto n = static_cast<int64_t>(order.size());
  const int64_t b = batch_size;
  const int64_t w = shard.world_size;
  const int64_t r = shard.rank;
  std::vector<std::vector<int64_t>> batches;
  if (n == 0) return batches;

  if (w == 1) {  // a plain torch BatchSampler
    for (int64_t start = 0; start < n; start += b) {
      const int64_t length = std::min(b, n - start);
      if (length < b && drop_last) break;
      batches.push_back(cyclic_slice(order, start, length));
    }
    return batches;
  }

  if (!shard.split_batches) {
    const int64_t step = b * w;  // examples per global step
    if (drop_last || shard.even_batches) {
      const int64_t steps = drop_last ? n / step : ceil_div(n, step);
      for (int64_t s = 0; s < steps; ++s)
        batches.push_back(cyclic_slice(order, s * step + r * b, b));
    } else {
      // Chunk c of the unpadded order belongs to rank c % w; the last chunk may be short.
      for (int64_t c = r; c * b < n; c += w) {
        batches.push_back(cyclic_slice(order, c * b, std::min(b, n - c * b)));
      }
    }
    return batches;
  }

  const int64_t part = b / w;  // examples per rank in each global batch
  const int64_t full = n / b;
  const int64_t remainder = n % b;
  for (int64_t g = 0; g < full; ++g) batches.push_back(cyclic_slice(order, g * b + r * part, part));
  if (remainder > 0 && !drop_last) {
    if (shard.even_batches) {
      batches.push_back(cyclic_slice(order, full * b + r * part, part));
    } else if (remainder > r * part) {
      batches.push_back(
          cyclic_slice(order, full * b + r * part, std::min(part, remainder - r * part)));
    }
  }
  return batches;
}

int64_t num_shard_batches(int64_t num_examples, int64_t batch_size, bool drop_last,
                          const ShardOptions& shard) {
  check_shard(shard, batch_size);
  const int64_t n = std::max<int64_t>(num_examples, 0);
  const int64_t b = batch_size;
  const int64_t w = shard.world_size;
  if (w == 1) return drop_last ? n / b : ceil_div(n, b);
  if (!shard.split_batches) {
    const int64_t step = b * w;
    if (drop_last) return n / step;
    if (shard.even_batches) return ceil_div(n, step);
    const int64_t chunks = ceil_div(n, b);
    return chunks / w + (shard.rank < chunks % w ? 1 : 0);
  }
  const int64_t part = b / w;
  const int64_t remainder = n % b;
  if (drop_last || remainder == 0) return n / b;
  if (shard.even_batches) return n / b + 1;
  return n / b + (remainder > shard.rank * part ? 1 : 0);
}

int64_t common_shard_batches(int64_t num_examples, int64_t batch_size, bool drop_last,
                             const ShardOptions& shard) {
  // The last rank has the fewest batches in every mode.
  ShardOptions last = shard;
  last.rank = shard.world_size - 1;
  check_shard(shard, batch_size);
  return num_shard_batches(num_examples, batch_size, drop_last, last);
}

}  // namespace difftrain::data
