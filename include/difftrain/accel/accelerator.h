#pragma once

#include "difftrain/accel/accelerated_optimizer.h"
#include "difftrain/accel/grad_sync.h"
#include "difftrain/accel/gradient_state.h"
#include "difftrain/accel/precision.h"
#include "difftrain/accel/reducer.h"
#include "difftrain/accel/sharded_model.h"
#include "difftrain/accel/sharding.h"
#include "difftrain/core/log.h"
#include "difftrain/data/data_loader.h"
#include "difftrain/distributed/collectives.h"

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>
#include <torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace difftrain::accel {

/// DDP options (Accelerate's `DistributedDataParallelKwargs`).
struct DdpOptions {
  /// Upper size of a gradient bucket in MiB (torch default 25).
  double bucket_cap_mb = 25.0;
  /// Parameters may go unused in some steps (torch `find_unused_parameters`).
  bool find_unused_parameters = false;
  /// After each synchronising backward, copy rank 0's buffers (e.g. BatchNorm running stats)
  /// to every rank, so the next forward uses them (torch broadcasts before each forward).
  bool broadcast_buffers = true;
  /// Launch bucket all-reduces during backward (true) or after it (false; benchmarks only).
  bool overlap = true;
};

/// Options of an Accelerator (Accelerate's `Accelerator(...)` arguments).
struct AcceleratorOptions {
  /// "no" | "bf16" | "fp16". Unset: DIFFTRAIN_MIXED_PRECISION (set by `difftrain launch
  /// --mixed_precision`), then ACCELERATE_MIXED_PRECISION, then "no".
  std::optional<std::string> mixed_precision;
  /// Micro-steps per optimizer update. Unset: DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS, then 1.
  std::optional<int64_t> gradient_accumulation_steps;
  /// The loader's batch size is the global batch, split across ranks (Accelerate
  /// `split_batches`); otherwise it is the per-rank batch.
  bool split_batches = false;
  /// Pad the last global batch by wrapping around so every rank gets as many batches
  /// (Accelerate `even_batches`).
  bool even_batches = true;
  /// Seeds every rank the same way at construction (Accelerate `set_seed`); unset: no seeding.
  std::optional<uint64_t> seed;
  DdpOptions ddp;
  /// Time one collective may wait for its peers (default 30 min). DIFFTRAIN_COLLECTIVE_TIMEOUT
  /// (`difftrain launch --collective_timeout`) overrides it when set.
  std::optional<std::chrono::milliseconds> collective_timeout;
  /// fp16 loss scaling (used when mixed_precision is fp16).
  GradScalerOptions scaler;
  /// Stay on the CPU even when CUDA is available (Accelerate `cpu=True`).
  bool cpu = false;
  /// Sharded training (ZeRO-1/2/3, FSDP; docs/SHARDING.md). Unset: ShardingOptions::from_env()
  /// (set by `difftrain launch`), which defaults to NO_SHARD. With one process sharding is off.
  std::optional<ShardingOptions> sharding;
};

class Accelerator;

/// RAII: every sharded model's parameters gathered for the scope (FSDP's summon_full_params);
/// nothing happens without sharding. Collective: every rank must open it.
class [[nodiscard]] FullParameters {
 public:
  explicit FullParameters(Accelerator& accelerator);
  ~FullParameters();
  FullParameters(const FullParameters&) = delete;
  FullParameters& operator=(const FullParameters&) = delete;

 private:
  Accelerator& accelerator_;
};

class Accelerator;

/// RAII guard of one micro-step (Accelerate's `with accelerator.accumulate(model):`).
/// Decides whether this micro-step synchronises gradients: every gradient_accumulation_steps-th
/// micro-step, and at the last batch of the loader's epoch. Until then backward() accumulates
/// locally with no communication, and the prepared optimizer's step()/zero_grad() do nothing.
class [[nodiscard]] AccumulateGuard {
 public:
  explicit AccumulateGuard(Accelerator& accelerator);
  /// Ends the micro-step. Non-trivial, which also keeps `auto step = acc.accumulate();` from
  /// being an unused variable.
  ~AccumulateGuard();
  AccumulateGuard(const AccumulateGuard&) = delete;
  AccumulateGuard& operator=(const AccumulateGuard&) = delete;

 private:
  Accelerator& accelerator_;
};

/// RAII: the main process runs the scope first, the others after it
/// (Accelerate's `with accelerator.main_process_first():`).
class [[nodiscard]] MainProcessFirst {
 public:
  explicit MainProcessFirst(Accelerator& accelerator);
  ~MainProcessFirst() noexcept(false);
  MainProcessFirst(const MainProcessFirst&) = delete;
  MainProcessFirst& operator=(const MainProcessFirst&) = delete;

