#pragma once
// 8-bit AdamW (bitsandbytes' `bnb.optim.AdamW8bit`, Diffusers' `--use_8bit_adam`).

#include "difftrain/optim/flat_optimizer.h"

#include <torch/optim/adamw.h>

namespace difftrain::optim {

/// AdamW whose two moments are stored as 8-bit codes with block-wise dynamic quantisation:
/// blocks of kQuantBlockSize (2048) elements of each parameter, one fp32 absmax per block, the
/// signed dynamic code map for the first moment and the unsigned one for the second. One pass
/// per block dequantises, updates (bitsandbytes' arithmetic: p ← p·(1 − lr·wd) +
/// (−lr·√(1−β2^t)/(1−β1^t)) · m / (√v + eps·√(1−β2^t))), and re-quantises with the new absmax.
/// Parameters with fewer than `min_8bit_size` (4096) elements keep fp32 moments and the fused
/// fp32 AdamW update, as bitsandbytes does. State ≈ 2 bytes + 8/2048 per element instead of 8.
/// amsgrad is not supported (as bitsandbytes). Parameters: float32, bfloat16 or float16 on CPU.
class AdamW8bit : public FlatOptimizer {
 public:
  explicit AdamW8bit(std::vector<torch::optim::OptimizerParamGroup> groups,
                     torch::optim::AdamWOptions defaults = {}, int64_t min_8bit_size = 4096);
  explicit AdamW8bit(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {},
                     int64_t min_8bit_size = 4096);

  using torch::optim::Optimizer::step;
  torch::Tensor step(LossClosure closure = nullptr) override;

  int64_t state_bytes() const override;
  std::shared_ptr<FlatOptimizer> make_like(
      std::vector<torch::optim::OptimizerParamGroup> groups) const override;
  /// Tensors "<name>.state1" / ".state2" (uint8 codes shaped like the parameter) and
  /// ".absmax1" / ".absmax2" (fp32 per block) for 8-bit parameters — bitsandbytes' state keys —
  /// and ".exp_avg" / ".exp_avg_sq" for the small fp32 ones; JSON as AdamW.
  OptimizerState state_dict() const override;
  void load_state_dict(const OptimizerState& state) override;

  /// Whether parameter `index` of group `group` has 8-bit state.
  bool is_8bit(size_t group, size_t index) const;
  /// Its moments, dequantised to fp32 (undefined before its first update).
  torch::Tensor exp_avg(size_t group, size_t index) const;
  torch::Tensor exp_avg_sq(size_t group, size_t index) const;

 private:
  // Per bucket: where each member's state lives.
  struct BucketState {
    std::vector<bool> quantized;       // per member
    std::vector<int64_t> state_begin;  // per member: offset in codes (8-bit) or exp_avg (fp32)
    std::vector<int64_t> block_begin;  // per member: first absmax block (8-bit)
    int64_t codes_numel = 0, blocks = 0, small_numel = 0;
    torch::Tensor state1, state2, absmax1, absmax2;  // 8-bit part, lazily allocated
    torch::Tensor exp_avg, exp_avg_sq;               // fp32 part, lazily allocated
  };
  void allocate_state(size_t b);
  std::pair<size_t, size_t> locate(size_t group, size_t index) const;  // (bucket, member)
  torch::Tensor moment(size_t group, size_t index, int which) const;

  int64_t min_8bit_size_;
  std::vector<BucketState> state_;
  void release_state() override { state_.assign(state_.size(), BucketState{}); }
};

}  // namespace difftrain::optim
