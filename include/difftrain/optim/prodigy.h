#pragma once
// Prodigy (Mishchenko & Defazio 2023; the prodigyopt package Diffusers' and kohya's scripts use
// with --optimizer prodigy): Adam whose step size d is estimated from the run itself, on
// difftrain's flat buffers, so it is prepared, sharded under ZeRO and checkpointed like AdamW.

#include "difftrain/optim/flat_optimizer.h"

#include <torch/optim/adamw.h>

#include <limits>
#include <optional>

namespace difftrain::optim {

/// Prodigy's own settings (the group options are AdamWOptions: lr — 1.0 is Prodigy's advice —,
/// betas, eps, weight_decay).
struct ProdigyOptions {
  /// The EMA coefficient of the estimate's sums; unset: sqrt(beta2) (--prodigy_beta3).
  std::optional<double> beta3;
  double d0 = 1e-6;     ///< the initial estimate of d
  double d_coef = 1.0;  ///< scales the estimate (the knob prodigyopt recommends turning)
  double growth_rate = std::numeric_limits<double>::infinity();  ///< max growth of d per step
  bool decouple = true;              ///< AdamW-style weight decay (--prodigy_decouple)
  bool use_bias_correction = false;  ///< Adam's bias correction (--prodigy_use_bias_correction)
  bool safeguard_warmup = false;     ///< no lr in the estimate's denominator (warm-up)
};

/// prodigyopt's Prodigy.step, per parameter p with gradient g (weight decay added to g first when
/// not decoupled), with one d shared by every parameter group:
///   dlr = d·lr·bc (bc = sqrt(1 − β2^(k+1)) / (1 − β1^(k+1)) with bias correction, else 1)
///   num ← β3·num + Σ (d/d0)·dlr·⟨g, p0 − p⟩       (p0: p at its first update)
///   m ← β1·m + d(1 − β1)·g;  v ← β2·v + d²(1 − β2)·g²;  s ← β3·s + (d/d0)·(d or dlr)·g
///   d̂ = d_coef·num / Σ|s|;  d ← max(d, d̂) on the first growth;  d_max ← max(d_max, d̂);
///   d ← min(d_max, d·growth_rate)
///   p ← p − decay·dlr·p (decoupled);  p ← p − dlr·m / (√v + d·eps)   (β1 = 0: g·d in place of m)
/// lr is the largest group lr (groups may only have it or 0). When every gradient is zero the
/// step changes nothing but the moments, as prodigyopt's early return. Under ZeRO the two sums
/// are added across the ranks (set_cross_shard_sum), so a sharded run follows the unsharded one.
/// State (s, p0, m, v) is kept in float32 for bf16/fp16 parameters (prodigyopt keeps p0 and the
/// moments in the parameter's dtype) and in the parameter's dtype otherwise.
class Prodigy : public FlatOptimizer {
 public:
  explicit Prodigy(std::vector<torch::optim::OptimizerParamGroup> groups,
                   torch::optim::AdamWOptions defaults = default_group_options(),
                   ProdigyOptions options = {});
  explicit Prodigy(std::vector<torch::Tensor> params,
                   torch::optim::AdamWOptions defaults = default_group_options(),
                   ProdigyOptions options = {});

  /// lr 1, betas (0.9, 0.999), eps 1e-8, weight decay 0: prodigyopt's defaults.
  static torch::optim::AdamWOptions default_group_options();

  using torch::optim::Optimizer::step;
  torch::Tensor step(LossClosure closure = nullptr) override;

  int64_t state_bytes() const override;
  std::shared_ptr<FlatOptimizer> make_like(
      std::vector<torch::optim::OptimizerParamGroup> groups) const override;
  /// Tensors "<name>.exp_avg" (β1 > 0), ".exp_avg_sq", ".s", ".p0" shaped like the parameter;
  /// JSON with the hyperparameters, per-parameter steps and the estimate (d, d_max,
  /// d_numerator, k).
  OptimizerState state_dict() const override;
  void load_state_dict(const OptimizerState& state) override;

  /// The current step-size estimate d, its running max and last d̂, and the updates taken k.
  double d() const { return d_; }
  double d_max() const { return d_max_; }
  double d_hat() const { return d_hat_; }
  int64_t k() const { return k_; }
  const ProdigyOptions& options() const { return options_; }

 private:
  struct BucketState {
    torch::Tensor exp_avg, exp_avg_sq, s, p0;  // [bucket numel], allocated lazily
  };
  void allocate_state(size_t b);
  /// which: 0 exp_avg, 1 exp_avg_sq, 2 s, 3 p0.
  torch::Tensor state_view(size_t group, size_t index, int which) const;

  ProdigyOptions options_;
  std::vector<BucketState> state_;
  double d_ = 0, d_max_ = 0, d_numerator_ = 0, d_hat_ = 0;
  int64_t k_ = 0;
  void release_state() override { state_.assign(state_.size(), BucketState{}); }
};

}  // namespace difftrain::optim