 private:
  Accelerator& accelerator_;
};

/// Runs one single-process training loop on any number of processes (Hugging Face Accelerate's
/// `Accelerator`). Joins the job's process group (see distributed::init_process_group), picks this
/// rank's device, and prepares models, optimizers, loaders and schedulers:
///
///     accel::Accelerator acc;                                // reads `difftrain launch`'s env
///     auto [model, opt, loader] = acc.prepare(model, opt, loader);
///     for (const auto& batch : *loader) {
///       auto step = acc.accumulate();
///       torch::Tensor loss;
///       { auto autocast = acc.autocast(); loss = compute_loss(model, batch); }
///       acc.backward(loss);
///       if (acc.sync_gradients()) acc.clip_grad_norm_(model->parameters(), 1.0);
///       opt->step(); opt->zero_grad();
///     }
///
/// A prepared model is the same object (no wrapper): DDP is attached to its parameters, so
/// unwrap_model() is the identity and its forward keeps its C++ signature.
class Accelerator {
 public:
  explicit Accelerator(AcceleratorOptions options = {});
  /// On an existing process group (e.g. ranks as threads in tests) instead of the job's.
  Accelerator(AcceleratorOptions options, distributed::ProcessGroup& group);
  ~Accelerator();
  Accelerator(const Accelerator&) = delete;
  Accelerator& operator=(const Accelerator&) = delete;

  // ------------------------------------------------------------------ prepare
  /// Prepares each argument by kind and returns them in the same order (a tuple for several):
  /// a module (TORCH_MODULE holder or shared_ptr<Module>) is moved to device(), gets rank 0's
  /// parameters and buffers, and DDP on its trainable parameters; a shared_ptr to a
  /// torch::optim::Optimizer becomes a shared_ptr<AcceleratedOptimizer>; a
  /// shared_ptr<data::DataLoader> is sharded across ranks (same pointer); any other shared_ptr
  /// with a step() method is an LR scheduler and becomes a shared_ptr<AcceleratedScheduler>.
  /// Objects are prepared left to right. The device move (Module::to) keeps parameter identity,
  /// so an optimizer made before prepare() stays valid.
  template <typename... Ts>
  auto prepare(Ts... objects) {
    if constexpr (sizeof...(Ts) == 1) {
      return prepare_one(std::move(objects)...);
    } else {
      // Braced initialisation evaluates left to right: objects are prepared in argument order.
      return std::tuple<decltype(prepare_one(std::move(objects)))...>{
          prepare_one(std::move(objects))...};
    }
  }

  /// Model preparation (see prepare()); `module` is changed in place.
  void prepare_module(torch::nn::Module& module);
  std::shared_ptr<AcceleratedOptimizer> prepare_optimizer(
      std::shared_ptr<torch::optim::Optimizer> optimizer);
  std::shared_ptr<data::DataLoader> prepare_data_loader(std::shared_ptr<data::DataLoader> loader);
  /// `step` advances the wrapped scheduler by one.
  std::shared_ptr<AcceleratedScheduler> prepare_scheduler(
      std::function<void()> step, std::function<nlohmann::json()> state = nullptr,
      std::function<void(const nlohmann::json&)> load = nullptr);

  /// The model itself: prepare() attaches DDP instead of wrapping (Accelerate's unwrap_model).
  template <typename M>
  M unwrap_model(M model) const {
    return model;
  }

  // ------------------------------------------------------------------ training step
  /// `loss.backward()` for the current micro-step: divides by the accumulation window (usually
  /// gradient_accumulation_steps; fewer when the epoch ends first), multiplies by the fp16 loss
  /// scale, and on a synchronising step lets DDP all-reduce gradients during backward.
  /// Throws when this rank is in an uneven loader tail that the other ranks do not have.
  void backward(const torch::Tensor& loss);
  /// Starts a micro-step (see AccumulateGuard).
  AccumulateGuard accumulate() { return AccumulateGuard(*this); }
  /// Accelerate-style spelling; the models are not needed (every prepared model is covered).
  template <typename... Ms>
  AccumulateGuard accumulate(const Ms&...) {
    return AccumulateGuard(*this);
  }
  /// True when this micro-step's backward synchronises and the optimizer will step.
  bool sync_gradients() const { return state_->sync_gradients; }
  /// Autocast for the forward pass in the configured precision (no-op for "no").
  AutocastGuard autocast() const { return AutocastGuard(state_->mixed_precision, device_); }
  /// Waits for gradient all-reduces in flight, unscales fp16 gradients, clips the gradients of
  /// `params` to `max_norm` (total `norm_type` norm) and returns the norm before clipping. Under
  /// DDP the gradients are identical on every rank after the all-reduce, so the norm is global.
  double clip_grad_norm_(const std::vector<torch::Tensor>& params, double max_norm,
                         double norm_type = 2.0);
  /// Clamps every gradient of `params` to [-clip_value, clip_value] (after the same waiting).
  void clip_grad_value_(const std::vector<torch::Tensor>& params, double clip_value);
  /// Waits for every gradient all-reduce in flight (step() and clip_grad_norm_ do it for you).
  void wait_for_gradients() { state_->finish_reduction(); }
  /// Whether the last synchronising optimizer step was skipped (fp16 inf/NaN).
  bool optimizer_step_was_skipped() const { return state_->step_skipped; }
  /// Current fp16 loss scale (1 when not fp16).
  double loss_scale() const;

