#include "difftrain/accel/accelerator.h"

#include "difftrain/core/error.h"
#include "difftrain/optim/flat_optimizer.h"

#include <torch/cuda.h>
#include <torch/nn/utils/clip_grad.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <cstdlib>
#include <exception>
#include <map>
#include <optional>

namespace difftrain::accel {

namespace {

std::optional<std::string> env_value(const char* name) {
  const char* value = std::getenv(name);
  if (value == nullptr || *value == '\0') return std::nullopt;
  return std::string(value);
}

int64_t parse_accumulation(const std::string& text, const char* source) {
  char* end = nullptr;
  const long long value = std::strtoll(text.c_str(), &end, 10);
  if (end == text.c_str() || *end != '\0' || value < 1) {
    throw Error(fmt::format("{}='{}' is not a positive number of gradient accumulation steps",
                            source, text));
  }
  return value;
}

// Rank 0's values of `tensors`, in place on every rank: one broadcast per dtype and device.
void broadcast_coalesced(const std::vector<torch::Tensor>& tensors,
                         distributed::ProcessGroup& group) {
  if (group.size() == 1 || tensors.empty()) return;
  torch::NoGradGuard no_grad;
  std::map<std::string, std::vector<torch::Tensor>> by_kind;
  for (const auto& t : tensors) {
    by_kind[std::string(c10::toString(t.scalar_type())) + "@" + t.device().str()].push_back(t);
  }
  for (auto& [kind, list] : by_kind) {
    std::vector<torch::Tensor> flat_parts;
    for (const auto& t : list) flat_parts.push_back(t.detach().reshape({-1}));
    auto flat = torch::cat(flat_parts);
    distributed::broadcast(flat, 0, group);
    int64_t offset = 0;
    for (auto& t : list) {
      t.detach().copy_(flat.narrow(0, offset, t.numel()).view(t.sizes()));
      offset += t.numel();
    }
  }
}

}  // namespace

// ------------------------------------------------------------------ guards

AccumulateGuard::AccumulateGuard(Accelerator& accelerator) : accelerator_(accelerator) {
  accelerator_.begin_micro_step();
}

AccumulateGuard::~AccumulateGuard() { accelerator_.end_micro_step(); }

FullParameters::FullParameters(Accelerator& accelerator) : accelerator_(accelerator) {
  accelerator_.state_->finish_reduction();
  for (auto& g : accelerator_.state_->grad_syncs) g->gather_full_parameters();
}

FullParameters::~FullParameters() {
  for (auto& g : accelerator_.state_->grad_syncs) g->release_full_parameters();
}

MainProcessFirst::MainProcessFirst(Accelerator& accelerator) : accelerator_(accelerator) {
  if (!accelerator_.is_main_process()) accelerator_.wait_for_everyone();
}

MainProcessFirst::~MainProcessFirst() noexcept(false) {
  // While unwinding an exception, do not block the other ranks' release or throw again.
  if (std::uncaught_exceptions() > 0) return;
  if (accelerator_.is_main_process()) accelerator_.wait_for_everyone();
}

// ------------------------------------------------------------------ construction

Accelerator::Accelerator(AcceleratorOptions options) : options_(std::move(options)) {
  distributed::ProcessGroupOptions pg;
  if (options_.collective_timeout) pg.collective_timeout = *options_.collective_timeout;
  group_ = &distributed::init_process_group(pg);
  init();
}

Accelerator::Accelerator(AcceleratorOptions options, distributed::ProcessGroup& group)
    : options_(std::move(options)), group_(&group) {
  init();
}

Accelerator::~Accelerator() = default;

void Accelerator::init() {
  std::string precision = "no";
  if (options_.mixed_precision) {
    precision = *options_.mixed_precision;
  } else if (auto v = env_value("DIFFTRAIN_MIXED_PRECISION")) {
    precision = *v;
  } else if (auto a = env_value("ACCELERATE_MIXED_PRECISION")) {
    precision = *a;
  }
  state_ = std::make_shared<GradientState>();
  state_->mixed_precision = parse_mixed_precision(precision);

  if (options_.gradient_accumulation_steps) {
    accumulation_steps_ = *options_.gradient_accumulation_steps;
    if (accumulation_steps_ < 1) {
      throw Error(
          fmt::format("gradient_accumulation_steps must be >= 1, got {}", accumulation_steps_));
    }
  } else if (auto v = env_value("DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS")) {
    accumulation_steps_ = parse_accumulation(*v, "DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS");
  }
  state_->window = accumulation_steps_;

  if (!options_.cpu && torch::cuda::is_available()) {
    const int local = group_->info().local_rank;
    device_ = torch::Device(torch::kCUDA,
                            static_cast<c10::DeviceIndex>(local % torch::cuda::device_count()));
  }
  install_autocast_fixes();  // checks LibTorch's CPU convolutions first
  if (state_->mixed_precision == MixedPrecision::kFp16) {
    state_->scaler = std::make_unique<GradScaler>(options_.scaler, group_);
    if (device_.is_cpu()) warn_fp16_on_cpu_once();
  }
  sharding_ = options_.sharding ? *options_.sharding : ShardingOptions::from_env();
  settings::check_offload(sharding_);
  if (num_processes() == 1 && sharding_.strategy != ShardingStrategy::kNoShard) {
    if (sharding_.offload_optimizer) {
      // ZeRO-Offload on one device: the engine runs over a world of one for its host state.
      log::info("sharding: one process: {} splits nothing, but runs for the offload",
                to_string(sharding_.strategy));
    } else {
      log::info("sharding: one process, so {} has nothing to split; training unsharded",
                to_string(sharding_.strategy));
      sharding_.strategy = ShardingStrategy::kNoShard;
    }
  }
  if (options_.seed) set_seed(*options_.seed);
  log::info(
      "accelerator: {} process(es), device {}, mixed_precision {}, gradient_accumulation_steps "
      "{}, split_batches {}, even_batches {}, bucket_cap_mb {}, find_unused_parameters {}, "
      "sharding {}{}, {} intra-op thread(s) per process",
      num_processes(), device_.str(), to_string(state_->mixed_precision), accumulation_steps_,
      options_.split_batches, options_.even_batches, options_.ddp.bucket_cap_mb,
      options_.ddp.find_unused_parameters, to_string(sharding_.strategy),
      sharding_.offload_params      ? " (optimizer and parameters offloaded to the CPU)"
      : sharding_.offload_optimizer ? " (optimizer offloaded to the CPU)"
                                    : "",
      at::get_num_threads());
}

// ------------------------------------------------------------------ prepare

void Accelerator::prepare_module(torch::nn::Module& module) {
  for (const auto& reducer_module : prepared_modules_) {
    if (reducer_module == &module) {
      throw Error(
          fmt::format("module '{}' was already prepared; prepare each model once", module.name()));
    }
  }
  prepared_modules_.push_back(&module);
  try {
    models_.push_back(module.shared_from_this());
  } catch (const std::bad_weak_ptr&) {
    models_.emplace_back();  // prepared by reference: save_state() will say so
  }
  module.to(device_);
  std::vector<torch::Tensor> tensors = module.parameters();
  const auto buffers = module.buffers();
  tensors.insert(tensors.end(), buffers.begin(), buffers.end());
  broadcast_coalesced(tensors, *group_);
  buffers_.insert(buffers_.end(), buffers.begin(), buffers.end());
  grad_sync_of_model_.push_back(nullptr);

  if (num_processes() == 1 && !sharding_.offload_optimizer) return;
  std::vector<std::pair<std::string, torch::Tensor>> named;
  bool trainable = false;
  for (const auto& item : module.named_parameters()) {
    named.emplace_back(item.key(), item.value());
    trainable = trainable || item.value().requires_grad();
  }
  if (!trainable) return;  // a frozen model: nothing to reduce
  // The one place that picks the engine; everything after goes through GradSync.
  std::unique_ptr<GradSync> engine;
  if (sharding_.strategy != ShardingStrategy::kNoShard) {
    engine = std::make_unique<ShardedModel>(module, sharding_, *group_);
  } else {
    ReducerOptions ropts;
    ropts.bucket_cap_mb = options_.ddp.bucket_cap_mb;
    ropts.find_unused_parameters = options_.ddp.find_unused_parameters;
    ropts.overlap = options_.ddp.overlap;
    engine = std::make_unique<Reducer>(std::move(named), *group_, ropts);
  }
  engine->set_sync(state_->sync_gradients);
  grad_sync_of_model_.back() = engine.get();
  state_->grad_syncs.push_back(std::move(engine));
}

std::shared_ptr<AcceleratedOptimizer> Accelerator::prepare_optimizer(
    std::shared_ptr<torch::optim::Optimizer> optimizer) {
  if (!optimizer) throw Error("prepare() got a null optimizer");
  // An engine may step the optimizer's parameters its own way (a sharded model: an optimizer
  // over this rank's shards, which then also owns its checkpoint state).
  GradSync* engine = nullptr;
  std::optional<EngineOptimizer> made;
  for (auto& g : state_->grad_syncs) {
    made = g->make_optimizer(*optimizer);
    if (made) {
      engine = g.get();
      break;
    }
  }
  std::shared_ptr<AcceleratedOptimizer> prepared;
  if (made) {
    prepared = std::make_shared<AcceleratedOptimizer>(made->optimizer, state_);
    prepared->set_user_optimizer(optimizer);
    prepared->set_step_hooks(made->before_step, made->after_step);
  } else {
    prepared = std::make_shared<AcceleratedOptimizer>(std::move(optimizer), state_);
  }
  engine_of_optimizer_.push_back(engine);
  const auto params = prepared->parameters();
  state_->optimizer_params.insert(state_->optimizer_params.end(), params.begin(), params.end());
  ++state_->num_optimizers;
  optimizers_.push_back(prepared);
  return prepared;
}

std::shared_ptr<data::DataLoader> Accelerator::prepare_data_loader(
    std::shared_ptr<data::DataLoader> loader) {
  if (!loader) throw Error("prepare() got a null data loader");
  data::ShardOptions shard;
  shard.rank = process_index();
  shard.world_size = num_processes();
  shard.even_batches = options_.even_batches;
  shard.split_batches = options_.split_batches;
  shard.device = device_;
  loader->shard(shard);
  loaders_.push_back(LoaderSeen{loader});
  return loader;
}

std::shared_ptr<AcceleratedScheduler> Accelerator::prepare_scheduler(
    std::function<void()> step, std::function<nlohmann::json()> state,
    std::function<void(const nlohmann::json&)> load) {
  auto prepared = std::make_shared<AcceleratedScheduler>(std::move(step), state_, std::move(state),
                                                         std::move(load));
  schedulers_.push_back(prepared);
  return prepared;
}

// ------------------------------------------------------------------ training step

data::DataLoader* Accelerator::active_loader() {
  // The loader that yielded a batch since the last micro-step is the one being trained on.
  for (auto& seen : loaders_) {
    auto loader = seen.loader.lock();
    if (!loader) continue;
    const int64_t epoch = loader->state().epoch;
    const int64_t position = loader->position();
    if (epoch != seen.epoch || position != seen.position) {
      seen.epoch = epoch;
      seen.position = position;
      if (position > 0) active_ = loader.get();
    }
  }
  // A loader that was destroyed is never active.
  bool alive = false;
  for (auto& seen : loaders_) alive = alive || seen.loader.lock().get() == active_;
  if (!alive) active_ = nullptr;
  return active_;
}

void Accelerator::begin_micro_step() {
  auto* loader = active_loader();
  if (state_->sync_gradients && state_->micro_step > 0) state_->micro_step = 0;
  ++state_->micro_step;
  // Ranks agree on the window: it is computed from the batch count every rank has.
  const int64_t common = loader ? loader->common_size() : 0;
  const int64_t position = loader ? loader->position() : 0;
  if (state_->micro_step == 1) {
    state_->window = accumulation_steps_;
    if (loader && position <= common) {
      state_->window = std::min(accumulation_steps_, std::max<int64_t>(1, common - position + 1));
    }
  }
  const bool end_of_data = loader && position >= common;
  state_->sync_gradients = state_->micro_step >= state_->window || end_of_data;
  for (auto& g : state_->grad_syncs) g->set_sync(state_->sync_gradients);
}

void Accelerator::end_micro_step() {}

void Accelerator::backward(const torch::Tensor& loss) {
  if (!loss.defined()) throw Error("backward() got an undefined loss tensor");
  active_loader();
  if (active_ && active_->in_uneven_tail()) {
    throw Error(fmt::format(
        "{}: this rank has batch {} of its loader but other ranks have only {} (even_batches is "
        "false and the data does not divide evenly); DDP needs the same number of backward "
        "passes on every rank: set even_batches=true (the default) or drop_last=true",
        group_->describe(), active_->position(), active_->common_size()));
  }
  state_->update_scaler();
  torch::Tensor scaled = loss;
  if (state_->window > 1) scaled = scaled / static_cast<double>(state_->window);
  if (state_->scaler) scaled = state_->scaler->scale(scaled);
  for (auto& g : state_->grad_syncs) g->prepare_for_backward(scaled);
  {
    AutocastDisabledGuard no_autocast;
    scaled.backward();
  }
  if (state_->sync_gradients && options_.ddp.broadcast_buffers && num_processes() > 1 &&
      !buffers_.empty()) {
    broadcast_coalesced(buffers_, *group_);
  }
}

double Accelerator::clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm,
                                    double norm_type) {
  state_->finish_reduction();
  if (state_->scaler && state_->sync_gradients) {
    state_->update_scaler();
    state_->scaler->unscale_(state_->optimizer_params.empty() ? params : state_->optimizer_params);
  }
  // Whole gradients, identical on every rank (DDP, one process): torch's clip over the caller's
  // parameters is already the global norm.
  if (!gradients_sharded()) return torch::nn::utils::clip_grad_norm_(params, max_norm, norm_type);
  // Gradient shards: the global norm is a reduction of every rank's part, and the clip
  // coefficient applies to what each engine holds.
  const bool inf = std::isinf(norm_type);
  double part = 0;
  for (const auto& g : state_->grad_syncs) {
    const double p = g->grad_norm_part(norm_type);
    part = inf ? std::max(part, p) : part + p;
  }
  auto total = torch::tensor({part}, torch::kDouble);
  distributed::all_reduce(total, inf ? distributed::ReduceOp::kMax : distributed::ReduceOp::kSum,
                          *group_);
  const double norm = inf ? total.item<double>() : std::pow(total.item<double>(), 1.0 / norm_type);
  const double coef = max_norm / (norm + 1e-6);
  if (coef < 1.0) {
    for (auto& g : state_->grad_syncs) g->scale_grads(coef);
  }
  return norm;
}

