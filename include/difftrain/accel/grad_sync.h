#pragma once
// GradSync: the one interface behind which the Accelerator keeps its gradient-sync engines (the
// DDP Reducer and the sharded ShardedModel), and the gradient-accumulator hook both of them use.

#include <torch/csrc/autograd/function.h>
#include <torch/nn/module.h>
#include <torch/optim/optimizer.h>
#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::optim {
class FlatOptimizer;
}  // namespace difftrain::optim

namespace difftrain::accel {

class ShardedModel;

/// Bytes of training state held on this rank (what run_info.rank<r>.json's state_bytes report).
/// "Peak" values are the most held at once since construction; the others are what is held now
/// (between steps: after the optimizer step).
struct StateMemory {
  int64_t param_bytes = 0;  ///< trainable parameters (full buffers + master shards)
  int64_t param_peak_bytes = 0;
  int64_t grad_bytes = 0;  ///< gradients (full buffers + shards)
  int64_t grad_peak_bytes = 0;
  int64_t optimizer_bytes = 0;     ///< optimizer state (moments, scales)
  int64_t frozen_param_bytes = 0;  ///< parameters that do not train (replicated)
  /// ZeRO-Offload: this rank's state in host memory (fp32 master shards, their gradients, the
  /// optimizer state); the fields above then count the device's only.
  int64_t host_bytes = 0;
};

/// StateMemory of parameters that are whole on every rank (no sharding): trainable ones count as
/// parameter and gradient bytes (DDP's buckets, or the optimizer's gradient slots, hold a
/// gradient for each), the others as frozen. Peaks equal the current values; optimizer_bytes 0.
StateMemory replicated_memory(const std::vector<torch::Tensor>& params);

/// The sum over `tensors`' defined gradients of |g|^norm_type in double, in order (the largest
/// |g| when norm_type is infinite): what GradSync::grad_norm_part returns for the tensors an
/// engine holds gradients on.
double grad_norm_part_of(const std::vector<torch::Tensor>& tensors, double norm_type);

/// How one prepared model's state and its optimizer's state go into a checkpoint folder and come
/// back (Accelerator::save_state / load_state). Every rank calls every method, in the same order
/// (they may be collective). `stem` names the files ("model", "model_1", "optimizer", ...). Each
/// GradSync engine owns the one that fits how it holds the state (GradSync::checkpoint_state());
/// models without an engine use replicated_checkpoint_state().
class CheckpointState {
 public:
  virtual ~CheckpointState() = default;
  virtual void save_model(torch::nn::Module& model, const std::string& dir,
                          const std::string& stem) = 0;
  /// Throws difftrain::Error naming the file when it does not fit the model.
  virtual void load_model(torch::nn::Module& model, const std::string& dir,
                          const std::string& stem) = 0;
  virtual void save_optimizer(optim::FlatOptimizer& optimizer, const std::string& dir,
                              const std::string& stem) = 0;
  /// Throws difftrain::Error when the saved state was written by another kind of engine (e.g.
  /// sharded state for a run without sharding) or does not fit.
  virtual void load_optimizer(optim::FlatOptimizer& optimizer, const std::string& dir,
                              const std::string& stem) = 0;
};

/// The state of a model whose parameters are whole and equal on every rank (DDP, one process):
/// rank `rank` == 0 writes `<stem>.safetensors` (every parameter and buffer) and the optimizer's
/// safetensors state; every rank reads them back (a model also from a sharded checkpoint, which
/// loads into any run; sharded optimizer state is refused with what to do).
std::unique_ptr<CheckpointState> replicated_checkpoint_state(int rank);

/// What GradSync::make_optimizer() puts in place of the user's optimizer: the optimizer that
/// steps, and what to run right before and after each of its steps.
struct EngineOptimizer {
  std::shared_ptr<torch::optim::Optimizer> optimizer;
  std::function<void()> before_step, after_step;
};

/// What one prepared model's gradient synchronisation does, whatever the engine (flashlight's
/// `Reducer` add()/finalize(); torch's DDP Reducer and FSDP's FlatParamHandle): one per prepared
/// model with trainable parameters when there is more than one process. The Accelerator keeps
/// one list of them and drives every step through this interface:
///
///     set_sync(s)                 accumulate locally (false) or reduce (true) in coming backwards
///     prepare_for_backward(loss)  before loss.backward()
///     ... backward: the engine's gradient-accumulator hooks start reductions (overlap) ...
///     finish()                    wait for every reduction of the pass
///     grad_norm_part / scale_grads / clamp_grads    clipping and fp16 unscaling
///     zero_grad()                 after the optimizer step
///     memory()                    Accelerator::memory()
///     checkpoint_state()          Accelerator::save_state / load_state
///     make_optimizer(user)        Accelerator::prepare(optimizer)
///
/// Implementations: Reducer (DDP: every rank holds every averaged gradient) and ShardedModel
/// (ZeRO-1/2/3, FSDP: each rank holds its shard of them; shards_gradients() true).
class GradSync {
 public:
  virtual ~GradSync() = default;

