#include "difftrain/accel/sharded_model.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"

#include <c10/util/strides.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <map>
#include <unordered_map>

namespace difftrain::accel {
namespace {

// Elements [offset, offset + numel(sizes)) of `flat` as a tensor of `sizes` sharing its storage
// (not an autograd view, so set_data() and gradient slots treat it as a plain tensor).
torch::Tensor storage_slice(const torch::Tensor& flat, int64_t offset, torch::IntArrayRef sizes) {
  return torch::empty({0}, flat.options())
      .set_(flat.storage(), flat.storage_offset() + offset, sizes, c10::contiguous_strides(sizes));
}

int64_t bytes_of(const torch::Tensor& t) {
  return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0;
}

// Frees a buffer's memory while every tensor viewing it keeps the same storage object, so a
// later realloc_storage() makes them (and the tensors autograd saved) valid again.
void free_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  impl->set_data_ptr_noswap(at::DataPtr(nullptr, t.device()));
  impl->set_nbytes(0);
}

void realloc_storage(const torch::Tensor& t) {
  auto* impl = t.storage().unsafeGetStorageImpl();
  const size_t bytes = static_cast<size_t>(t.numel()) * t.element_size();
  impl->set_data_ptr_noswap(impl->allocator()->allocate(bytes));
  impl->set_nbytes(bytes);
}

}  // namespace

struct ShardedModel::Unit {
  const torch::nn::Module* module = nullptr;  // null: no module hook (root of a plain model)
  bool resident = true;                       // full parameters never freed
  std::vector<size_t> params;
  int64_t numel = 0, shard = 0, padded = 0;
  torch::Tensor full;       // [padded]; storage freed while sharded (FULL_SHARD)
  torch::Tensor full_grad;  // [padded]; undefined when not allocated (ZeRO-2/3)
  bool gathered = true;
  bool gather_pending = false;
  distributed::PendingCollective gather_work;
  size_t pending = 0;  // parameters without their gradient this pass
  bool reduce_launched = false;
  distributed::PendingCollective reduce_work;  // reduce-scatter into reduce_out (ZeRO-2/3)
  distributed::PendingAllReduce allreduce_work;
  torch::Tensor reduce_out;  // [shard]
  torch::Tensor dev_shard;   // offload under FULL_SHARD: the device's copy of the shard
  torch::Tensor gather_src;  // the input of an all-gather in flight
};

struct ShardedModel::Param {
  std::string name;
  torch::Tensor tensor;
  size_t unit = 0;
  int64_t offset = 0;  // in the unit's flat buffer
  GradReadyHook hook;
  bool ready = false;
};

// The registry's handle on the engine; detached when the engine goes away, so hooks left in an
// autograd graph that outlives it do nothing.
class ShardedModel::Hooks : public core::ForwardHooks {
 public:
  explicit Hooks(ShardedModel* engine) : engine_(engine) {}
  void before_forward(const torch::nn::Module& module) override {
    if (engine_) engine_->before_forward(unit_of(module));
  }
  void after_forward(const torch::nn::Module& module,
                     std::vector<torch::Tensor>& outputs) override {
    if (engine_) engine_->after_forward(unit_of(module), outputs);
  }
  size_t unit_of(const torch::nn::Module& module) const { return units_.at(&module); }
  ShardedModel* engine_;
  std::unordered_map<const torch::nn::Module*, size_t> units_;
};