void Accelerator::clip_grad_value_(const std::vector<torch::Tensor>& params, double clip_value) {
  state_->finish_reduction();
  if (state_->scaler && state_->sync_gradients) {
    state_->update_scaler();
    state_->scaler->unscale_(state_->optimizer_params.empty() ? params : state_->optimizer_params);
  }
  if (!gradients_sharded()) {
    torch::nn::utils::clip_grad_value_(params, clip_value);
    return;
  }
  for (auto& g : state_->grad_syncs) g->clamp_grads(clip_value);
}

double Accelerator::loss_scale() const {
  if (!state_->scaler) return 1.0;
  state_->update_scaler();
  return state_->scaler->get_scale();
}

// ------------------------------------------------------------------ processes

bool Accelerator::gradients_sharded() const {
  for (const auto& g : state_->grad_syncs) {
    if (g->shards_gradients()) return true;
  }
  return false;
}

std::vector<ShardedModel*> Accelerator::sharded_models() const {
  std::vector<ShardedModel*> out;
  for (const auto& g : state_->grad_syncs) {
    if (auto* s = g->sharded_model()) out.push_back(s);
  }
  return out;
}

std::vector<Reducer*> Accelerator::reducers() const {
  std::vector<Reducer*> out;
  for (const auto& g : state_->grad_syncs) {
    if (auto* r = dynamic_cast<Reducer*>(g.get())) out.push_back(r);
  }
  return out;
}

