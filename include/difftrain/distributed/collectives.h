#pragma once

#include "difftrain/distributed/process_group.h"

#include <torch/types.h>

#include <functional>
#include <string>
#include <vector>

namespace difftrain::distributed {

/// Reduction of a collective. kMean is a sum divided by the world size (floating tensors only).
enum class ReduceOp { kSum, kMean, kMax, kMin };

/// In-place all-reduce of `tensor` (any shape; identical shape and dtype on every rank).
/// torch: `dist.all_reduce(t, op)`; Accelerate: `accelerator.reduce(t, "sum" | "mean")`.
void all_reduce(torch::Tensor& tensor, ReduceOp op = ReduceOp::kSum,
                ProcessGroup& group = default_group());

/// An all-reduce in flight (torch: the Work returned by `dist.all_reduce(t, async_op=True)`).
/// wait() blocks until it is done and raises the same named errors as the synchronous calls.
/// Destroying a PendingAllReduce without wait() leaves the collective running in the backend.
class PendingAllReduce {
 public:
  PendingAllReduce() = default;
  PendingAllReduce(c10::intrusive_ptr<c10d::Work> work, ProcessGroup* group, torch::Tensor tensor,
                   ReduceOp op);
  /// True while a collective was launched and not yet waited for.
  bool pending() const { return static_cast<bool>(work_); }
  /// True when the backend reports completion (never blocks).
  bool completed() const;
  /// Blocks until done; for kMean divides by the world size. A no-op when nothing is pending.
  void wait();

 private:
  c10::intrusive_ptr<c10d::Work> work_;
  ProcessGroup* group_ = nullptr;
  torch::Tensor tensor_;
  ReduceOp op_ = ReduceOp::kSum;
};

/// Starts an in-place all-reduce of the contiguous `tensor` and returns at once; the tensor must
/// not be read or written until wait(). Collectives start in the order they are launched on every
/// rank, so every rank must launch the same sequence. In a world of one, it is already done.
PendingAllReduce all_reduce_async(torch::Tensor tensor, ReduceOp op = ReduceOp::kSum,
                                  ProcessGroup& group = default_group());

/// In-place broadcast of `tensor` from rank `root` to every rank.
/// torch: `dist.broadcast(t, src=root)`.
void broadcast(torch::Tensor& tensor, int root = 0, ProcessGroup& group = default_group());

/// Gathers `tensor` from every rank: result[r] is rank r's tensor (same shape on every rank).
/// torch: `dist.all_gather(list, t)`.
std::vector<torch::Tensor> all_gather(const torch::Tensor& tensor,
                                      ProcessGroup& group = default_group());

/// Every rank's `tensor` concatenated along dim 0: [W * N, ...] from [N, ...] per rank.
/// Accelerate: `accelerator.gather(t)`.
torch::Tensor gather_cat(const torch::Tensor& tensor, ProcessGroup& group = default_group());

/// Reduce-scatter along dim 0: `input` is [W * N, ...] on every rank; rank r receives the
/// reduction over ranks of rows [r * N, (r + 1) * N), shape [N, ...].
/// torch: `dist.reduce_scatter_tensor`. Gloo (LibTorch 1.13) has none, so on Gloo it is an
/// alltoall followed by a local reduction; on NCCL the native collective.
torch::Tensor reduce_scatter(const torch::Tensor& input, ReduceOp op = ReduceOp::kSum,
                             ProcessGroup& group = default_group());

/// An all-gather or reduce-scatter in flight whose result lands in a caller's buffer
/// (torch: the Work of `all_gather_into_tensor` / `reduce_scatter_tensor` with async_op=True).
class PendingCollective {
 public:
  PendingCollective() = default;
  /// True while launched and not yet waited for.
  bool pending() const { return static_cast<bool>(work_); }
  /// Blocks until done (then finishes the local part, e.g. the reduction of a reduce-scatter).
  /// A no-op when nothing is pending. Errors name the rank and the operation.
  void wait();

 private:
  friend PendingCollective all_gather_into_async(torch::Tensor, const torch::Tensor&,
                                                 ProcessGroup&);
  friend PendingCollective reduce_scatter_async(const torch::Tensor&, torch::Tensor, ReduceOp,
                                                ProcessGroup&);
  c10::intrusive_ptr<c10d::Work> work_;
  ProcessGroup* group_ = nullptr;
  std::string op_;
  std::vector<torch::Tensor> keep_;  // buffers the backend uses until done
  std::function<void()> finish_;     // local work after the backend is done
};

/// Starts gathering every rank's contiguous `shard` ([S]) into the contiguous `out` ([W * S]):
/// out[r*S : (r+1)*S] becomes rank r's shard. Neither may be touched until wait().
/// torch: `dist.all_gather_into_tensor(out, shard, async_op=True)`.
PendingCollective all_gather_into_async(torch::Tensor out, const torch::Tensor& shard,
                                        ProcessGroup& group = default_group());
/// Starts a reduce-scatter of the contiguous 1-D `input` ([W * S]); at wait() `out` ([S]) holds
/// this rank's chunk reduced over ranks (kSum or kMean). On Gloo an alltoall plus a local sum in
/// rank order, as reduce_scatter().
PendingCollective reduce_scatter_async(const torch::Tensor& input, torch::Tensor out,
                                       ReduceOp op = ReduceOp::kMean,
                                       ProcessGroup& group = default_group());

/// Blocks until every rank has reached it. Accelerate: `accelerator.wait_for_everyone()`.
void barrier(ProcessGroup& group = default_group());

const char* to_string(ReduceOp op);

}  // namespace difftrain::distributed