ShardedModel::ShardedModel(torch::nn::Module& module, const ShardingOptions& options,
                           distributed::ProcessGroup& group)
    : module_(module), options_(options), group_(group) {
  world_ = group.size();
  rank_ = group.rank();
  settings::check_offload(options_);
  offload_ = options_.offload_optimizer;
  offload_params_ = options_.offload_params;
  plans_ = plan_units(module, options.auto_wrap);
  std::map<std::string, const torch::nn::Module*> modules;
  for (const auto& item : module.named_modules("", true)) modules[item.key()] = item.value().get();
  modules[""] = &module;
  std::map<std::string, torch::Tensor> named;
  for (const auto& item : module.named_parameters(true)) {
    if (item.value().requires_grad()) {
      named[item.key()] = item.value();
    } else {
      mem_.frozen_param_bytes += bytes_of(item.value());
    }
  }
  const bool full_shard = options_.strategy == ShardingStrategy::kFullShard;
  hooks_ = std::make_shared<Hooks>(this);
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < plans_.size(); ++u) {
    const auto& plan = plans_[u];
    auto unit = std::make_unique<Unit>();
    const auto* m = modules.at(plan.name);
    unit->module = core::is_hookable(*m) ? m : nullptr;
    unit->resident = !full_shard || unit->module == nullptr;
    unit->numel = plan.numel;
    unit->shard = (plan.numel + world_ - 1) / world_;
    unit->padded = unit->shard * world_;
    torch::TensorOptions topts;
    int64_t offset = 0;
    for (const auto& name : plan.params) {
      const auto& t = named.at(name);
      if (offset == 0) {
        topts = t.options();
      } else if (t.scalar_type() != topts.dtype().toScalarType() || t.device() != topts.device()) {
        throw Error(fmt::format(
            "sharding: parameter '{}' is {} on {} but unit '{}' started with {} on {}; a unit's "
            "parameters must share dtype and device (wrap differently or cast the model)",
            name, c10::toString(t.scalar_type()), t.device().str(), plan.name,
            c10::toString(topts.dtype().toScalarType()), topts.device().str()));
      }
      Param p;
      p.name = name;
      p.tensor = t;
      p.unit = u;
      p.offset = offset;
      unit->params.push_back(params_.size());
      params_.push_back(std::move(p));
      offset += t.numel();
    }
    unit->full = torch::zeros({unit->padded}, topts.requires_grad(false));
    for (size_t i : unit->params) {
      auto& p = params_[i];
      auto slot = storage_slice(unit->full, p.offset, p.tensor.sizes());
      slot.copy_(p.tensor.detach());
      p.tensor.set_data(slot);
      p.tensor.mutable_grad() = torch::Tensor();
    }
    track(mem_.param_bytes, mem_.param_peak_bytes, bytes_of(unit->full));
    const auto own = unit->full.narrow(0, rank_ * unit->shard, unit->shard);
    torch::Tensor shard;
    if (offload_) {
      // The master shard in host memory, pinned where the device is a GPU.
      auto host = own.options().device(torch::kCPU);
      if (!own.device().is_cpu()) host = host.pinned_memory(true);
      shard = torch::empty({unit->shard}, host);
      shard.copy_(own);
      mem_.host_bytes += bytes_of(shard);
      if (full_shard && !offload_params_) {
        unit->dev_shard = own.clone();
        track(mem_.param_bytes, mem_.param_peak_bytes, bytes_of(unit->dev_shard));
      }
    } else {
      shard = own.clone();
      track(mem_.param_bytes, mem_.param_peak_bytes, bytes_of(shard));
    }
    shard.requires_grad_(true);
    shard_tensors_.push_back(shard);
    if (options_.strategy == ShardingStrategy::kShardOptimizer) {
      unit->full_grad = torch::zeros({unit->padded}, unit->full.options());
      track(mem_.grad_bytes, mem_.grad_peak_bytes, bytes_of(unit->full_grad));
      for (size_t i : unit->params) {
        params_[i].tensor.mutable_grad() =
            storage_slice(unit->full_grad, params_[i].offset, params_[i].tensor.sizes());
      }
    }
    if (unit->module) {
      hooks_->units_[unit->module] = u;
    }
    unit->pending = unit->params.size();
    units_.push_back(std::move(unit));
  }
  if (full_shard) {
    for (const auto& [m, u] : hooks_->units_) {
      core::set_forward_hooks(*m, hooks_);
      hooked_modules_.push_back(m);
    }
    for (size_t u = 0; u < units_.size(); ++u) free_full(u);
    int64_t kept = 0;
    for (const auto& unit : units_) kept += unit->resident ? unit->numel : 0;
    if (kept > 0) {
      log::info(
          "sharding: {} parameter(s) stay gathered under FULL_SHARD: their module has no "
          "forward hook (core::ForwardScope)",
          kept);
    }
  }
  // Peaks count from here: building the layout held the unsharded model once, as loading it did.
  mem_.param_peak_bytes = mem_.param_bytes;
  mem_.grad_peak_bytes = mem_.grad_bytes;
  for (size_t i = 0; i < params_.size(); ++i) {
    auto& p = params_[i];
    p.hook = GradReadyHook(p.tensor, [this, i] { on_grad_ready(i); });
    if (!p.hook.attached()) {
      throw Error(
          fmt::format("sharding: parameter '{}' is not a leaf tensor that requires grad", p.name));
    }
  }
  log::info(
      "sharding: {} over {} ranks, {} unit(s), largest {} elements, shard {} elements{}",
      to_string(options_.strategy), world_, units_.size(),
      [&] {
        int64_t m = 0;
        for (const auto& u : units_) m = std::max(m, u->numel);
        return m;
      }(),
      [&] {
        int64_t s = 0;
        for (const auto& u : units_) s += u->shard;
        return s;
      }(),
      offload_params_ ? "; optimizer and parameter shards in host memory"
      : offload_      ? "; optimizer shards in host memory"
                      : "");
}

