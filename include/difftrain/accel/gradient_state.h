#pragma once

#include "difftrain/accel/grad_sync.h"
#include "difftrain/accel/precision.h"

#include <cstdint>
#include <memory>
#include <vector>

namespace difftrain::accel {

/// What the Accelerator and the objects it prepared share about the current step
/// (Accelerate's `GradientState` plus the loss scaler and the gradient-sync engines).
struct GradientState {
  /// True on the micro-step whose backward synchronises gradients (Accelerate's
  /// `accelerator.sync_gradients`). True until the first accumulate(); afterwards it keeps the
  /// last micro-step's value, as in Accelerate.
  bool sync_gradients = true;
  /// Micro-steps in the current accumulation window and the window's size (the loss divisor).
  int64_t micro_step = 0;
  int64_t window = 1;
  /// Real optimizer updates made by all prepared optimizers (drives prepared schedulers).
  int64_t optimizer_updates = 0;
  /// Whether the last synchronising optimizer step was skipped (fp16 inf/NaN).
  bool step_skipped = false;
  MixedPrecision mixed_precision = MixedPrecision::kNo;
  /// fp16 loss scaler; null unless mixed_precision is fp16.
  std::unique_ptr<GradScaler> scaler;
  /// One gradient-sync engine per prepared model that has trainable parameters (world size > 1):
  /// a DDP Reducer, or a ShardedModel under a sharding strategy.
  std::vector<std::unique_ptr<GradSync>> grad_syncs;
  /// Whether the scaler was updated after the last unscale (it is updated once per
  /// synchronising step, before the next backward, however many optimizers stepped).
  bool scaler_updated = true;
  /// Parameters of every prepared optimizer: unscaled together, once per step.
  std::vector<torch::Tensor> optimizer_params;
  /// How many optimizers were prepared.
  int num_optimizers = 0;

  /// Applies the pending loss-scale update (growth or backoff) if a step was decided.
  void update_scaler() {
    if (scaler && !scaler_updated) {
      scaler->update();
      scaler_updated = true;
    }
  }

  /// Waits for every gradient all-reduce in flight.
  void finish_reduction() {
    for (auto& g : grad_syncs) g->finish();
  }
};

}  // namespace difftrain::accel