  /// Whether the coming backward passes reduce gradients (true) or accumulate them locally with
  /// no communication (false; accumulation micro-steps, Accelerate's `no_sync`).
  virtual void set_sync(bool sync) = 0;
  /// Called before `loss.backward()` with the loss backward starts from (already scaled):
  /// finishes a previous pass nobody waited for and starts a new one. Engines that do not need
  /// the graph (sharding) ignore `loss`.
  virtual void prepare_for_backward(const torch::Tensor& loss) = 0;
  /// Waits for every reduction of the current pass and leaves the averaged gradients where the
  /// optimizer reads them. A no-op with nothing in flight. Throws difftrain::Error when a
  /// collective fails or the pass is incomplete.
  virtual void finish() = 0;
  /// Zeroes every gradient the engine holds, in place.
  virtual void zero_grad() = 0;

  /// Whether each rank holds only its shard of the averaged gradients after finish() (true:
  /// a global norm needs every rank's grad_norm_part(); the optimizer steps the shards). False:
  /// every rank holds all of them, identical, in the parameters' own `.grad()`, and a norm over
  /// those (torch's clip_grad_norm_) is already global.
  virtual bool shards_gradients() const = 0;
  /// This rank's part of a global gradient norm: the sum over the gradients the engine holds
  /// of |g|^norm_type (the largest |g| when norm_type is infinite), in double. With
  /// shards_gradients() the parts of all ranks add up (max for inf) to the global value.
  virtual double grad_norm_part(double norm_type) const = 0;
  /// Multiplies every gradient the engine holds by `factor` (the clip coefficient).
  virtual void scale_grads(double factor) = 0;
  /// Clamps every gradient the engine holds to [-value, value].
  virtual void clamp_grads(double value) = 0;

  /// Bytes this engine's model holds on this rank (parameters, gradients, frozen parameters;
  /// optimizer_bytes when it owns the optimizer state, as the shard optimizer).
  virtual StateMemory memory() const = 0;

  /// Every parameter whole on this rank until release_full_parameters() (collective; nested
  /// calls count): FSDP's summon_full_params. Without sharding parameters are always whole, so
  /// the default does nothing.
  virtual void gather_full_parameters() {}
  virtual void release_full_parameters() {}

  /// How this engine's model and optimizer state go into checkpoints; null (the default): the
  /// parameters are whole on every rank (replicated_checkpoint_state()).
  virtual CheckpointState* checkpoint_state() { return nullptr; }
  /// prepare(optimizer): the optimizer that steps in place of `user` when `user` steps this
  /// engine's parameters in a way the engine changes (the sharding engine: one over this rank's
  /// shards); nothing (the default) when `user` steps as given. Throws difftrain::Error for an
  /// optimizer the engine cannot take.
  virtual std::optional<EngineOptimizer> make_optimizer(torch::optim::Optimizer& /*user*/) {
    return std::nullopt;
  }

  /// The sharding engine, for tests and benchmarks that look at shards; null for every other
  /// engine.
  virtual ShardedModel* sharded_model() { return nullptr; }
};

/// A post-hook on a leaf parameter's gradient accumulator that calls `on_ready` each time
/// autograd has accumulated the parameter's gradient (the hook torch's DDP Reducer and FSDP put
/// there). Removed when the handle is destroyed or remove() is called. Shared by every GradSync.
class GradReadyHook {
 public:
  GradReadyHook() = default;
  /// Hooks `param`'s gradient accumulator. When `param` is not a leaf tensor that requires grad
  /// nothing is hooked and attached() is false (the caller words the error).
  GradReadyHook(const torch::Tensor& param, std::function<void()> on_ready);
  ~GradReadyHook() { remove(); }
  GradReadyHook(GradReadyHook&& other) noexcept;
  GradReadyHook& operator=(GradReadyHook&& other) noexcept;
  GradReadyHook(const GradReadyHook&) = delete;
  GradReadyHook& operator=(const GradReadyHook&) = delete;

  bool attached() const { return static_cast<bool>(accumulator_); }
  /// The hooked gradient accumulator (null when not attached): backward reaches the parameter
  /// through this node, so a graph search for it finds the parameters a loss uses.
  const torch::autograd::Node* accumulator() const { return accumulator_.get(); }
  void remove();

 private:
  std::shared_ptr<torch::autograd::Node> accumulator_;  // kept alive so the hook stays
  uintptr_t key_ = 0;
};

/// Runs `callback` once the running backward pass has finished (autograd's queue_callback):
/// where an engine checks for parameters that got no gradient and launches what is left.
/// Call it only from inside backward (a gradient hook). From inside a gradient checkpoint's
/// nested backward it is queued on the outer pass (core/nested_backward.h).
void queue_after_backward(std::function<void()> callback);

}  // namespace difftrain::accel
