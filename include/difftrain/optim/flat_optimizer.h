#pragma once
// The flat parameter layout shared by difftrain's optimizers (AdamW, AdamW8bit): each parameter
// group's parameters of one dtype and device live in one contiguous buffer, their gradients in
// another, and optimizer state is laid out the same way, so one vectorised pass updates a whole
// bucket and a sharded optimizer can cut a bucket into per-rank ranges.

#include "difftrain/io/safetensors.h"

#include <torch/optim/adamw.h>
#include <torch/optim/optimizer.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace difftrain::optim {

/// The parameters of one param group that share a dtype and device, as one flat buffer.
/// Parameter i of the bucket is `params.narrow(0, offsets[i], numel_i).view(shape_i)`, and the
/// model's parameter tensor IS that view (its storage is the bucket's).
struct FlatBucket {
  size_t group = 0;  ///< index into param_groups()
  torch::Dtype dtype = torch::kFloat32;
  torch::Device device = torch::kCPU;
  std::vector<size_t> members;   ///< indices into the group's params(), in order
  std::vector<int64_t> offsets;  ///< element offset of each member; back() == numel
  torch::Tensor params;          ///< [numel] the parameters
  torch::Tensor grads;           ///< [numel] gradient storage given to members without a grad
  int64_t numel() const { return offsets.empty() ? 0 : offsets.back(); }
};

/// Optimizer state in its on-disk form: tensors (saved as safetensors) and everything else
/// (hyperparameters, step counts, names; saved as JSON).
struct OptimizerState {
  nlohmann::json meta;
  io::TensorMap tensors;
};

/// Writes `<path_prefix>.safetensors` and `<path_prefix>.json`, each atomically.
void save_optimizer_state(const OptimizerState& state, const std::string& path_prefix);
/// Reads what save_optimizer_state() wrote; errors name the missing or malformed file.
OptimizerState load_optimizer_state(const std::string& path_prefix);

/// Base of the flat optimizers: a torch::optim::Optimizer (so it plugs into
/// Accelerator::prepare, LR schedulers and clip_grad_norm_ like any LibTorch optimizer) whose
/// parameters are flattened at construction. Every parameter group must carry
/// torch::optim::AdamWOptions (groups without options get the defaults).
class FlatOptimizer : public torch::optim::Optimizer {
 public:
  /// Names used in saved state and in errors, one per parameter in group order (e.g. from
  /// Module::named_parameters()). Default: "<group>.<index>".
  void set_parameter_names(const std::vector<std::string>& names);
  /// The name of parameter `index` of group `group`.
  const std::string& parameter_name(size_t group, size_t index) const;
  /// The flat buckets (read-only view, for sharding and tests).
  const std::vector<FlatBucket>& buckets() const { return buckets_; }
  /// Updates made to parameter `index` of group `group` (torch: `state[p]["step"]`).
  int64_t step_count(size_t group, size_t index) const { return steps_.at(group).at(index); }
  /// Bytes of optimizer state held (moments, quantisation scales; not parameters or grads).
  virtual int64_t state_bytes() const = 0;
  /// The complete state (resume is bit for bit).
  virtual OptimizerState state_dict() const = 0;
  /// Restores state_dict() output. Refuses, naming the parameter, state whose names or shapes
  /// do not match this optimizer's parameters, or that another optimizer type wrote.
  virtual void load_state_dict(const OptimizerState& state) = 0;
  /// A new optimizer of the same type and settings (min_8bit_size, ...) over `groups`, whose
  /// options must be AdamWOptions; the sharding engine builds its per-rank optimizer with it.
  virtual std::shared_ptr<FlatOptimizer> make_like(
      std::vector<torch::optim::OptimizerParamGroup> groups) const = 0;
  /// Frees the flat parameter, gradient and state buffers after another optimizer took over
  /// (prepared for sharded training). The parameters must no longer point into them; step()
  /// then throws, naming the optimizer to use instead.
  void release_storage();
  /// Frees each bucket's gradient storage that no parameter's gradient points into any more (after
  /// `zero_grad(set_to_none)` dropped them: the next backward allocates gradients as it goes,
  /// as torch's optimizers see them after `zero_grad()`; the step takes them as they come).
  void drop_unused_grad_storage();
  /// Whether release_storage() was called.
  bool released() const { return released_; }
  /// For an update that needs sums over every parameter (Prodigy's step-size estimate): under
  /// ZeRO each rank's optimizer holds one shard, and `sum` adds a float64 tensor across the ranks
  /// in place (the sharding engine sets it). Unset: this optimizer holds every parameter.
  void set_cross_shard_sum(std::function<void(torch::Tensor&)> sum) {
    cross_shard_sum_ = std::move(sum);
  }
  /// The type name ("AdamW", "AdamW8bit", "Prodigy").
  const std::string& type_name() const { return type_name_; }
  /// LibTorch archives cannot hold the flat state: these throw; use state_dict() and
  /// save_optimizer_state().
  void save(torch::serialize::OutputArchive& archive) const override;
  void load(torch::serialize::InputArchive& archive) override;