ShardedModel::~ShardedModel() {
  hooks_->engine_ = nullptr;
  for (const auto* m : hooked_modules_) core::set_forward_hooks(*m, nullptr);
  for (auto& p : params_) p.hook.remove();
}

void ShardedModel::track(int64_t& current, int64_t& peak, int64_t delta) {
  current += delta;
  peak = std::max(peak, current);
}

// ------------------------------------------------------------------ gathering

void ShardedModel::gather(size_t u, bool async) {
  auto& unit = *units_[u];
  if (unit.gathered || unit.gather_pending) return;
  realloc_storage(unit.full);
  track(mem_.param_bytes, mem_.param_peak_bytes, bytes_of(unit.full));
  auto src = gather_source(u);
  auto work = distributed::all_gather_into_async(unit.full, src, group_);
  ++stats_.gathers;
  if (async) {
    unit.gather_work = std::move(work);
    unit.gather_src = src;  // alive until the gather is done
    unit.gather_pending = true;
    ++stats_.prefetched;
  } else {
    work.wait();
    unit.gathered = true;
  }
}

// What rank's all-gather of unit `u` sends: its shard on the device, in the parameters' dtype.
torch::Tensor ShardedModel::gather_source(size_t u) {
  if (!offload_) return shard_tensors_[u].detach();
  const auto& unit = *units_[u];
  if (unit.dev_shard.defined()) return unit.dev_shard;
  // From the host (pinned on CUDA: the copy runs ahead on the stream the collective waits on).
  return shard_tensors_[u].detach().to(unit.full.options(), /*non_blocking=*/true);
}

// `t` (on the device) in host memory; `t` itself when the device is the CPU.
torch::Tensor ShardedModel::host_copy(const torch::Tensor& t) const {
  return t.device().is_cpu() ? t : t.to(torch::kCPU);
}

void ShardedModel::wait_gather(size_t u) {
  auto& unit = *units_[u];
  if (unit.gather_pending) {
    unit.gather_work.wait();
    unit.gather_src = torch::Tensor();
    unit.gather_pending = false;
    unit.gathered = true;
  }
  if (!unit.gathered) gather(u, false);
}

void ShardedModel::free_full(size_t u) {
  auto& unit = *units_[u];
  if (unit.resident || full_params_depth_ > 0) return;
  if (unit.gather_pending) wait_gather(u);
  if (!unit.gathered) return;
  free_storage(unit.full);
  track(mem_.param_bytes, mem_.param_peak_bytes, -bytes_of(unit.full));
  unit.gathered = false;
  ++stats_.frees;
}