StateMemory Accelerator::memory() const {
  StateMemory m;
  for (size_t i = 0; i < prepared_modules_.size(); ++i) {
    GradSync* engine = i < grad_sync_of_model_.size() ? grad_sync_of_model_[i] : nullptr;
    const StateMemory e =
        engine ? engine->memory() : replicated_memory(prepared_modules_[i]->parameters());
    m.param_bytes += e.param_bytes;
    m.param_peak_bytes += e.param_peak_bytes;
    m.grad_bytes += e.grad_bytes;
    m.grad_peak_bytes += e.grad_peak_bytes;
    m.frozen_param_bytes += e.frozen_param_bytes;
    m.host_bytes += e.host_bytes;  // offload: the engine counts its optimizer's state here
    // Optimizer state is counted once below, from the prepared optimizers.
  }
  m.param_peak_bytes = std::max(m.param_peak_bytes, m.param_bytes);
  m.grad_peak_bytes = std::max(m.grad_peak_bytes, m.grad_bytes);
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    auto o = optimizers_[i].lock();
    if (!o) continue;
    GradSync* engine = i < engine_of_optimizer_.size() ? engine_of_optimizer_[i] : nullptr;
    if (engine != nullptr && engine->sharded_model() != nullptr && sharding_.offload_optimizer) {
      continue;  // in the engine's host_bytes
    }
    if (auto* flat = dynamic_cast<optim::FlatOptimizer*>(&o->optimizer())) {
      m.optimizer_bytes += flat->state_bytes();
    }
  }
  return m;
}

