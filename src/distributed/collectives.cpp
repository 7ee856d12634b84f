#include "difftrain/distributed/collectives.h"

#include "difftrain/core/error.h"
#include "difftrain/distributed/shm_allreduce.h"

#include <fmt/format.h>

namespace difftrain::distributed {

namespace {

// Float sums and means of a group on one machine go through shared memory (ShmAllReduce).
bool uses_shm(const torch::Tensor& tensor, ReduceOp op, const ProcessGroup& group) {
  return group.shm() != nullptr && (op == ReduceOp::kSum || op == ReduceOp::kMean) &&
         ShmAllReduce::accepts(tensor);
}

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
    case ReduceOp::kMean: return c10d::ReduceOp::SUM;
    case ReduceOp::kMax: return c10d::ReduceOp::MAX;
    case ReduceOp::kMin: return c10d::ReduceOp::MIN;
  }
  return c10d::ReduceOp::SUM;
}

void check_tensor(const torch::Tensor& tensor, const ProcessGroup& group, const char* op) {
  if (!tensor.defined()) {
    throw Error(fmt::format("{}: {} got an undefined tensor", group.describe(), op));
  }
  if (tensor.is_sparse()) {
    throw Error(fmt::format("{}: {} needs a dense tensor, got a sparse one", group.describe(), op));
  }
}

void check_mean(const torch::Tensor& tensor, ReduceOp op, const ProcessGroup& group,
                const char* name) {
  if (op == ReduceOp::kMean && !tensor.is_floating_point()) {
    throw Error(fmt::format("{}: {} with mean needs a floating tensor, got {}: use sum",
                            group.describe(), name, c10::toString(tensor.scalar_type())));
  }
}

}  // namespace

const char* to_string(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
    case ReduceOp::kMin: return "min";
  }
  return "?";
}

void all_reduce(torch::Tensor& tensor, ReduceOp op, ProcessGroup& group) {
  check_tensor(tensor, group, "all_reduce");
  check_mean(tensor, op, group, "all_reduce");
  if (group.size() == 1) return;
  // Gloo needs contiguous memory; reduce a contiguous copy and write it back if we made one.
  // NCCL reduces device memory only: a host tensor (a norm, an offloaded optimizer's sums) goes
  // through a copy on the current GPU.
  torch::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  if (buffer.device().is_cpu() && group.backend_name() == "nccl") buffer = buffer.to(torch::kCUDA);
  if (uses_shm(buffer, op, group)) {
    group.wait(group.shm()->launch(buffer), std::string("all_reduce(") + to_string(op) + ")");
  } else {
    std::vector<torch::Tensor> tensors{buffer};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    group.wait(group.backend().allreduce(tensors, opts),
               std::string("all_reduce(") + to_string(op) + ")");
  }
  if (op == ReduceOp::kMean) buffer.div_(group.size());
  if (!buffer.is_same(tensor)) tensor.copy_(buffer);
}

PendingAllReduce::PendingAllReduce(c10::intrusive_ptr<c10d::Work> work, ProcessGroup* group,
                                   torch::Tensor tensor, ReduceOp op)
    : work_(std::move(work)), group_(group), tensor_(std::move(tensor)), op_(op) {}

bool PendingAllReduce::completed() const { return !work_ || work_->isCompleted(); }

void PendingAllReduce::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  work_.reset();
  group_->wait(work, std::string("all_reduce(") + to_string(op_) + ") of " +
                         std::to_string(tensor_.numel()) + " elements");
  if (op_ == ReduceOp::kMean) tensor_.div_(group_->size());
}

PendingAllReduce all_reduce_async(torch::Tensor tensor, ReduceOp op, ProcessGroup& group) {
  check_tensor(tensor, group, "all_reduce_async");
  check_mean(tensor, op, group, "all_reduce_async");
  if (!tensor.is_contiguous()) {
    throw Error(fmt::format("{}: all_reduce_async needs a contiguous tensor (a flat bucket)",
                            group.describe()));
  }
  if (group.size() == 1) return {};
  if (uses_shm(tensor, op, group)) {
    return PendingAllReduce(group.shm()->launch(tensor), &group, tensor, op);
  }
  std::vector<torch::Tensor> tensors{tensor};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  return PendingAllReduce(group.backend().allreduce(tensors, opts), &group, tensor, op);
}

