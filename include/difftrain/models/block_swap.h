#pragma once
// Block swap (kohya sd-scripts' / musubi-tuner's `--blocks_to_swap`): the frozen weights of some
// transformer blocks live in host memory (pinned on CUDA) and are copied onto the device just
// before the block runs, forward and again for its backward, then released. A transformer's
// block loop calls enter(i) before block i and leave(i) after it; in grad mode both put an
// identity autograd node on the block's stream tensors whose backward brings the weights back
// before the block's backward (and its gradient-checkpointing recomputation) runs, and releases
// them after.
//
// The weights are swapped under the tensors, at the storage: a released weight keeps its
// shape, dtype and device, and its storage holds no memory; staging allocates the storage again
// and copies the host bytes in, so every view of it (what autograd saved for backward, the
// 8-bit weights' values and scales of models/kernels/quantized_weight.h) sees the weights again.
// Only what does not train is swapped: parameters that do not require grad, buffers and 8-bit
// weights. LoRA adapters are not children of the layers they adapt (models/linear.h), so they
// and their optimizer state stay where they are.
//
// On CUDA a copy runs on a side stream and the next block to run is prefetched while the
// current one computes; at most two swapped blocks are staged at once. On the CPU the same
// steps run synchronously (host copy, staging, release), which gives the same numbers as a run
// without swap, bit for bit.

#include <torch/nn/module.h>
#include <torch/types.h>

#include <c10/util/intrusive_ptr.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace difftrain::models {

/// What a block swap holds and saves, in bytes (run_info.json's `block_swap`).
struct BlockSwapBytes {
  int64_t blocks = 0;         ///< swapped blocks
  int64_t host_bytes = 0;     ///< their frozen weights, held in host memory
  int64_t staging_bytes = 0;  ///< the most staged on the device at once (two blocks)
  /// Device bytes the swap saves: host_bytes - staging_bytes.
  int64_t saved_bytes() const { return host_bytes - staging_bytes; }
};

/// The staging bytes of swapped blocks of `block_bytes` each, in the order they run: the
/// largest sum of two consecutive ones (one block alone when there is one), what BlockSwap
/// stages at most. estimate-memory's count.
int64_t block_swap_staging_bytes(const std::vector<int64_t>& block_bytes);

/// musubi-tuner's choice for a transformer of `count` blocks in one stack (Wan, Qwen-Image,
/// Z-Image's main layers): the last n swapped. Throws difftrain::Error naming n, the count and the
/// largest n that fits (count - 1: one block stays on the device) when n does not fit.
std::vector<bool> last_blocks_swapped(int64_t n, int64_t count);

class BlockSwap;

/// The swap of the last n of `blocks` (a transformer's std::vector of module holders, in forward
/// order; last_blocks_swapped()), or nullptr for n = 0: what a one-stack transformer's
/// enable_block_swap() holds.
template <typename Blocks>
std::shared_ptr<BlockSwap> swap_last_blocks(Blocks& blocks, int64_t n);

namespace detail {
struct BlockSwapState;
}

/// The swap of a transformer's blocks. Made from the blocks in the order forward runs them and
/// which of them are swapped; from then on the swapped blocks' frozen weights are in host
/// memory and their device storage is empty between uses. Destroying it (or restore()) puts
/// every weight back on the device.
class BlockSwap {
 public:
  /// `blocks`: every block, in forward order (they must outlive the swap); `swapped[i]`: block
  /// i is swapped. Throws difftrain::Error when a swapped block has a parameter that trains
  /// (its gradient and optimizer update would need the weight on the device).
  BlockSwap(std::vector<torch::nn::Module*> blocks, const std::vector<bool>& swapped);
  ~BlockSwap();
  BlockSwap(const BlockSwap&) = delete;
  BlockSwap& operator=(const BlockSwap&) = delete;

  /// Before block i: its weights staged (waited for on CUDA), the next swapped block's
  /// prefetched. xs: the tensors that enter the block and carry its gradient (undefined ones
  /// pass through); returned unchanged, or in grad mode through a node whose backward releases
  /// the block's weights once the block's backward is done.
  std::vector<torch::Tensor> enter(size_t i, std::vector<torch::Tensor> xs);
  /// After block i: its weights released. ys: the block's outputs; in grad mode returned
  /// through a node whose backward stages the block again (and prefetches the previous swapped
  /// one) before the block's backward runs.
  std::vector<torch::Tensor> leave(size_t i, std::vector<torch::Tensor> ys);

  /// Whether block i is swapped.
  bool swapped(size_t i) const;
  /// The bytes held on the host and the staging the blocks need (block_swap_staging_bytes).
  BlockSwapBytes bytes() const;
  /// The most swapped-block bytes ever staged on the device at once (measured).
  int64_t peak_staged_bytes() const;
  /// Swapped-block bytes staged now (0 between steps).
  int64_t staged_bytes() const;
  /// Puts every swapped weight back on the device for good and drops the host copies.
  void restore();

 private:
  c10::intrusive_ptr<detail::BlockSwapState> state_;
};

template <typename Blocks>
std::shared_ptr<BlockSwap> swap_last_blocks(Blocks& blocks, int64_t n) {
  if (n == 0) return nullptr;
  std::vector<torch::nn::Module*> modules;
  for (auto& b : blocks) modules.push_back(b.ptr().get());
  return std::make_shared<BlockSwap>(modules,
                                     last_blocks_swapped(n, static_cast<int64_t>(modules.size())));
}

}  // namespace difftrain::models