void Accelerator::wait_for_everyone() { distributed::barrier(*group_); }

void Accelerator::set_seed(uint64_t seed, bool device_specific) {
  const uint64_t value = seed + (device_specific ? static_cast<uint64_t>(process_index()) : 0);
  torch::manual_seed(value);
  std::srand(static_cast<unsigned>(value));
}

std::pair<int64_t, int64_t> Accelerator::split_range(int64_t count) const {
  const int64_t world = num_processes();
  const int64_t rank = process_index();
  const int64_t base = count / world;
  const int64_t extra = count % world;
  const int64_t begin = rank * base + std::min(rank, extra);
  return {begin, begin + base + (rank < extra ? 1 : 0)};
}

// ------------------------------------------------------------------ collectives

torch::Tensor Accelerator::gather(const torch::Tensor& tensor) {
  const torch::Tensor rows = tensor.dim() == 0 ? tensor.reshape({1}) : tensor.contiguous();
  if (num_processes() == 1) return rows;
  return distributed::gather_cat(rows, *group_);
}

int64_t Accelerator::metrics_remainder() {
  data::DataLoader* loader = active_loader();
  if (!loader || !loader->end_of_epoch() || loader->options().drop_last) return -1;
  const int64_t remainder = loader->dataset()->size() % loader->total_batch_size();
  return remainder > 0 ? remainder : -1;
}

