// The smallest difftrain program: join the job, all-reduce a tensor, print it on the main rank.
//
//   build/bin/difftrain launch --num_processes 3 build/examples/example_all_reduce
//
// Runs unchanged under torchrun, mpirun or srun, and alone (a world of one, no network).

#include "difftrain/core/log.h"
#include "difftrain/distributed/collectives.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

int main() {
  auto& group = difftrain::distributed::init_process_group();
  // x: [4], different on every rank
  auto x = torch::arange(4, torch::kFloat) + group.rank();
  difftrain::distributed::all_reduce(x, difftrain::distributed::ReduceOp::kMean, group);
  const std::vector<float> values(x.data_ptr<float>(), x.data_ptr<float>() + x.numel());
  difftrain::log::info("{} rank(s): mean over ranks = [{}]", group.size(), fmt::join(values, ", "));
  difftrain::distributed::barrier(group);
  return 0;
}
