#include "difftrain/accel/reducer.h"

#include "difftrain/core/error.h"

#include <torch/csrc/autograd/function.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <unordered_map>
#include <unordered_set>

namespace difftrain::accel {

namespace {

constexpr double kMiB = 1024.0 * 1024.0;

std::string list_names(const std::vector<std::string>& names) {
  std::string out;
  const size_t shown = std::min<size_t>(names.size(), 8);
  for (size_t i = 0; i < shown; ++i) out += (i ? ", " : "") + names[i];
  if (names.size() > shown) out += fmt::format(" and {} more", names.size() - shown);
  return out;
}

}  // namespace

Reducer::Reducer(std::vector<std::pair<std::string, torch::Tensor>> params,
                 distributed::ProcessGroup& group, ReducerOptions options)
    : group_(group), options_(options) {
  if (options_.bucket_cap_mb <= 0 || options_.first_bucket_cap_mb <= 0) {
    throw Error(fmt::format("bucket_cap_mb must be positive, got {} (first bucket {})",
                            options_.bucket_cap_mb, options_.first_bucket_cap_mb));
  }
  for (auto& [name, tensor] : params) {
    if (!tensor.requires_grad()) {
      frozen_.push_back(tensor);  // frozen: never communicated
      continue;
    }
    Param p;
    p.name = name;
    p.tensor = tensor;
    params_.push_back(std::move(p));
  }

  // Buckets in reverse registration order: the last layers' gradients come first in backward.
  GradBucket* current = nullptr;
  int64_t current_bytes = 0;
  std::vector<torch::TensorOptions> bucket_options;
  std::vector<int64_t> bucket_numel;
  for (size_t k = params_.size(); k-- > 0;) {
    const auto& t = params_[k].tensor;
    const int64_t bytes = t.numel() * static_cast<int64_t>(t.element_size());
    const bool same_kind = current != nullptr && bucket_options.back().dtype() == t.dtype() &&
                           bucket_options.back().device() == t.device();
    // The first bucket is small so its all-reduce starts early in backward.
    const double cap_now =
        buckets_.size() == 1 ? options_.first_bucket_cap_mb : options_.bucket_cap_mb;
    if (current == nullptr || !same_kind ||
        (current_bytes > 0 && static_cast<double>(current_bytes + bytes) > cap_now * kMiB)) {
      buckets_.emplace_back();
      bucket_options.push_back(t.options().requires_grad(false));
      bucket_numel.push_back(0);
      current = &buckets_.back();
      current_bytes = 0;
    }
    current->params.push_back(k);
    current->offsets.push_back(bucket_numel.back());
    bucket_numel.back() += t.numel();
    current_bytes += bytes;
    params_[k].bucket = buckets_.size() - 1;
  }

  torch::NoGradGuard no_grad;
  for (size_t b = 0; b < buckets_.size(); ++b) {
    auto& bucket = buckets_[b];
    bucket.flat = torch::zeros({bucket_numel[b]}, bucket_options[b]);
    for (size_t j = 0; j < bucket.params.size(); ++j) {
      auto& p = params_[bucket.params[j]];
      p.view = bucket.flat.narrow(0, bucket.offsets[j], p.tensor.numel()).view(p.tensor.sizes());
      bind_grad(bucket.params[j]);
    }
  }

  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    p.hook = GradReadyHook(p.tensor, [this, i] { on_grad_ready(i); });
    if (!p.hook.attached()) {
      throw Error(
          fmt::format("parameter '{}' is not a leaf tensor that requires grad; DDP can "
                      "only reduce gradients of leaf parameters",
                      p.name));
    }
  }
}

Reducer::~Reducer() {
  for (auto& p : params_) p.hook.remove();
  // Collectives still in flight keep their buffers alive through their Work objects.
}

void Reducer::set_sync(bool sync) {
  std::lock_guard<std::mutex> lock(mutex_);
  sync_ = sync;
}

void Reducer::bind_grad(size_t index) {
  auto& p = params_[index];
  const auto& grad = p.tensor.grad();
  if (grad.defined() && grad.is_same(p.view)) return;
  torch::NoGradGuard no_grad;
  if (grad.defined()) {
    p.view.copy_(grad);
  } else {
    p.view.zero_();
  }
  p.tensor.mutable_grad() = p.view;
}

void Reducer::reset_pass() {
  for (auto& p : params_) p.ready = false;
  for (auto& b : buckets_) {
    b.pending = b.params.size();
    b.launched = false;
    b.work = distributed::PendingAllReduce();
  }
  next_bucket_ = 0;
  pass_active_ = false;
  callback_queued_ = false;
  in_backward_ = false;
}

void Reducer::start_pass() {
  reset_pass();
  pass_active_ = true;
  ++stats_.passes;
}