 protected:
  FlatOptimizer(std::vector<torch::optim::OptimizerParamGroup> groups,
                torch::optim::AdamWOptions defaults, const char* type_name);
  /// A member of a bucket that has a gradient this step.
  struct GradSlot {
    size_t member;       ///< index into the bucket's members
    torch::Tensor grad;  ///< contiguous (a copy when the gradient was strided)
    int64_t step;        ///< the parameter's step count, this update included
  };
  /// The start of every step(): runs `closure` with grad mode on (torch's step(closure)) and
  /// refresh_layout(); returns the closure's loss (undefined without one).
  torch::Tensor begin_step(const LossClosure& closure);
  /// The members of bucket `b` whose gradient is defined, checked (dense, the parameter's dtype
  /// and shape), with their step counts advanced. Members without a gradient are skipped and
  /// keep their count, as in torch.
  std::vector<GradSlot> take_gradients(size_t b);
  /// Checks the groups still match the layout built at construction and re-points any
  /// parameter whose storage was replaced (e.g. load_state_dict of the model) at its bucket.
  void refresh_layout();
  /// The AdamW hyperparameters of group `g`.
  torch::optim::AdamWOptions& group_options(size_t g);
  const torch::optim::AdamWOptions& group_options(size_t g) const;
  /// Shared JSON: type, param_groups (hyperparameters and parameter names), per-parameter steps.
  nlohmann::json meta_json() const;
  /// Restores what meta_json() wrote after checking type and names; returns nothing but throws
  /// difftrain::Error naming the first mismatch.
  void load_meta_json(const nlohmann::json& meta);
  /// load_meta_json(), then `verify` (which checks the tensors against the loaded steps and
  /// options); if either throws, steps and options are put back as they were and it rethrows,
  /// so a refused state leaves the optimizer unchanged.
  void load_meta_checked(const nlohmann::json& meta, const std::function<void()>& verify);
  /// Parameter `index` of group `group`'s slice of a state buffer laid out like the buckets
  /// (`buffer(b)` is bucket b's, [numel]), shaped like the parameter; undefined when that buffer
  /// is undefined or the parameter has not been updated yet.
  torch::Tensor member_state(size_t group, size_t index,
                             const std::function<torch::Tensor(size_t)>& buffer) const;
  /// Whether any member of bucket `b` has been updated (so has state to hold).
  bool bucket_has_state(size_t b) const;
  /// Throws unless `t` exists in `state` with `shape` (and `dtype`), naming parameter and key.
  const torch::Tensor& expect_tensor(const OptimizerState& state, const std::string& key,
                                     torch::IntArrayRef shape, torch::Dtype dtype) const;

  std::vector<FlatBucket> buckets_;
  std::vector<std::vector<int64_t>> steps_;      ///< [group][param]
  std::vector<std::vector<std::string>> names_;  ///< [group][param]
  std::string type_name_;
  bool released_ = false;
  std::function<void(torch::Tensor&)> cross_shard_sum_;
  /// Subclasses drop their state buffers (release_storage()).
  virtual void release_state() {}
};

}  // namespace difftrain::optim