  // ------------------------------------------------------------------ processes and devices
  torch::Device device() const { return device_; }
  int process_index() const { return group_->rank(); }
  int local_process_index() const { return group_->info().local_rank; }
  int num_processes() const { return group_->size(); }
  bool is_main_process() const { return process_index() == 0; }
  bool is_local_main_process() const { return local_process_index() == 0; }
  MixedPrecision mixed_precision() const { return state_->mixed_precision; }
  int64_t gradient_accumulation_steps() const { return accumulation_steps_; }
  const AcceleratorOptions& options() const { return options_; }
  distributed::ProcessGroup& group() { return *group_; }

  /// Blocks until every rank reaches it (Accelerate's wait_for_everyone).
  void wait_for_everyone();
  /// RAII guard: main process first (see MainProcessFirst).
  MainProcessFirst main_process_first() { return MainProcessFirst(*this); }
  /// Info-level line on the main process only (Accelerate's accelerator.print).
  template <typename... Args>
  void print(fmt::format_string<Args...> format, Args&&... args) const {
    if (is_main_process()) spdlog::info(format, std::forward<Args>(args)...);
  }
  /// Warning-level line ("warning: ...") on the main process only.
  template <typename... Args>
  void warn(fmt::format_string<Args...> format, Args&&... args) const {
    if (is_main_process()) spdlog::warn(format, std::forward<Args>(args)...);
  }
  /// Seeds LibTorch's generators with `seed` (+ rank when device_specific).
  void set_seed(uint64_t seed, bool device_specific = false);

  // ------------------------------------------------------------------ collectives
  /// Every rank's `tensor` concatenated along dim 0 (Accelerate's gather).
  torch::Tensor gather(const torch::Tensor& tensor);
  /// gather() for evaluation (Accelerate's `gather_for_metrics`): when the batch being evaluated
  /// is the last of its prepared loader's epoch and the dataset does not divide into global
  /// batches, the even_batches padding (samples repeated to fill the last global batch) is
  /// dropped: the result keeps its first N % total_batch_size rows, so a metric over an epoch
  /// sees every example exactly once. Elsewhere (another batch, drop_last, no prepared loader
  /// yielded a batch) it equals gather().
  torch::Tensor gather_for_metrics(const torch::Tensor& tensor);
  /// Every rank's `items` (a JSON array of any JSON values) concatenated in rank order
  /// (Accelerate's `gather_object` of a list: all_gather_object, then flattened one level).
  /// Ranks may hold different numbers of items. Throws difftrain::Error when `items` is not an
  /// array. A world of one returns `items`.
  nlohmann::json gather_object(const nlohmann::json& items);
  /// gather_for_metrics() for objects (Accelerate's `gather_for_metrics(x,
  /// use_gather_object=True)`): gather_object(), truncated to N % total_batch_size items on the
  /// last batch of an epoch.
  nlohmann::json gather_for_metrics(const nlohmann::json& items);
  /// Sum or mean over ranks of a copy of `tensor` ("sum" | "mean"; Accelerate's reduce).
  torch::Tensor reduce(const torch::Tensor& tensor, const std::string& reduction = "sum");
  /// Rank `from`'s `tensor`, in place on every rank (Accelerate's broadcast).
  torch::Tensor broadcast(torch::Tensor tensor, int from = 0);
  /// Pads `tensor` along `dim` to the largest size over ranks with `pad_index`, at the end or
  /// at the start (Accelerate's pad_across_processes).
  torch::Tensor pad_across_processes(const torch::Tensor& tensor, int64_t dim = 0,
                                     double pad_index = 0, bool pad_first = false);
  /// This rank's contiguous part of `items` (the first ranks take one more when it does not
  /// divide); with `apply_padding` every rank gets the same count, repeating the last item
  /// (Accelerate's split_between_processes).
  template <typename T>
  std::vector<T> split_between_processes(const std::vector<T>& items,
                                         bool apply_padding = false) const {
    const auto [begin, end] = split_range(static_cast<int64_t>(items.size()));
    std::vector<T> out(items.begin() + begin, items.begin() + end);
    const int64_t longest =
        (static_cast<int64_t>(items.size()) + num_processes() - 1) / num_processes();
    if (apply_padding && !items.empty()) {
      while (static_cast<int64_t>(out.size()) < longest) out.push_back(items.back());
    }
    return out;
  }
  /// [begin, end) of this rank's share of `count` items.
  std::pair<int64_t, int64_t> split_range(int64_t count) const;