void broadcast(torch::Tensor& tensor, int root, ProcessGroup& group) {
  check_tensor(tensor, group, "broadcast");
  if (root < 0 || root >= group.size()) {
    throw Error(fmt::format("{}: broadcast root {} is not a rank of a world of {}",
                            group.describe(), root, group.size()));
  }
  if (group.size() == 1) return;
  torch::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  std::vector<torch::Tensor> tensors{buffer};
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  group.wait(group.backend().broadcast(tensors, opts),
             "broadcast(root " + std::to_string(root) + ")");
  if (!buffer.is_same(tensor)) tensor.copy_(buffer);
}

std::vector<torch::Tensor> all_gather(const torch::Tensor& tensor, ProcessGroup& group) {
  check_tensor(tensor, group, "all_gather");
  if (group.size() == 1) return {tensor.clone()};
  std::vector<torch::Tensor> inputs{tensor.contiguous()};
  std::vector<std::vector<torch::Tensor>> outputs(1);
  for (int r = 0; r < group.size(); ++r) outputs[0].push_back(torch::empty_like(inputs[0]));
  group.wait(group.backend().allgather(outputs, inputs), "all_gather");
  return outputs[0];
}

torch::Tensor gather_cat(const torch::Tensor& tensor, ProcessGroup& group) {
  if (tensor.dim() == 0) return torch::stack(all_gather(tensor, group));
  return torch::cat(all_gather(tensor, group), 0);
}

torch::Tensor reduce_scatter(const torch::Tensor& input, ReduceOp op, ProcessGroup& group) {
  check_tensor(input, group, "reduce_scatter");
  check_mean(input, op, group, "reduce_scatter");
  const int world = group.size();
  if (input.dim() == 0 || input.size(0) % world != 0) {
    throw Error(
        fmt::format("{}: reduce_scatter needs dim 0 divisible by the world size {}, got "
                    "shape {}: pad the input",
                    group.describe(), world, c10::str(input.sizes())));
  }
  if (world == 1) return input.clone();
  const int64_t rows = input.size(0) / world;
  std::vector<int64_t> chunk_shape = input.sizes().vec();
  chunk_shape[0] = rows;
  torch::Tensor contiguous = input.contiguous();
  torch::Tensor result;
#ifdef DIFFTRAIN_WITH_NCCL
  if (group.backend_name() == "nccl") {
    result = torch::empty(chunk_shape, input.options());
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(op);
    group.wait(group.backend()._reduce_scatter_base(result, contiguous, opts), "reduce_scatter");
    if (op == ReduceOp::kMean) result.div_(world);
    return result;
  }
#endif
  // alltoall: chunk j of our input goes to rank j, so we receive every rank's chunk `rank`.
  torch::Tensor received = torch::empty_like(contiguous);
  std::vector<int64_t> equal_splits;
  group.wait(group.backend().alltoall_base(received, contiguous, equal_splits, equal_splits),
             std::string("reduce_scatter(") + to_string(op) + ")");
  std::vector<int64_t> stacked_shape{world};
  stacked_shape.insert(stacked_shape.end(), chunk_shape.begin(), chunk_shape.end());
  const torch::Tensor stacked = received.view(stacked_shape);
  switch (op) {
    case ReduceOp::kSum: result = stacked.sum(0, false, input.scalar_type()); break;
    case ReduceOp::kMean: result = stacked.sum(0).div_(world); break;
    case ReduceOp::kMax: result = std::get<0>(stacked.max(0)); break;
    case ReduceOp::kMin: result = std::get<0>(stacked.min(0)); break;
  }
  return result;
}

void barrier(ProcessGroup& group) {
  if (group.size() == 1) return;
  group.wait(group.backend().barrier(), "barrier");
}

}  // namespace difftrain::distributed