void ShardedModel::prefetch_after(size_t u, bool backward) {
  const auto& order = backward ? forward_order_ : last_forward_order_;
  if (backward ? !options_.backward_prefetch : !options_.forward_prefetch) return;
  size_t pos = order.size();
  if (backward) {
    for (size_t k = order.size(); k-- > 0;) {
      if (order[k] == u) {
        pos = k;
        break;
      }
    }
    if (pos == order.size() || pos == 0) return;
    const size_t next = order[pos - 1];
    if (next != u) gather(next, true);
  } else {
    const size_t k = forward_order_.size();  // u was just appended at k - 1
    if (k == 0 || k - 1 >= order.size() || order[k - 1] != u || k >= order.size()) return;
    const size_t next = order[k];
    if (next != u) gather(next, true);
  }
}

void ShardedModel::before_forward(size_t u) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!in_backward_) {
    // A new forward pass starts when a unit runs a second time.
    bool seen = false;
    for (size_t v : forward_order_) seen = seen || v == u;
    if (seen) {
      last_forward_order_ = std::move(forward_order_);
      forward_order_.clear();
    }
    forward_order_.push_back(u);
  }
  wait_gather(u);
  if (!in_backward_) prefetch_after(u, false);
}

void ShardedModel::after_forward(size_t u, std::vector<torch::Tensor>& outputs) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  bool hooked = false;
  if (torch::GradMode::is_enabled()) {
    std::weak_ptr<Hooks> weak = hooks_;
    for (auto& out : outputs) {
      if (!out.defined() || !out.requires_grad()) continue;
      out.register_hook([weak, u](const torch::Tensor&) {
        if (auto h = weak.lock()) {
          if (h->engine_) h->engine_->pre_backward(u);
        }
      });
      hooked = true;
    }
  }
  if (in_backward_) return;  // recomputed in backward (gradient checkpointing): still needed
  // The root unit's backward follows at once: keep it (FSDP does not reshard the root).
  const bool is_root = units_[u]->module == &module_;
  if (hooked && is_root) return;
  free_full(u);
}

void ShardedModel::pre_backward(size_t u) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  in_backward_ = true;
  if (!callback_queued_) {
    callback_queued_ = true;
    queue_after_backward([this]() { on_backward_end(); });
  }
  wait_gather(u);
  if (options_.strategy != ShardingStrategy::kShardOptimizer) bind_grads(u);
  prefetch_after(u, true);
}

// ------------------------------------------------------------------ gradients

void ShardedModel::ensure_grad_buffer(size_t u) {
  auto& unit = *units_[u];
  if (unit.full_grad.defined()) return;
  unit.full_grad = torch::zeros({unit.padded}, unit.full.options());
  track(mem_.grad_bytes, mem_.grad_peak_bytes, bytes_of(unit.full_grad));
}

void ShardedModel::bind_grads(size_t u) {
  auto& unit = *units_[u];
  ensure_grad_buffer(u);
  torch::NoGradGuard no_grad;
  const char* base = static_cast<const char*>(unit.full_grad.data_ptr());
  for (size_t i : unit.params) {
    auto& p = params_[i];
    const auto& g = p.tensor.grad();
    const void* want = base + p.offset * unit.full_grad.element_size();
    if (g.defined() && g.data_ptr() == want) continue;
    auto slot = storage_slice(unit.full_grad, p.offset, p.tensor.sizes());
    if (g.defined()) slot.copy_(g);
    p.tensor.mutable_grad() = slot;
  }
}

void ShardedModel::free_grad_buffer(size_t u) {
  auto& unit = *units_[u];
  if (!unit.full_grad.defined() || options_.strategy == ShardingStrategy::kShardOptimizer) return;
  for (size_t i : unit.params) params_[i].tensor.mutable_grad() = torch::Tensor();
  track(mem_.grad_bytes, mem_.grad_peak_bytes, -bytes_of(unit.full_grad));
  unit.full_grad = torch::Tensor();
}

void ShardedModel::on_grad_ready(size_t i) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  auto& p = params_[i];
  const size_t u = p.unit;
  pass_active_ = true;
  if (!callback_queued_) {
    callback_queued_ = true;
    in_backward_ = true;
    queue_after_backward([this]() { on_backward_end(); });
  }
  bind_grads(u);
  if (p.ready) {
    throw Error(fmt::format(
        "{}: parameter '{}' got a gradient twice in one backward pass under sharding; call "
        "backward once per micro-step",
        group_.describe(), p.name));
  }
  p.ready = true;
  if (--units_[u]->pending == 0) unit_done(u);
}