  // ------------------------------------------------------------------ checkpointable state
  /// The Accelerator's own resumable state: loss scaler, accumulation position, optimizer
  /// update counts, scheduler step counts and every prepared loader's position.
  nlohmann::json state_dict() const;
  /// Restores state_dict(). Every field is read and checked first (presence, JSON type, counts
  /// against what this run prepared, the loss scaler's presence, non-negative counters and loader
  /// positions); only then is anything applied, so an error leaves the Accelerator, its
  /// optimizers, schedulers and loaders exactly as they were. Throws difftrain::Error naming the
  /// missing or mismatched field.
  void load_state_dict(const nlohmann::json& state);

  /// Accelerate's `save_state(output_dir)`: everything needed to resume exactly, into folder
  /// `dir` (replaced atomically: written to `<dir>.tmp`, then renamed; a crash mid-save leaves
  /// the previous `dir` intact). Collective: every rank must call it.
  ///   accelerator.json                 state_dict() (scaler, counters, loader positions)
  ///   model.safetensors, model_1...    parameters and buffers of each prepared model, by name
  ///   optimizer.safetensors/.json, optimizer_1...   each prepared difftrain optimizer
  ///   scheduler.json, scheduler_1...   each prepared scheduler that has state_dict()
  ///   random_states_<rank>.safetensors this rank's CPU generator
  /// Rank 0 writes the shared files (DDP keeps them identical on every rank); each rank writes
  /// its random state. `dir` must be on a filesystem every rank sees. Optimizers must be
  /// difftrain's (optim::AdamW, optim::AdamW8bit); models must be prepared through a holder or
  /// shared_ptr.
  /// Once every rank's files are written, the main rank records them all (size, CRC32) in
  /// `checksums.json`. A failed save throws on every rank and removes `<dir>.tmp`.
  /// `extra`, when given, runs on every rank after these files are written and before the
  /// rename, with the temporary folder: what it writes there is part of the same atomic
  /// checkpoint (the trainer's EMA and step). An exception from it on any rank fails the save.
  void save_state(const std::string& dir,
                  const std::function<void(const std::string& temp_dir)>& extra = nullptr);
  /// Accelerate's `load_state(input_dir)`: restores what save_state() wrote into the prepared
  /// objects (prepare the same objects in the same order first). Names, shapes and counts are
  /// checked; a mismatch throws difftrain::Error naming the file and the tensor. A missing
  /// random state (saved with fewer ranks) is a warning. With `verify` (the default) every file
  /// is first checked against the folder's checksums.json (see verify_checkpoint()): a missing,
  /// truncated or corrupted file throws difftrain::Error naming it; a folder saved before
  /// manifests existed loads unchecked.
  void load_state(const std::string& dir, bool verify = true);

  /// The sharding in force (NO_SHARD with one process).
  const ShardingOptions& sharding() const { return sharding_; }
  /// RAII guard: full parameters of sharded models for the scope (see FullParameters). Use it
  /// around code that reads a FULL_SHARD model outside the training step (EMA, validation,
  /// export): outside it, parameters of sharded units have no memory.
  FullParameters summon_full_params() { return FullParameters(*this); }
  /// Bytes of training state on this rank (parameters, gradients, optimizer state; see
  /// StateMemory), summed over prepared models (each model's GradSync::memory(), or its
  /// parameters when it has no engine) and prepared optimizers.
  StateMemory memory() const;
  /// The gradient-sync engines of the prepared models, in prepare order: one per model with
  /// trainable parameters when there is more than one process (see GradSync).
  const std::vector<std::unique_ptr<GradSync>>& grad_syncs() const { return state_->grad_syncs; }
  /// For tests and benchmarks: the engines of grad_syncs() that are sharding engines.
  std::vector<ShardedModel*> sharded_models() const;
  /// For tests and benchmarks: the engines of grad_syncs() that are DDP reducers.
  std::vector<Reducer*> reducers() const;

