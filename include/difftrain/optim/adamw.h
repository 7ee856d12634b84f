#pragma once
// Fused AdamW: torch.optim.AdamW's update in one vectorised, multi-threaded pass over flat
// buffers.

#include "difftrain/optim/flat_optimizer.h"

#include <torch/optim/adamw.h>

namespace difftrain::optim {

/// AdamW with decoupled weight decay, exactly torch.optim.AdamW's arithmetic (defaults lr 1e-3,
/// betas (0.9, 0.999), eps 1e-8, weight_decay 1e-2, amsgrad off; per-group options via
/// torch::optim::AdamWOptions, e.g. a group with weight_decay 0 for norms and biases):
///   p ← p·(1 − lr·wd);  m ← m + (1−β1)(g − m);  v ← β2·v + (1−β2)·g²
///   p ← p − lr/(1−β1^t) · m / (√v̂ / √(1−β2^t) + eps),  v̂ = v or max(v̂, v) with amsgrad.
/// Fused: each group's parameters of one dtype/device live in one flat buffer (the module's
/// parameters become views of it), as do their gradients unless DDP already gave them flat
/// bucket views, and the moments are flat buffers of the same layout. step() updates every
/// element of a bucket in one at::parallel_for pass (intra-op threads; AVX2 when the CPU has it),
/// instead of LibTorch's ~8 tensor ops per parameter. A parameter whose grad is undefined is
/// skipped and its step count not advanced, as in torch.
/// Moments are kept in the parameter's dtype for fp32/fp64 parameters and in fp32 for
/// bf16/fp16 parameters (torch keeps them in the parameter dtype). Non-CPU devices use a
/// per-parameter tensor-op path with the same arithmetic (untested here: no GPU).
class AdamW : public FlatOptimizer {
 public:
  explicit AdamW(std::vector<torch::optim::OptimizerParamGroup> groups,
                 torch::optim::AdamWOptions defaults = {});
  explicit AdamW(std::vector<torch::Tensor> params, torch::optim::AdamWOptions defaults = {});

  using torch::optim::Optimizer::step;
  /// One update of every parameter with a gradient. torch: `optimizer.step(closure)`.
  torch::Tensor step(LossClosure closure = nullptr) override;

  int64_t state_bytes() const override;
  std::shared_ptr<FlatOptimizer> make_like(
      std::vector<torch::optim::OptimizerParamGroup> groups) const override;
  /// Tensors "<name>.exp_avg", "<name>.exp_avg_sq" (and ".max_exp_avg_sq" with amsgrad) shaped
  /// like the parameter; JSON with hyperparameters and per-parameter steps.
  OptimizerState state_dict() const override;
  void load_state_dict(const OptimizerState& state) override;

  /// The first and second moments of parameter `index` of group `group` (views of the flat
  /// state; undefined before the parameter's first update).
  torch::Tensor exp_avg(size_t group, size_t index) const;
  torch::Tensor exp_avg_sq(size_t group, size_t index) const;

  /// Test hook: use the per-parameter tensor-op path on CPU too (the non-CPU path).
  void set_use_reference_path(bool on) { reference_path_ = on; }

 private:
  struct BucketState {
    torch::Tensor exp_avg, exp_avg_sq, max_exp_avg_sq;  // [bucket numel], allocated lazily
  };
  void allocate_state(size_t b);
  torch::Tensor state_view(size_t group, size_t index, int which) const;

  std::vector<BucketState> state_;
  void release_state() override { state_.assign(state_.size(), BucketState{}); }
  bool reference_path_ = false;
};

}  // namespace difftrain::optim
