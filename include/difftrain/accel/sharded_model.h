#pragma once
// The sharding engine behind AcceleratorOptions::sharding (ZeRO-1/2/3, PyTorch FSDP): a prepared
// model's trainable parameters, cut into wrapped units, each unit one flat buffer padded to a
// multiple of the world size, of which each rank owns a contiguous 1/N shard.

#include "difftrain/accel/grad_sync.h"
#include "difftrain/accel/sharding.h"
#include "difftrain/core/forward_hooks.h"
#include "difftrain/distributed/collectives.h"
#include "difftrain/optim/flat_optimizer.h"

#include <torch/nn/module.h>

#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

namespace difftrain::accel {

/// Counters for tests and benchmarks.
struct ShardingStats {
  int64_t gathers = 0;          ///< unit all-gathers (forward, backward, after steps)
  int64_t prefetched = 0;       ///< of those, started ahead by prefetch
  int64_t reduce_scatters = 0;  ///< gradient reduce-scatters (all-reduces for ZeRO-1)
  int64_t frees = 0;            ///< unit parameter buffers freed after use
};

/// One model under a sharding strategy. Made by Accelerator::prepare_module; see
/// docs/SHARDING.md. Every rank must construct it from the same model with the same options.
///
/// Parameters: each trainable parameter becomes a view into its unit's full flat buffer. Under
/// SHARD_OPTIMIZER and SHARD_GRAD_OP the full buffers stay; under FULL_SHARD the buffers of units
/// whose module opens a core::ForwardScope are freed outside the unit's forward and backward,
/// gathered just before (with the next unit prefetched), and freed after. Units whose module has
/// no ForwardScope, and the root unit of such a model, stay gathered.
///
/// Gradients: autograd accumulates into each unit's full flat gradient buffer; when the last
/// gradient of a unit is ready in a synchronising backward, its reduction starts (all-reduce
/// under SHARD_OPTIMIZER, reduce-scatter otherwise), overlapped with the rest of backward.
/// finish() waits and leaves this rank's gradient shard in shard_parameters()[u].grad(); under
/// SHARD_GRAD_OP / FULL_SHARD the full gradient buffers are then freed.
///
/// Offload (ShardingOptions::offload_optimizer, ZeRO-Offload): the shard parameters, their
/// gradients and the shard optimizer live in host memory (pinned on CUDA) and the optimizer steps
/// there; each finished gradient shard is copied to the host, and after the step the updated
/// shards are copied back in the parameters' dtype and gathered. Under FULL_SHARD a device copy
/// of each shard stays for the gathers, unless offload_params: then each gather copies from the
/// host. On a CPU-only build the same code runs with the CPU as the device.
///
/// The Accelerator drives it through GradSync: each rank holds its shard of the averaged
/// gradients (shards_gradients() true), make_optimizer() gives it the shard optimizer and
/// checkpoint_state() the sharded checkpoints.
class ShardedModel final : public GradSync {
 public:
  ShardedModel(torch::nn::Module& module, const ShardingOptions& options,
               distributed::ProcessGroup& group);
  ~ShardedModel() override;
  ShardedModel(const ShardedModel&) = delete;
  ShardedModel& operator=(const ShardedModel&) = delete;

  /// Whether the coming backward passes reduce (false: accumulate locally; see sync_each_batch).
  void set_sync(bool sync) override;
  /// Before `loss.backward()`: finishes a pass nobody waited for (`loss` is not needed: units
  /// that get no gradient are found at the end of backward).
  void prepare_for_backward(const torch::Tensor& loss) override;
  /// Waits for every reduction of the pass, leaves the gradient shards, frees what the strategy
  /// frees. A no-op with nothing in flight.
  void finish() override;
  /// Zeroes gradient shards and any full gradient buffer.
  void zero_grad() override;
  /// True: after finish() each rank holds its gradient shards (shard_parameters()[u].grad()).
  bool shards_gradients() const override { return true; }
  ShardedModel* sharded_model() override { return this; }
  /// Sharded checkpoints: every rank writes the shards it owns, rank 0 the index; they load
  /// into any number of processes and any strategy (src/accel/sharded_checkpoint.cpp).
  CheckpointState* checkpoint_state() override;
  /// For a difftrain optimizer over this model's trainable parameters: make_shard_optimizer(),
  /// with sync_hyperparameters() before and after_step() after each step. Throws
  /// difftrain::Error for a LibTorch optimizer (its state cannot be cut into shards).
  std::optional<EngineOptimizer> make_optimizer(torch::optim::Optimizer& user) override;

