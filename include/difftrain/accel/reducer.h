#pragma once

#include "difftrain/accel/grad_sync.h"
#include "difftrain/distributed/collectives.h"

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::accel {

/// Options of the gradient reducer (torch: the DistributedDataParallel constructor arguments).
struct ReducerOptions {
  /// Upper size of one gradient bucket in MiB (torch DDP `bucket_cap_mb`, default 25).
  double bucket_cap_mb = 25.0;
  /// Size of the first bucket (the last layers' gradients, produced first) in MiB: small, so the
  /// first all-reduce starts early in backward (torch: `_DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB).
  double first_bucket_cap_mb = 1.0;
  /// Parameters may get no gradient in some steps (torch DDP `find_unused_parameters`). The
  /// autograd graph of each loss is searched before backward; parameters not in it count as
  /// ready at once (their gradient is reduced as it stands, zero after zero_grad).
  bool find_unused_parameters = false;
  /// Launch each bucket's all-reduce from the autograd hooks during backward (true, DDP) or all
  /// of them only after backward has finished (false; for benchmarks of what overlap hides).
  bool overlap = true;
};

/// One flat gradient bucket: gradients of consecutive parameters (in reverse registration
/// order) are views into `flat`.
struct GradBucket {
  torch::Tensor flat;                  ///< [numel] of one dtype on one device
  std::vector<size_t> params;          ///< indices into the reducer's parameter list
  std::vector<int64_t> offsets;        ///< element offset of each parameter in `flat`
  size_t pending = 0;                  ///< parameters still waiting for their gradient this pass
  bool launched = false;               ///< all-reduce started this pass
  distributed::PendingAllReduce work;  ///< the all-reduce in flight
};

/// Counters for tests and benchmarks.
struct ReducerStats {
  int64_t passes = 0;                    ///< synchronising backward passes seen
  int64_t allreduces = 0;                ///< bucket all-reduces launched in total
  int64_t launched_during_backward = 0;  ///< of those, launched from a hook before backward ended
};

/// Data-parallel gradient averaging, overlapped with backward (torch: the C++ Reducer behind
/// DistributedDataParallel; Li et al., VLDB 2020).
///
/// Trainable parameters are packed into buckets in reverse registration order (roughly the
/// order backward produces their gradients); each parameter's `.grad()` is made a view into
/// its bucket, so autograd accumulates straight into the flat buffer. A post-hook on every
/// parameter's gradient accumulator marks it ready; when the last gradient of a bucket is
/// ready, that bucket's all-reduce (mean) starts asynchronously — buckets start strictly in
/// order so every rank issues the same collective sequence. finish() waits for all of them.
/// With `set_sync(false)` (accumulation micro-steps, Accelerate's `no_sync`) hooks do nothing
/// and gradients accumulate locally. Frozen parameters (requires_grad false) are never touched.
/// The Accelerator drives it through GradSync; every rank holds every averaged gradient
/// (shards_gradients() false).
class Reducer final : public GradSync {
 public:
  /// `params` are (name, parameter) pairs in registration order; names appear in errors.
  Reducer(std::vector<std::pair<std::string, torch::Tensor>> params,
          distributed::ProcessGroup& group, ReducerOptions options = {});
  ~Reducer() override;
  Reducer(const Reducer&) = delete;
  Reducer& operator=(const Reducer&) = delete;

  /// Whether the next backward passes synchronise (false = accumulate locally, no traffic).
  void set_sync(bool sync) override;
  bool sync() const { return sync_; }

  /// Call before `loss.backward()` on a synchronising step: starts a pass and, with
  /// find_unused_parameters, marks parameters outside `loss`'s graph ready.
  void prepare_for_backward(const torch::Tensor& loss) override;

  /// Waits for every bucket of the current pass (a no-op when none is in flight). After it,
  /// every trainable parameter's gradient is the mean over ranks. Throws difftrain::Error when
  /// a collective fails or the pass is incomplete.
  void finish() override;

  /// True while a synchronising pass has started and finish() has not run.
  bool pass_in_flight() const { return pass_active_; }

  /// Sets every trainable gradient to zero in place (keeps the bucket views).
  void zero_grad() override;

  /// False: after finish() every rank holds every averaged gradient.
  bool shards_gradients() const override { return false; }
  /// Sum of |g|^norm_type (max |g| for inf) over the trainable parameters' gradients: the whole
  /// norm on every rank.
  double grad_norm_part(double norm_type) const override;
  /// Multiplies every trainable gradient by `factor` in place.
  void scale_grads(double factor) override;
  /// Clamps every trainable gradient to [-value, value] in place.
  void clamp_grads(double value) override;
  /// replicated_memory() of the parameters it was given (trainable and frozen).
  StateMemory memory() const override;

  /// Parameter names of each bucket, bucket 0 first (reduced first).
  std::vector<std::vector<std::string>> bucket_names() const;
  size_t num_buckets() const { return buckets_.size(); }
  const ReducerStats& stats() const { return stats_; }

 private:
  void start_pass();
  void on_grad_ready(size_t index);
  void mark_ready(size_t index);
  void launch_ready_buckets();
  void on_backward_end();
  void bind_grad(size_t index);
  void reset_pass();

  struct Param {
    std::string name;
    torch::Tensor tensor;
    GradReadyHook hook;
    size_t bucket = 0;
    torch::Tensor view;  // the parameter's slot in its bucket, shaped like the parameter
    bool ready = false;
  };

  distributed::ProcessGroup& group_;
  ReducerOptions options_;
  std::vector<Param> params_;
  std::vector<torch::Tensor> frozen_;  // given but not trained: only for memory()
  std::vector<GradBucket> buckets_;
  size_t next_bucket_ = 0;
  bool sync_ = true;
  bool pass_active_ = false;
  bool callback_queued_ = false;
  bool in_backward_ = false;
  ReducerStats stats_;
  std::string pass_error_;
  std::mutex mutex_;
};

}  // namespace difftrain::accel
