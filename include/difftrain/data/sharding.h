#pragma once

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace difftrain::data {

/// How a prepared loader is cut across ranks; set by Accelerator::prepare (Accelerate:
/// `BatchSamplerShard(num_processes, process_index, split_batches, even_batches)` plus the
/// `device` of `DataLoaderShard`).
struct ShardOptions {
  /// This process's rank, 0 <= rank < world_size (Accelerate `process_index`).
  int rank = 0;
  /// Number of ranks (Accelerate `num_processes`).
  int world_size = 1;
  /// Pad the epoch by wrapping around to its start so every rank yields the same number of full
  /// batches (Accelerate `even_batches`, default true). Ignored with drop_last.
  bool even_batches = true;
  /// batch_size is the global batch, cut into world_size equal parts, one per rank (Accelerate
  /// `split_batches`); otherwise every rank yields batches of batch_size.
  bool split_batches = false;
  /// Where yielded batches are moved after collate (Accelerate `DataLoaderShard.device`).
  torch::Device device = torch::kCPU;
};

/// Throws difftrain::Error unless 1 <= world_size, 0 <= rank < world_size, batch_size >= 1 and,
/// with split_batches, batch_size divisible by world_size.
void check_shard(const ShardOptions& shard, int64_t batch_size);

/// The dataset indices of every batch THIS rank yields in one epoch, given the epoch's `order`
/// (a permutation of 0..N-1 shared by all ranks). Accelerate's `BatchSamplerShard` iteration:
/// - world_size 1: torch's BatchSampler (last short batch kept unless drop_last);
/// - split_batches false: global step s is W consecutive batches of batch_size B; rank r takes
///   order[s*B*W + r*B, +B). drop_last keeps complete global steps only; even_batches pads order
///   cyclically from its start to ceil(N/(B*W))*B*W; otherwise ranks take their slices of the
///   last partial step (the last batch may be short, some ranks have one batch fewer);
/// - split_batches true: global batch g is order[g*B, +B); rank r takes its part
///   [r*B/W, (r+1)*B/W). A short final global batch is dropped (drop_last), padded cyclically
///   (even_batches), or cut into possibly short parts (empty parts are not yielded).
std::vector<std::vector<int64_t>> shard_batches(const std::vector<int64_t>& order,
                                                int64_t batch_size, bool drop_last,
                                                const ShardOptions& shard);

/// shard_batches(order, ...).size() for an order of `num_examples`, in O(1)
/// (Accelerate: `len(BatchSamplerShard)`).
int64_t num_shard_batches(int64_t num_examples, int64_t batch_size, bool drop_last,
                          const ShardOptions& shard);

/// The minimum of num_shard_batches over every rank of `shard`'s world: the number of batches all
/// ranks yield (equal to num_shard_batches when even_batches or drop_last).
int64_t common_shard_batches(int64_t num_examples, int64_t batch_size, bool drop_last,
                             const ShardOptions& shard);

}  // namespace difftrain::data
