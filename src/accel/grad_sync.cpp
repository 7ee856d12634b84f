#include "difftrain/accel/grad_sync.h"

#include "difftrain/core/nested_backward.h"

#include <torch/csrc/autograd/engine.h>
#include <torch/csrc/autograd/utils/lambda_post_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <algorithm>
#include <cmath>
#include <utility>

namespace difftrain::accel {

double grad_norm_part_of(const std::vector<torch::Tensor>& tensors, double norm_type) {
  double acc = 0;
  for (const auto& t : tensors) {
    const auto& g = t.grad();
    if (!g.defined()) continue;
    if (std::isinf(norm_type)) {
      acc = std::max(acc, g.abs().max().item<double>());
    } else {
      acc += g.to(torch::kDouble).norm(norm_type).pow(norm_type).item<double>();
    }
  }
  return acc;
}

StateMemory replicated_memory(const std::vector<torch::Tensor>& params) {
  StateMemory m;
  for (const auto& p : params) {
    const int64_t bytes = p.numel() * static_cast<int64_t>(p.element_size());
    if (!p.requires_grad()) {
      m.frozen_param_bytes += bytes;
      continue;
    }
    m.param_bytes += bytes;
    m.grad_bytes += bytes;  // DDP's buckets (or the optimizer's gradient slots) hold them all
  }
  m.param_peak_bytes = m.param_bytes;
  m.grad_peak_bytes = m.grad_bytes;
  return m;
}

GradReadyHook::GradReadyHook(const torch::Tensor& param, std::function<void()> on_ready) {
  auto accumulator = torch::autograd::impl::grad_accumulator(param);
  if (!accumulator) return;
  key_ = accumulator->add_post_hook(std::make_unique<torch::autograd::utils::LambdaPostHook>(
      [on_ready = std::move(on_ready)](const torch::autograd::variable_list& outputs,
                                       const torch::autograd::variable_list&) {
        on_ready();
        return outputs;
      }));
  accumulator_ = std::move(accumulator);
}

GradReadyHook::GradReadyHook(GradReadyHook&& other) noexcept
    : accumulator_(std::move(other.accumulator_)), key_(other.key_) {
  other.accumulator_.reset();
}

GradReadyHook& GradReadyHook::operator=(GradReadyHook&& other) noexcept {
  if (this != &other) {
    remove();
    accumulator_ = std::move(other.accumulator_);
    key_ = other.key_;
    other.accumulator_.reset();
  }
  return *this;
}

void GradReadyHook::remove() {
  if (accumulator_) accumulator_->del_post_hook(key_);
  accumulator_.reset();
}

void queue_after_backward(std::function<void()> callback) {
  // From a checkpoint's nested backward, the callback belongs to the outer pass.
  core::when_back_in_outer_backward([callback = std::move(callback)]() mutable {
    torch::autograd::Engine::get_default_engine().queue_callback(std::move(callback));
  });
}

}  // namespace difftrain::accel
