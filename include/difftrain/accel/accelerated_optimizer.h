#pragma once

#include "difftrain/accel/gradient_state.h"

#include <torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <memory>
#include <vector>

namespace difftrain::accel {

/// An optimizer prepared by the Accelerator (Accelerate's `AcceleratedOptimizer`).
/// step() and zero_grad() do nothing on accumulation micro-steps; on a synchronising step,
/// step() waits for the gradient all-reduce still in flight, unscales fp16 gradients, skips the
/// update when any rank found inf/NaN (and then updates the loss scale), and counts real
/// updates so a prepared LR scheduler steps once per update.
class AcceleratedOptimizer {
 public:
  AcceleratedOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer,
                       std::shared_ptr<GradientState> state);

  /// The update, or nothing on an accumulation micro-step. torch: `optimizer.step()`.
  void step();
  /// Zeroes gradients in place on a synchronising step (keeps DDP bucket views).
  /// torch: `optimizer.zero_grad(set_to_none=False)`.
  void zero_grad() { zero_grad(/*set_to_none=*/false); }
  /// set_to_none: drops the gradients instead (torch 2's default `optimizer.zero_grad()`), so
  /// the next backward allocates them as it frees the forward's tensors, and a flat optimizer's
  /// gradient buffer is freed (optim::FlatOptimizer::drop_unused_grad_storage); the peak of a
  /// full fine-tune falls by the gradients' size. Where a gradient-sync engine (DDP buckets, a
  /// sharding strategy) owns the gradients' storage they are zeroed in place, whatever the flag.
  void zero_grad(bool set_to_none);
  /// True when the last synchronising step() skipped the update (fp16 inf/NaN).
  /// Accelerate: `accelerator.optimizer_step_was_skipped`.
  bool step_was_skipped() const { return skipped_; }
  /// Real updates made so far.
  int64_t num_updates() const { return updates_; }
  /// Every parameter of every group.
  std::vector<torch::Tensor> parameters() const;

  torch::optim::Optimizer& optimizer() { return *optimizer_; }
  std::shared_ptr<torch::optim::Optimizer> shared() const { return optimizer_; }
  /// Runs `before` just before each real update and `after` just after it (the sharding engine
  /// copies the LR schedule's values in, and gathers the updated shards out).
  void set_step_hooks(std::function<void()> before, std::function<void()> after) {
    before_step_ = std::move(before);
    after_step_ = std::move(after);
  }
  /// The optimizer the user made, when it differs from optimizer() (sharded training: optimizer()
  /// is the per-rank optimizer over the shards).
  std::shared_ptr<torch::optim::Optimizer> user_optimizer() const { return user_; }
  void set_user_optimizer(std::shared_ptr<torch::optim::Optimizer> user) {
    user_ = std::move(user);
  }
  /// Overwrites the count of real updates (when resuming from a checkpoint).
  void set_num_updates(int64_t updates) { updates_ = updates; }

 private:
  std::shared_ptr<torch::optim::Optimizer> optimizer_;
  std::shared_ptr<GradientState> state_;
  bool skipped_ = false;
  int64_t updates_ = 0;
  std::function<void()> before_step_, after_step_;
  std::shared_ptr<torch::optim::Optimizer> user_;
};

/// An LR scheduler prepared by the Accelerator (Accelerate's `AcceleratedScheduler`).
/// step() advances the wrapped scheduler once per REAL optimizer update: not on accumulation
/// micro-steps and not when fp16 skipped the update. Unlike Accelerate, it never advances
/// num_processes times per update (accelerate #662, #1382): schedules are written in optimizer
/// updates, whatever the world size.
class AcceleratedScheduler {
 public:
  AcceleratedScheduler(std::function<void()> step, std::shared_ptr<GradientState> state,
                       std::function<nlohmann::json()> save = nullptr,
                       std::function<void(const nlohmann::json&)> load = nullptr);
  /// Whether the wrapped scheduler has state to save (it has state_dict()/load_state_dict()).
  bool has_state() const { return static_cast<bool>(save_); }
  /// The wrapped scheduler's state_dict(); null when it has none.
  nlohmann::json state_dict() const;
  /// Passes `state` to the wrapped scheduler's load_state_dict().
  void load_state_dict(const nlohmann::json& state);
  /// Steps the wrapped scheduler when a prepared optimizer made an update since the last call.
  void step();
  /// How many times the wrapped scheduler was stepped.
  int64_t steps() const { return steps_; }
  /// Restores the step count and the optimizer-update count last followed (on resume).
  void restore(int64_t steps, int64_t optimizer_updates) {
    steps_ = steps;
    seen_updates_ = optimizer_updates;
  }

 private:
  std::function<void()> step_;
  std::shared_ptr<GradientState> state_;
  std::function<nlohmann::json()> save_;
  std::function<void(const nlohmann::json&)> load_;
  int64_t seen_updates_ = 0;
  int64_t steps_ = 0;
};

}  // namespace difftrain::accel