namespace difftrain::distributed {

void PendingCollective::wait() {
  if (!work_) return;
  auto work = std::move(work_);
  work_.reset();
  auto finish = std::move(finish_);
  finish_ = nullptr;
  group_->wait(work, op_);
  if (finish) finish();
  keep_.clear();
}

PendingCollective all_gather_into_async(torch::Tensor out, const torch::Tensor& shard,
                                        ProcessGroup& group) {
  check_tensor(shard, group, "all_gather_into");
  const int world = group.size();
  if (!out.is_contiguous() || !shard.is_contiguous() || out.dim() != 1 || shard.dim() != 1 ||
      out.numel() != shard.numel() * world || out.scalar_type() != shard.scalar_type()) {
    throw Error(fmt::format(
        "{}: all_gather_into needs a contiguous 1-D shard [S] and output [{} * S] of the same "
        "dtype, got {} and {}",
        group.describe(), world, c10::str(shard.sizes()), c10::str(out.sizes())));
  }
  PendingCollective pending;
  if (world == 1) {
    if (!out.is_same(shard)) out.copy_(shard);
    return pending;
  }
  const int64_t s = shard.numel();
  pending.group_ = &group;
  pending.op_ = "all_gather_into of " + std::to_string(out.numel()) + " elements";
#ifdef DIFFTRAIN_WITH_NCCL
  if (group.backend_name() == "nccl") {
    pending.work_ = group.backend()._allgather_base(out, const_cast<torch::Tensor&>(shard));
    pending.keep_ = {out, shard};
    return pending;
  }
#endif
  std::vector<torch::Tensor> inputs{shard};
  std::vector<std::vector<torch::Tensor>> outputs(1);
  for (int r = 0; r < world; ++r) outputs[0].push_back(out.narrow(0, r * s, s));
  pending.work_ = group.backend().allgather(outputs, inputs);
  pending.keep_ = {out, shard};
  return pending;
}

PendingCollective reduce_scatter_async(const torch::Tensor& input, torch::Tensor out, ReduceOp op,
                                       ProcessGroup& group) {
  check_tensor(input, group, "reduce_scatter_async");
  check_mean(input, op, group, "reduce_scatter_async");
  const int world = group.size();
  if (!input.is_contiguous() || input.dim() != 1 || out.dim() != 1 ||
      input.numel() != out.numel() * world || input.scalar_type() != out.scalar_type()) {
    throw Error(fmt::format(
        "{}: reduce_scatter_async needs a contiguous 1-D input [{} * S] and output [S] of the "
        "same dtype, got {} and {}",
        group.describe(), world, c10::str(input.sizes()), c10::str(out.sizes())));
  }
  if (op != ReduceOp::kSum && op != ReduceOp::kMean) {
    throw Error(fmt::format("{}: reduce_scatter_async supports sum and mean, got {}",
                            group.describe(), to_string(op)));
  }
  PendingCollective pending;
  if (world == 1) {
    out.copy_(input);
    return pending;
  }
  const int64_t s = out.numel();
  pending.group_ = &group;
  pending.op_ = std::string("reduce_scatter(") + to_string(op) + ") of " +
                std::to_string(input.numel()) + " elements";
#ifdef DIFFTRAIN_WITH_NCCL
  if (group.backend_name() == "nccl") {
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = c10d::ReduceOp::SUM;
    torch::Tensor in = input;
    pending.work_ = group.backend()._reduce_scatter_base(out, in, opts);
    pending.keep_ = {input, out};
    if (op == ReduceOp::kMean) pending.finish_ = [out, world]() mutable { out.div_(world); };
    return pending;
  }
#endif
  torch::Tensor received = torch::empty_like(input);
  std::vector<int64_t> equal_splits;
  torch::Tensor in = input;
  pending.work_ = group.backend().alltoall_base(received, in, equal_splits, equal_splits);
  pending.keep_ = {input, received, out};
  pending.finish_ = [received, out, world, s, op]() mutable {
    // Sum in rank order, so every rank's reduction is the same arithmetic.
    out.copy_(received.narrow(0, 0, s));
    for (int r = 1; r < world; ++r) out.add_(received.narrow(0, r * s, s));
    if (op == ReduceOp::kMean) out.div_(world);
  };
  return pending;
}

}  // namespace difftrain::distributed