torch::Tensor Accelerator::gather_for_metrics(const torch::Tensor& tensor) {
  torch::Tensor data = gather(tensor);
  const int64_t remainder = metrics_remainder();
  if (remainder < 0 || data.size(0) <= remainder) return data;
  return data.narrow(0, 0, remainder);
}

nlohmann::json Accelerator::gather_object(const nlohmann::json& items) {
  if (!items.is_array()) {
    throw Error(
        fmt::format("gather_object needs a JSON array of items, got a JSON {}; wrap a "
                    "single value as [value]",
                    items.type_name()));
  }
  if (num_processes() == 1) return items;
  // Two gathers: every rank's byte count, then the CBOR bytes padded to the longest.
  const std::vector<uint8_t> bytes = nlohmann::json::to_cbor(items);
  const torch::Tensor sizes =
      gather(torch::tensor({static_cast<int64_t>(bytes.size())}, torch::kLong));
  const int64_t longest = sizes.max().item<int64_t>();
  torch::Tensor mine = torch::zeros({longest}, torch::kUInt8);
  std::copy(bytes.begin(), bytes.end(), mine.data_ptr<uint8_t>());
  const torch::Tensor all = gather(mine.to(device_)).to(torch::kCPU).contiguous();
  nlohmann::json out = nlohmann::json::array();
  const uint8_t* base = all.data_ptr<uint8_t>();
  for (int64_t r = 0; r < num_processes(); ++r) {
    const uint8_t* begin = base + r * longest;
    const nlohmann::json part = nlohmann::json::from_cbor(begin, begin + sizes[r].item<int64_t>());
    for (const auto& item : part) out.push_back(item);
  }
  return out;
}

nlohmann::json Accelerator::gather_for_metrics(const nlohmann::json& items) {
  nlohmann::json data = gather_object(items);
  const int64_t remainder = metrics_remainder();
  if (remainder < 0 || static_cast<int64_t>(data.size()) <= remainder) return data;
  return nlohmann::json(data.begin(), data.begin() + remainder);
}

torch::Tensor Accelerator::reduce(const torch::Tensor& tensor, const std::string& reduction) {
  distributed::ReduceOp op;
  if (reduction == "sum") {
    op = distributed::ReduceOp::kSum;
  } else if (reduction == "mean") {
    op = distributed::ReduceOp::kMean;
  } else {
    throw Error(fmt::format("reduce(): reduction '{}' is not one of sum, mean", reduction));
  }
  torch::Tensor out = tensor.clone();
  distributed::all_reduce(out, op, *group_);
  return out;
}

torch::Tensor Accelerator::broadcast(torch::Tensor tensor, int from) {
  distributed::broadcast(tensor, from, *group_);
  return tensor;
}

