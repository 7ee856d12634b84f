#include "difftrain/accel/accelerated_optimizer.h"

#include "difftrain/optim/flat_optimizer.h"

#include <torch/torch.h>

namespace difftrain::accel {

AcceleratedOptimizer::AcceleratedOptimizer(std::shared_ptr<torch::optim::Optimizer> optimizer,
                                           std::shared_ptr<GradientState> state)
    : optimizer_(std::move(optimizer)), state_(std::move(state)) {}

std::vector<torch::Tensor> AcceleratedOptimizer::parameters() const {
  std::vector<torch::Tensor> out;
  for (const auto& group : optimizer_->param_groups()) {
    out.insert(out.end(), group.params().begin(), group.params().end());
  }
  return out;
}

void AcceleratedOptimizer::step() {
  if (!state_->sync_gradients) return;  // accumulation micro-step
  state_->finish_reduction();
  skipped_ = false;
  if (state_->scaler) {
    // Unscales every prepared optimizer's gradients once (a no-op after clip_grad_norm_) and
    // learns whether any rank saw inf/NaN.
    state_->scaler->unscale_(state_->optimizer_params);
    state_->scaler_updated = false;
    skipped_ = state_->scaler->found_inf();
  }
  if (!skipped_) {
    if (before_step_) before_step_();
    optimizer_->step();
    if (after_step_) after_step_();
    ++updates_;
    ++state_->optimizer_updates;
  }
  state_->step_skipped = skipped_;
}

void AcceleratedOptimizer::zero_grad(bool set_to_none) {
  if (!state_->sync_gradients) return;
  state_->finish_reduction();
  torch::NoGradGuard no_grad;
  const bool drop = set_to_none && state_->grad_syncs.empty();
  for (auto& p : parameters()) {
    if (!p.grad().defined()) continue;
    if (drop) {
      p.mutable_grad() = torch::Tensor();
    } else {
      p.mutable_grad().zero_();
    }
  }
  if (!drop) return;
  if (auto* flat = dynamic_cast<optim::FlatOptimizer*>(optimizer_.get())) {
    flat->drop_unused_grad_storage();
  }
}

AcceleratedScheduler::AcceleratedScheduler(std::function<void()> step,
                                           std::shared_ptr<GradientState> state,
                                           std::function<nlohmann::json()> save,
                                           std::function<void(const nlohmann::json&)> load)
    : step_(std::move(step)),
      state_(std::move(state)),
      save_(std::move(save)),
      load_(std::move(load)) {}

nlohmann::json AcceleratedScheduler::state_dict() const {
  return save_ ? save_() : nlohmann::json();
}

void AcceleratedScheduler::load_state_dict(const nlohmann::json& state) {
  if (load_) load_(state);
}

void AcceleratedScheduler::step() {
  if (state_->num_optimizers == 0) {
    // Nothing to follow: behave like the bare scheduler.
    step_();
    ++steps_;
    return;
  }
  if (state_->optimizer_updates == seen_updates_) return;  // no real update since last call
  seen_updates_ = state_->optimizer_updates;
  step_();
  ++steps_;
}

}  // namespace difftrain::accel