 private:
  friend class AccumulateGuard;
  friend class FullParameters;
  // How prepared model / optimizer `index`'s state goes into checkpoints: its engine's
  // CheckpointState (GradSync::checkpoint_state), else the replicated one.
  CheckpointState& checkpoint_state_of_model(size_t index);
  CheckpointState& checkpoint_state_of_optimizer(size_t index);
  // Whether some engine holds gradient shards (the norm and clipping then go through GradSync).
  bool gradients_sharded() const;
  void init();
  void begin_micro_step();
  void end_micro_step();
  data::DataLoader* active_loader();

  template <typename T>
  auto prepare_one(T object) {
    if constexpr (std::is_base_of_v<torch::nn::Module, T>) {
      static_assert(!sizeof(T*), "prepare a module through its holder or a shared_ptr");
    } else if constexpr (is_module_holder<T>::value) {
      prepare_module(*object.ptr());
      return object;
    } else if constexpr (is_shared_ptr<T>::value) {
      using E = typename T::element_type;
      if constexpr (std::is_base_of_v<torch::nn::Module, E>) {
        prepare_module(*object);
        return object;
      } else if constexpr (std::is_base_of_v<torch::optim::Optimizer, E>) {
        return prepare_optimizer(std::static_pointer_cast<torch::optim::Optimizer>(object));
      } else if constexpr (std::is_same_v<data::DataLoader, E>) {
        return prepare_data_loader(object);
      } else if constexpr (has_json_state<E>::value) {
        return prepare_scheduler([object]() { object->step(); },
                                 [object]() { return object->state_dict(); },
                                 [object](const nlohmann::json& j) { object->load_state_dict(j); });
      } else {
        return prepare_scheduler([object]() { object->step(); });
      }
    } else {
      static_assert(!sizeof(T*), "prepare() takes modules, optimizers, loaders and schedulers");
    }
  }

  template <typename T, typename = void>
  struct is_module_holder : std::false_type {};
  template <typename T>
  struct is_module_holder<T, std::void_t<typename T::ContainedType>>
      : std::is_base_of<torch::nn::ModuleHolder<typename T::ContainedType>, T> {};
  template <typename T, typename = void>
  struct has_json_state : std::false_type {};
  template <typename T>
  struct has_json_state<T, std::void_t<decltype(std::declval<const T&>().state_dict().dump()),
                                       decltype(std::declval<T&>().load_state_dict(
                                           std::declval<const nlohmann::json&>()))>>
      : std::true_type {};
  template <typename T>
  struct is_shared_ptr : std::false_type {};
  template <typename T>
  struct is_shared_ptr<std::shared_ptr<T>> : std::true_type {};

  AcceleratorOptions options_;
  distributed::ProcessGroup* group_ = nullptr;
  torch::Device device_ = torch::kCPU;
  int64_t accumulation_steps_ = 1;
  ShardingOptions sharding_;
  std::shared_ptr<GradientState> state_;
  // Per prepared model: its engine in state_->grad_syncs, null when it has none (one process, or
  // a frozen model).
  std::vector<GradSync*> grad_sync_of_model_;
  // Per prepared optimizer: the sharding engine whose shard optimizer replaced it, or null.
  std::vector<GradSync*> engine_of_optimizer_;  // the engine that made optimizer i's, or null
  std::unique_ptr<CheckpointState> replicated_checkpoint_;
  std::vector<std::weak_ptr<AcceleratedOptimizer>> optimizers_;
  std::vector<std::weak_ptr<AcceleratedScheduler>> schedulers_;
  struct LoaderSeen {
    std::weak_ptr<data::DataLoader> loader;
    int64_t epoch = -1;
    int64_t position = -1;
  };
  std::vector<LoaderSeen> loaders_;
  data::DataLoader* active_ = nullptr;
  // Rows (or items) of a gathered last batch that are real examples, or -1 when nothing is to be
  // dropped: the active loader's N % total_batch_size at the end of its epoch.
  int64_t metrics_remainder();
  std::vector<torch::Tensor> buffers_;
  std::vector<const torch::nn::Module*>
      prepared_modules_;  // of prepared models, broadcast from rank 0 after sync
  std::vector<std::weak_ptr<torch::nn::Module>> models_;  // for save_state; empty if by reference
};

}  // namespace difftrain::accel
