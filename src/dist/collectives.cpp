#include "difftrain/dist/collectives.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>

namespace difftrain::dist {

namespace {

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
  torch::Tensor buffer = tensor.is_contiguous() ? tensor : tensor.contiguous();
  std::vector<torch::Tensor> tensors{buffer};
  c10d::AllreduceOptions opts;
  opts.reduceOp = to_c10d(op);
  group.wait(group.backend().allreduce(tensors, opts),
             std::string("all_reduce(") + to_string(op) + ")");
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

}  // namespace difftrain::dist