void Reducer::prepare_for_backward(const torch::Tensor& loss) {
  if (pass_active_) finish();  // a previous synchronising backward nobody waited for
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync_) return;
  start_pass();
  if (!options_.find_unused_parameters) return;

  // Every gradient accumulator reachable from the loss will fire; the rest are unused.
  std::unordered_set<const torch::autograd::Node*> seen;
  std::vector<const torch::autograd::Node*> stack;
  if (loss.grad_fn()) stack.push_back(loss.grad_fn().get());
  while (!stack.empty()) {
    const auto* node = stack.back();
    stack.pop_back();
    if (!seen.insert(node).second) continue;
    for (const auto& edge : node->next_edges()) {
      if (edge.function && !seen.count(edge.function.get())) stack.push_back(edge.function.get());
    }
  }
  for (size_t i = 0; i < params_.size(); ++i) {
    if (!seen.count(params_[i].hook.accumulator())) {
      bind_grad(i);
      mark_ready(i);
    }
  }
  launch_ready_buckets();
}

void Reducer::on_grad_ready(size_t index) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (!sync_) return;               // accumulation micro-step: gradients stay local
  if (!pass_active_) start_pass();  // loss.backward() called without prepare_for_backward
  if (!callback_queued_) {
    callback_queued_ = true;
    in_backward_ = true;
    queue_after_backward([this]() { on_backward_end(); });
  }
  bind_grad(index);
  if (params_[index].ready) {
    throw Error(fmt::format(
        "{}: parameter '{}' got a gradient twice in one synchronising step; call backward once "
        "per step, or accumulate with accelerator.accumulate() so only the last micro-step syncs",
        group_.describe(), params_[index].name));
  }
  mark_ready(index);
  launch_ready_buckets();
}

void Reducer::mark_ready(size_t index) {
  auto& p = params_[index];
  if (p.ready) return;
  p.ready = true;
  --buckets_[p.bucket].pending;
}

void Reducer::launch_ready_buckets() {
  if (!options_.overlap && in_backward_) return;
  while (next_bucket_ < buckets_.size() && buckets_[next_bucket_].pending == 0) {
    auto& bucket = buckets_[next_bucket_];
    bucket.work = distributed::all_reduce_async(bucket.flat, distributed::ReduceOp::kMean, group_);
    bucket.launched = true;
    ++stats_.allreduces;
    if (in_backward_) ++stats_.launched_during_backward;
    ++next_bucket_;
  }
}

void Reducer::on_backward_end() {
  std::lock_guard<std::mutex> lock(mutex_);
  in_backward_ = false;
  if (!pass_active_) return;
  std::vector<std::string> missing;
  for (size_t i = 0; i < params_.size(); ++i) {
    if (params_[i].ready) continue;
    if (options_.find_unused_parameters) {
      bind_grad(i);
      mark_ready(i);
    } else {
      missing.push_back(params_[i].name);
    }
  }
  if (!missing.empty()) {
    const std::string message = fmt::format(
        "{}: {} trainable parameter(s) got no gradient in this backward pass: {}; if the model "
        "skips them in some steps set AcceleratorOptions.ddp.find_unused_parameters, if they never "
        "train call requires_grad_(false) on them",
        group_.describe(), missing.size(), list_names(missing));
    reset_pass();
    throw Error(message);
  }
  launch_ready_buckets();
}

void Reducer::finish() {
  std::unique_lock<std::mutex> lock(mutex_);
  if (!pass_active_) return;
  if (next_bucket_ < buckets_.size()) {
    // Backward never reached some parameters (e.g. no hook fired at all): same rules as the
    // end-of-backward check.
    lock.unlock();
    on_backward_end();
    lock.lock();
  }
  try {
    for (auto& bucket : buckets_) bucket.work.wait();
  } catch (...) {
    reset_pass();
    throw;
  }
  reset_pass();
}

void Reducer::zero_grad() {
  std::lock_guard<std::mutex> lock(mutex_);
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params_.size(); ++i) bind_grad(i);
  for (auto& b : buckets_) b.flat.zero_();
}

double Reducer::grad_norm_part(double norm_type) const {
  std::vector<torch::Tensor> tensors;
  tensors.reserve(params_.size());
  for (const auto& p : params_) tensors.push_back(p.tensor);
  return grad_norm_part_of(tensors, norm_type);
}

void Reducer::scale_grads(double factor) {
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().mul_(factor);
  }
}

void Reducer::clamp_grads(double value) {
  torch::NoGradGuard no_grad;
  for (auto& p : params_) {
    if (p.tensor.grad().defined()) p.tensor.mutable_grad().clamp_(-value, value);
  }
}

StateMemory Reducer::memory() const {
  std::vector<torch::Tensor> tensors;
  for (const auto& p : params_) tensors.push_back(p.tensor);
  tensors.insert(tensors.end(), frozen_.begin(), frozen_.end());
  return replicated_memory(tensors);
}

std::vector<std::vector<std::string>> Reducer::bucket_names() const {
  std::vector<std::vector<std::string>> out;
  for (const auto& b : buckets_) {
    out.emplace_back();
    for (size_t i : b.params) out.back().push_back(params_[i].name);
  }
  return out;
}

}  // namespace difftrain::accel