void ShardedModel::unit_done(size_t u) {
  auto& unit = *units_[u];
  if (reducing() && !unit.reduce_launched) {
    unit.reduce_launched = true;
    ++stats_.reduce_scatters;
    if (options_.strategy == ShardingStrategy::kShardOptimizer) {
      unit.allreduce_work =
          distributed::all_reduce_async(unit.full_grad, distributed::ReduceOp::kMean, group_);
    } else {
      unit.reduce_out = torch::empty({unit.shard}, unit.full_grad.options());
      unit.reduce_work = distributed::reduce_scatter_async(unit.full_grad, unit.reduce_out,
                                                           distributed::ReduceOp::kMean, group_);
    }
    // At most kInFlight reductions outstanding: the oldest one is finished (its full gradient
    // freed under SHARD_GRAD_OP / FULL_SHARD) before more start, so gradient memory stays near
    // the shards plus a few units, as FSDP's rate limiter keeps it.
    in_flight_.push_back(u);
    while (in_flight_.size() > kInFlight) {
      finalize_reduction(in_flight_.front());
      in_flight_.pop_front();
    }
  }
  free_full(u);
}

void ShardedModel::finalize_reduction(size_t u) {
  auto& unit = *units_[u];
  if (!unit.reduce_launched) return;
  torch::NoGradGuard no_grad;
  auto& shard_grad = shard_tensors_[u].mutable_grad();
  if (!shard_grad.defined()) shard_grad = torch::zeros({unit.shard}, shard_tensors_[u].options());
  // Under offload the shard's gradient is in host memory: the reduced shard is copied there.
  if (options_.strategy == ShardingStrategy::kShardOptimizer) {
    unit.allreduce_work.wait();
    shard_grad.add_(host_copy(unit.full_grad.narrow(0, rank_ * unit.shard, unit.shard)));
    unit.full_grad.zero_();
  } else {
    unit.reduce_work.wait();
    shard_grad.add_(host_copy(unit.reduce_out));
    unit.reduce_out = torch::Tensor();
    free_grad_buffer(u);
  }
  unit.reduce_launched = false;
}

void ShardedModel::on_backward_end() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  in_backward_ = false;
  callback_queued_ = false;
  // Parameters that got no gradient (unused this step) count with a zero gradient, in the same
  // order on every rank (every rank runs the same model code).
  for (size_t u = 0; u < units_.size(); ++u) {
    auto& unit = *units_[u];
    if (unit.pending == 0) continue;
    if (options_.strategy != ShardingStrategy::kShardOptimizer) bind_grads(u);
    for (size_t i : unit.params) params_[i].ready = true;
    unit.pending = 0;
    unit_done(u);
  }
  if (!reducing()) {
    // Accumulation micro-step: nothing to wait for; the next backward is a new pass.
    for (auto& unit : units_) unit->pending = unit->params.size();
    for (auto& p : params_) p.ready = false;
    pass_active_ = false;
  }
}

void ShardedModel::set_sync(bool sync) {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  sync_ = sync;
}

void ShardedModel::prepare_for_backward(const torch::Tensor&) {
  if (pass_active_) finish();
}

void ShardedModel::finish() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (!pass_active_) return;
  if (in_backward_) on_backward_end();
  torch::NoGradGuard no_grad;
  for (size_t u = 0; u < units_.size(); ++u) {
    auto& unit = *units_[u];
    finalize_reduction(u);
    unit.pending = unit.params.size();
    if (unit.gather_pending) wait_gather(u);
    if (!unit.resident) free_full(u);
  }
  in_flight_.clear();
  for (auto& p : params_) p.ready = false;
  pass_active_ = false;
}

void ShardedModel::zero_grad() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  torch::NoGradGuard no_grad;
  for (auto& s : shard_tensors_) {
    if (s.grad().defined()) s.mutable_grad().zero_();
  }
  for (auto& unit : units_) {
    if (unit->full_grad.defined()) unit->full_grad.zero_();
  }
}