torch::Tensor Accelerator::pad_across_processes(const torch::Tensor& tensor, int64_t dim,
                                                double pad_index, bool pad_first) {
  if (tensor.dim() == 0) return tensor;
  const int64_t d = dim < 0 ? dim + tensor.dim() : dim;
  if (d < 0 || d >= tensor.dim()) {
    throw Error(fmt::format("pad_across_processes: dim {} is out of range for a {}-d tensor", dim,
                            tensor.dim()));
  }
  auto size = torch::tensor({tensor.size(d)}, torch::kInt64);
  distributed::all_reduce(size, distributed::ReduceOp::kMax, *group_);
  const int64_t longest = size.item<int64_t>();
  if (longest == tensor.size(d)) return tensor;
  auto shape = tensor.sizes().vec();
  shape[static_cast<size_t>(d)] = longest;
  auto out = torch::full(shape, pad_index, tensor.options());
  const int64_t start = pad_first ? longest - tensor.size(d) : 0;
  out.narrow(d, start, tensor.size(d)).copy_(tensor);
  return out;
}

// ------------------------------------------------------------------ state

nlohmann::json Accelerator::state_dict() const {
  nlohmann::json j;
  j["version"] = 1;
  j["micro_step"] = state_->micro_step;
  j["window"] = state_->window;
  j["sync_gradients"] = state_->sync_gradients;
  j["optimizer_updates"] = state_->optimizer_updates;
  j["step_skipped"] = state_->step_skipped;
  if (state_->scaler) {
    state_->update_scaler();
    const auto s = state_->scaler->state();
    j["scaler"] = {{"scale", s.scale}, {"growth_tracker", s.growth_tracker}};
  } else {
    j["scaler"] = nullptr;
  }
  j["optimizers"] = nlohmann::json::array();
  for (const auto& w : optimizers_) {
    auto o = w.lock();
    j["optimizers"].push_back(o ? o->num_updates() : 0);
  }
  j["schedulers"] = nlohmann::json::array();
  for (const auto& w : schedulers_) {
    auto s = w.lock();
    j["schedulers"].push_back(s ? s->steps() : 0);
  }
  j["loaders"] = nlohmann::json::array();
  for (const auto& seen : loaders_) {
    auto l = seen.loader.lock();
    const auto st = l ? l->state() : data::LoaderState{};
    // The position also in samples of the epoch's global order, which a run on another world
    // size (the same global batch in other per-rank batches or accumulation) resumes from.
    const int64_t global = l ? l->total_batch_size() : 0;
    j["loaders"].push_back({{"epoch", st.epoch},
                            {"batches_consumed", st.batches_consumed},
                            {"samples_consumed", st.batches_consumed * global},
                            {"total_batch_size", global}});
  }
  return j;
}