  /// Replaces `user` (a difftrain optimizer over this model's trainable parameters) by an
  /// optimizer of the same type and hyperparameters over this rank's shards, and releases the
  /// user optimizer's copies. Every unit's parameters must be in one parameter group.
  std::shared_ptr<optim::FlatOptimizer> make_shard_optimizer(optim::FlatOptimizer& user);
  /// Whether `tensor` is one of this model's trainable parameters.
  bool contains(const torch::Tensor& tensor) const;
  /// Whether make_shard_optimizer() was called.
  bool has_shard_optimizer() const { return static_cast<bool>(shard_optimizer_); }
  /// Before the shard optimizer steps: copies the user optimizer's current hyperparameters (the
  /// LR schedule writes them there).
  void sync_hyperparameters();
  /// The other way (after loading the shard optimizer's state): the user optimizer gets the
  /// saved hyperparameters, as loading an unsharded optimizer's state gives them to it.
  void restore_user_hyperparameters();
  /// After the shard optimizer stepped: gathers the updated shards into the full buffers that
  /// stay resident.
  void after_step();

  /// Sum of |g|^norm_type (max |g| for inf) over this rank's gradient shards, for a global norm.
  double grad_norm_part(double norm_type) const override;
  /// Multiplies every gradient shard by `factor`.
  void scale_grads(double factor) override;
  /// Clamps every gradient shard to [-v, v].
  void clamp_grads(double v) override;

  /// Gathers every unit (collective) and keeps them gathered until release_full_parameters():
  /// for code that reads the whole model (EMA, validation, export). Nested calls count.
  void gather_full_parameters() override;
  void release_full_parameters() override;

  /// The shard parameters (one per unit, [S_u]; the shard optimizer's parameters).
  const std::vector<torch::Tensor>& shard_parameters() const { return shard_tensors_; }
  /// Units in order, as planned.
  const std::vector<UnitPlan>& units() const { return plans_; }
  ShardingStrategy strategy() const { return options_.strategy; }
  int world_size() const { return world_; }
  int rank() const { return rank_; }

  // ---- checkpoint support: per-parameter element ranges of this rank's shards
  /// One trainable parameter's slice that this rank owns: elements [begin, end) of the flattened
  /// parameter are shard elements [shard_offset, shard_offset + end - begin) of unit `unit`.
  struct OwnedRange {
    std::string name;
    std::vector<int64_t> shape;
    size_t unit = 0;
    int64_t begin = 0, end = 0, shard_offset = 0;
  };
  /// Every trainable parameter's owned range on rank `rank` (possibly empty: begin == end).
  std::vector<OwnedRange> owned_ranges(int rank) const;
  /// The unit's element range [begin, end) of its flat numbering that rank `rank` owns (clipped
  /// to the unit's numel, so padding excluded).
  std::pair<int64_t, int64_t> unit_range(size_t unit, int rank) const;
  /// After shards were overwritten (load): re-gathers resident full buffers.
  void shards_changed();

  /// Bytes held on this rank (optimizer_bytes: the shard optimizer's state).
  StateMemory memory() const override;
  const ShardingStats& stats() const { return stats_; }

 private:
  struct Unit;
  struct Param;
  class Hooks;
  friend class Hooks;

  void before_forward(size_t u);
  void after_forward(size_t u, std::vector<torch::Tensor>& outputs);
  void pre_backward(size_t u);
  void on_grad_ready(size_t p);
  void on_backward_end();
  void unit_done(size_t u);
  void finalize_reduction(size_t u);
  void gather(size_t u, bool async);
  void wait_gather(size_t u);
  void free_full(size_t u);
  void ensure_grad_buffer(size_t u);
  void bind_grads(size_t u);
  void free_grad_buffer(size_t u);
  void prefetch_after(size_t u, bool backward);
  torch::Tensor gather_source(size_t u);
  torch::Tensor host_copy(const torch::Tensor& t) const;
  bool reducing() const { return sync_ || options_.sync_each_batch; }
  void track(int64_t& current, int64_t& peak, int64_t delta);

  torch::nn::Module& module_;
  ShardingOptions options_;
  distributed::ProcessGroup& group_;
  std::unique_ptr<CheckpointState> checkpoint_;  // made on first use
  int world_ = 1;
  int rank_ = 0;
  std::vector<UnitPlan> plans_;
  std::vector<std::unique_ptr<Unit>> units_;
  std::vector<Param> params_;
  std::vector<torch::Tensor> shard_tensors_;
  std::shared_ptr<Hooks> hooks_;
  std::vector<const torch::nn::Module*> hooked_modules_;
  std::shared_ptr<optim::FlatOptimizer> shard_optimizer_;
  optim::FlatOptimizer* user_optimizer_ = nullptr;
  std::vector<size_t> unit_group_;  // user optimizer group of each unit

  bool sync_ = true;
  bool pass_active_ = false;
  bool in_backward_ = false;
  bool callback_queued_ = false;
  int full_params_depth_ = 0;
  std::vector<size_t> forward_order_, last_forward_order_;
  static constexpr size_t kInFlight = 2;
  std::deque<size_t> in_flight_;  // units whose reduction runs, oldest first
  bool offload_ = false;          // master shards, gradients and optimizer state on the host
  bool offload_params_ = false;   // FULL_SHARD: no device copy of the shards either
  StateMemory mem_;
  ShardingStats stats_;
  std::recursive_mutex mutex_;
};

}  // namespace difftrain::accel