double ShardedModel::grad_norm_part(double norm_type) const {
  return grad_norm_part_of(shard_tensors_, norm_type);
}

void ShardedModel::scale_grads(double factor) {
  torch::NoGradGuard no_grad;
  for (auto& s : shard_tensors_) {
    if (s.grad().defined()) s.mutable_grad().mul_(factor);
  }
}

void ShardedModel::clamp_grads(double v) {
  torch::NoGradGuard no_grad;
  for (auto& s : shard_tensors_) {
    if (s.grad().defined()) s.mutable_grad().clamp_(-v, v);
  }
}

// ------------------------------------------------------------------ optimizer

std::shared_ptr<optim::FlatOptimizer> ShardedModel::make_shard_optimizer(
    optim::FlatOptimizer& user) {
  std::unordered_map<const void*, size_t> group_of;
  for (size_t g = 0; g < user.param_groups().size(); ++g) {
    for (const auto& p : user.param_groups()[g].params()) group_of[p.unsafeGetTensorImpl()] = g;
  }
  unit_group_.assign(units_.size(), 0);
  for (size_t u = 0; u < units_.size(); ++u) {
    bool first = true;
    for (size_t i : units_[u]->params) {
      auto it = group_of.find(params_[i].tensor.unsafeGetTensorImpl());
      if (it == group_of.end()) {
        throw Error(fmt::format(
            "sharding: trainable parameter '{}' is not in the optimizer; give the optimizer every "
            "trainable parameter of the prepared model (or freeze it with requires_grad_(false))",
            params_[i].name));
      }
      if (!first && it->second != unit_group_[u]) {
        throw Error(fmt::format(
            "sharding: unit '{}' has parameters in optimizer groups {} and {} ('{}'); a sharded "
            "unit is one flat buffer with one set of hyperparameters: put a unit's parameters in "
            "one group or wrap differently",
            plans_[u].name.empty() ? "(root)" : plans_[u].name, unit_group_[u], it->second,
            params_[i].name));
      }
      unit_group_[u] = it->second;
      first = false;
    }
  }
  std::vector<torch::optim::OptimizerParamGroup> groups;
  std::vector<std::string> names;
  std::vector<size_t> group_map;
  for (size_t g = 0; g < user.param_groups().size(); ++g) {
    std::vector<torch::Tensor> shards;
    for (size_t u = 0; u < units_.size(); ++u) {
      if (unit_group_[u] != g) continue;
      shards.push_back(shard_tensors_[u]);
      names.push_back(plans_[u].name.empty() ? "(root)" : plans_[u].name);
    }
    if (shards.empty()) continue;
    groups.emplace_back(shards, user.param_groups()[g].options().clone());
    group_map.push_back(g);
  }
  // The shard tensors were listed unit by unit inside each group: record the order for names.
  shard_optimizer_ = user.make_like(std::move(groups));
  shard_optimizer_->set_parameter_names(names);
  shard_optimizer_->set_cross_shard_sum([group = &group_](torch::Tensor& t) {
    distributed::all_reduce(t, distributed::ReduceOp::kSum, *group);
  });
  user.release_storage();
  user_optimizer_ = &user;
  unit_group_.clear();
  for (size_t g : group_map) unit_group_.push_back(g);  // shard group -> user group
  // The shard tensors now live in the shard optimizer's buckets (it took their values), with a
  // gradient slot each.
  const int64_t shard_grad_bytes = [&] {
    int64_t b = 0;
    for (const auto& s : shard_tensors_) b += bytes_of(s);
    return b;
  }();
  if (offload_) {
    mem_.host_bytes += shard_grad_bytes;
  } else {
    track(mem_.grad_bytes, mem_.grad_peak_bytes, shard_grad_bytes);
  }
  return shard_optimizer_;
}

bool ShardedModel::contains(const torch::Tensor& tensor) const {
  for (const auto& p : params_) {
    if (p.tensor.unsafeGetTensorImpl() == tensor.unsafeGetTensorImpl()) return true;
  }
  return false;
}