void Accelerator::load_state_dict(const nlohmann::json& j) {
  // Phase 1: read and check everything into locals; nothing is touched until all of it is good.
  struct Parsed {
    int64_t micro_step = 0, window = 1, optimizer_updates = 0;
    bool sync_gradients = true, step_skipped = false;
    std::optional<GradScalerState> scaler;
    std::vector<int64_t> optimizers, schedulers;
    std::vector<data::LoaderState> loaders;
  } p;
  if (!j.is_object()) {
    throw Error(
        fmt::format("accelerator state must be a JSON object written by state_dict(), got "
                    "a JSON {}",
                    j.type_name()));
  }
  auto need = [&](const char* key) -> const nlohmann::json& {
    if (!j.contains(key)) {
      throw Error(
          fmt::format("accelerator state has no '{}': was it written by state_dict()?", key));
    }
    return j.at(key);
  };
  auto count = [&](const nlohmann::json& v, const std::string& key, int64_t min) {
    if (!v.is_number_integer() || v.get<int64_t>() < min) {
      throw Error(fmt::format("accelerator state: '{}' is {}; expected an integer >= {}", key,
                              v.dump(), min));
    }
    return v.get<int64_t>();
  };
  auto flag = [&](const char* key) {
    const auto& v = need(key);
    if (!v.is_boolean()) {
      throw Error(
          fmt::format("accelerator state: '{}' is {}; expected true or false", key, v.dump()));
    }
    return v.get<bool>();
  };
  auto list = [&](const char* key, size_t have) -> const nlohmann::json& {
    const auto& v = need(key);
    if (!v.is_array() || v.size() != have) {
      throw Error(fmt::format(
          "accelerator state has {} {} but this run prepared {}; prepare the same objects in "
          "the same order before loading",
          v.is_array() ? std::to_string(v.size()) : v.dump(), key, have));
    }
    return v;
  };
  p.micro_step = count(need("micro_step"), "micro_step", 0);
  p.window = count(need("window"), "window", 1);
  p.sync_gradients = flag("sync_gradients");
  p.optimizer_updates = count(need("optimizer_updates"), "optimizer_updates", 0);
  p.step_skipped = flag("step_skipped");
  const auto& scaler = need("scaler");
  if (state_->scaler) {
    if (!scaler.is_object()) {
      throw Error("accelerator state has no loss scaler but this run uses fp16");
    }
    if (!scaler.contains("scale") || !scaler.at("scale").is_number() ||
        !(scaler.at("scale").get<double>() > 0) || !scaler.contains("growth_tracker")) {
      throw Error(
          fmt::format("accelerator state: the loss scaler {} needs a positive 'scale' and "
                      "a 'growth_tracker'",
                      scaler.dump()));
    }
    GradScalerState s;
    s.scale = scaler.at("scale").get<double>();
    s.growth_tracker = count(scaler.at("growth_tracker"), "scaler.growth_tracker", 0);
    p.scaler = s;
  }
  const auto& optimizers = list("optimizers", optimizers_.size());
  for (size_t i = 0; i < optimizers.size(); ++i) {
    p.optimizers.push_back(count(optimizers[i], "optimizers[" + std::to_string(i) + "]", 0));
  }
  const auto& schedulers = list("schedulers", schedulers_.size());
  for (size_t i = 0; i < schedulers.size(); ++i) {
    p.schedulers.push_back(count(schedulers[i], "schedulers[" + std::to_string(i) + "]", 0));
  }
  const auto& loaders = list("loaders", loaders_.size());
  for (size_t i = 0; i < loaders.size(); ++i) {
    const std::string key = "loaders[" + std::to_string(i) + "]";
    const auto& l = loaders[i];
    if (!l.is_object() || !l.contains("epoch") || !l.contains("batches_consumed")) {
      throw Error(
          fmt::format("accelerator state: '{}' is {}; expected {{\"epoch\": e, "
                      "\"batches_consumed\": n}}",
                      key, l.dump()));
    }
    data::LoaderState st{count(l.at("epoch"), key + ".epoch", 0),
                         count(l.at("batches_consumed"), key + ".batches_consumed", 0)};
    auto loader = i < loaders_.size() ? loaders_[i].loader.lock() : nullptr;
    if (l.contains("samples_consumed") && loader) {
      // Resume at the same sample of the global order, whatever the batches per rank now.
      const int64_t samples = count(l.at("samples_consumed"), key + ".samples_consumed", 0);
      const int64_t global = loader->total_batch_size();
      st.batches_consumed = samples / global;
      if (samples % global != 0 && is_main_process()) {
        spdlog::warn(
            "the checkpoint stopped at sample {} of epoch {}, not a multiple of this run's global "
            "batch {}: resuming at sample {} (the run will not match an uninterrupted one "
            "exactly)",
            samples, st.epoch, global, st.batches_consumed * global);
      }
    }
    p.loaders.push_back(st);
  }

  // Phase 2: apply.
  state_->micro_step = p.micro_step;
  state_->window = p.window;
  state_->sync_gradients = p.sync_gradients;
  state_->optimizer_updates = p.optimizer_updates;
  state_->step_skipped = p.step_skipped;
  if (p.scaler) {
    state_->scaler->load_state(*p.scaler);
    state_->scaler_updated = true;
  }
  for (size_t i = 0; i < optimizers_.size(); ++i) {
    if (auto o = optimizers_[i].lock()) o->set_num_updates(p.optimizers[i]);
  }
  for (size_t i = 0; i < schedulers_.size(); ++i) {
    if (auto s = schedulers_[i].lock()) s->restore(p.schedulers[i], state_->optimizer_updates);
  }
  for (size_t i = 0; i < loaders_.size(); ++i) {
    if (auto l = loaders_[i].loader.lock()) {
      l->load_state(p.loaders[i]);
      loaders_[i].epoch = -1;
      loaders_[i].position = -1;
    }
  }
  for (auto& g : state_->grad_syncs) g->set_sync(state_->sync_gradients);
}

}  // namespace difftrain::accel