void ShardedModel::sync_hyperparameters() {
  if (!user_optimizer_ || !shard_optimizer_) return;
  for (size_t g = 0; g < unit_group_.size(); ++g) {
    const auto& from = static_cast<const torch::optim::AdamWOptions&>(
        user_optimizer_->param_groups()[unit_group_[g]].options());
    auto& to =
        static_cast<torch::optim::AdamWOptions&>(shard_optimizer_->param_groups()[g].options());
    to.lr(from.lr());
    to.betas(from.betas());
    to.eps(from.eps());
    to.weight_decay(from.weight_decay());
  }
}

void ShardedModel::restore_user_hyperparameters() {
  if (!user_optimizer_ || !shard_optimizer_) return;
  for (size_t g = 0; g < unit_group_.size(); ++g) {
    const auto& from = static_cast<const torch::optim::AdamWOptions&>(
        shard_optimizer_->param_groups()[g].options());
    auto& to = static_cast<torch::optim::AdamWOptions&>(
        user_optimizer_->param_groups()[unit_group_[g]].options());
    to.lr(from.lr());
    to.betas(from.betas());
    to.eps(from.eps());
    to.weight_decay(from.weight_decay());
  }
}

void ShardedModel::after_step() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  torch::NoGradGuard no_grad;
  std::vector<distributed::PendingCollective> works;
  std::vector<torch::Tensor> sources;  // alive until the gathers are done
  for (size_t u = 0; u < units_.size(); ++u) {
    auto& unit = *units_[u];
    // Offload: the updated host shard returns to the device copy first (asynchronously from
    // pinned memory on CUDA, so unit u+1's copy overlaps unit u's gather).
    if (unit.dev_shard.defined()) unit.dev_shard.copy_(shard_tensors_[u].detach(), true);
    if (!unit.gathered) continue;  // gathered again before its next use
    sources.push_back(gather_source(u));
    works.push_back(distributed::all_gather_into_async(unit.full, sources.back(), group_));
    ++stats_.gathers;
  }
  for (auto& w : works) w.wait();
}

void ShardedModel::shards_changed() { after_step(); }

void ShardedModel::gather_full_parameters() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (full_params_depth_++ > 0) return;
  for (size_t u = 0; u < units_.size(); ++u) wait_gather(u);
}

void ShardedModel::release_full_parameters() {
  std::lock_guard<std::recursive_mutex> lock(mutex_);
  if (full_params_depth_ == 0) return;
  if (--full_params_depth_ > 0) return;
  for (size_t u = 0; u < units_.size(); ++u) free_full(u);
}

// ------------------------------------------------------------------ checkpoints and memory

std::pair<int64_t, int64_t> ShardedModel::unit_range(size_t u, int rank) const {
  const auto& unit = *units_.at(u);
  const int64_t begin = std::min(unit.numel, rank * unit.shard);
  const int64_t end = std::min(unit.numel, (rank + 1) * unit.shard);
  return {begin, end};
}

std::vector<ShardedModel::OwnedRange> ShardedModel::owned_ranges(int rank) const {
  std::vector<OwnedRange> out;
  for (const auto& p : params_) {
    const auto& unit = *units_[p.unit];
    const int64_t lo = rank * unit.shard, hi = lo + unit.shard;
    OwnedRange r;
    r.name = p.name;
    r.shape = p.tensor.sizes().vec();
    r.unit = p.unit;
    const int64_t n = p.tensor.numel();
    const int64_t b = std::max(p.offset, lo), e = std::min(p.offset + n, hi);
    if (b < e) {
      r.begin = b - p.offset;
      r.end = e - p.offset;
      r.shard_offset = b - lo;
    }
    out.push_back(std::move(r));
  }
  return out;
}

StateMemory ShardedModel::memory() const {
  StateMemory m = mem_;
  const int64_t state = shard_optimizer_ ? shard_optimizer_->state_bytes() : 0;
  (offload_ ? m.host_bytes : m.optimizer_bytes) += state;
  return m;
}

}  // namespace difftrain::accel
