// Collectives with ranks as threads of this process, joined through a c10d HashStore over a real
// Gloo group on loopback. Values are checked exactly against closed forms.

#include "difftrain/distributed/collectives.h"
#include "difftrain/core/error.h"
#include "difftrain/launch/self_check.h"
#include "thread_ranks.h"

#include <gtest/gtest.h>

#include <functional>
#include <sstream>
#include <thread>

namespace difftrain::distributed {
namespace {

class CollectivesOnThreads : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesOnThreads, SelfTestPassesEveryCheck) {
  const int world = GetParam();
  std::vector<int> failed(static_cast<size_t>(world), -1);
  std::vector<std::string> output(static_cast<size_t>(world));
  on_ranks(world, [&](ProcessGroup& g) {
    std::ostringstream out;
    failed[static_cast<size_t>(g.rank())] = launch::run_checks(g, out);
    output[static_cast<size_t>(g.rank())] = out.str();
  });
  for (int r = 0; r < world; ++r)
    EXPECT_EQ(failed[static_cast<size_t>(r)], 0) << output[static_cast<size_t>(r)];
  EXPECT_NE(output[0].find("11 passed, 0 failed"), std::string::npos) << output[0];
}

TEST_P(CollectivesOnThreads, NonContiguousAllReduceWritesBack) {
  const int world = GetParam();
  on_ranks(world, [&](ProcessGroup& g) {
    auto base = torch::arange(12, torch::kFloat).view({3, 4}) * (g.rank() + 1);
    auto column = base.t();  // non-contiguous view
    all_reduce(column, ReduceOp::kSum, g);
    const float factor = world * (world + 1) / 2.0f;
    const auto want = torch::arange(12, torch::kFloat).view({3, 4}) * factor;
    const double diff = (base - want).abs().max().item<double>();
    if (diff != 0.0) throw std::runtime_error("max abs diff " + std::to_string(diff));
  });
}

TEST_P(CollectivesOnThreads, ReduceScatterMeanAndMinOnTwoDims) {
  const int world = GetParam();
  on_ranks(world, [&](ProcessGroup& g) {
    const auto rows = torch::arange(3 * world * 2, torch::kDouble).view({3 * world, 2});
    auto input = rows * (g.rank() + 1);
    const auto mean = reduce_scatter(input, ReduceOp::kMean, g);
    const auto mine = rows.slice(0, 3 * g.rank(), 3 * g.rank() + 3);
    const double expect_factor = (world + 1) / 2.0;
    if ((mean - mine * expect_factor).abs().max().item<double>() > 1e-12)
      throw std::runtime_error("mean");
    const auto minimum = reduce_scatter(input, ReduceOp::kMin, g);
    if (!torch::equal(minimum, mine)) throw std::runtime_error("min");
  });
}

TEST_P(CollectivesOnThreads, BadArgumentsAreClearErrors) {
  const int world = GetParam();
  on_ranks(world, [&](ProcessGroup& g) {
    auto odd = torch::ones({world * 2 + 1});
    try {
      reduce_scatter(odd, ReduceOp::kSum, g);
      throw std::runtime_error("reduce_scatter accepted an indivisible dim 0");
    } catch (const Error& e) {
      if (std::string(e.what()).find("divisible by the world size") == std::string::npos) throw;
    }
    auto ints = torch::ones({4}, torch::kLong);
    EXPECT_THROW(all_reduce(ints, ReduceOp::kMean, g), Error);
    auto t = torch::ones({2});
    EXPECT_THROW(broadcast(t, world, g), Error);
    barrier(g);  // the group still works after rejected calls
  });
}

INSTANTIATE_TEST_SUITE_P(World, CollectivesOnThreads, ::testing::Values(2, 3));

TEST(Collectives, WorldOfOneNeedsNoNetwork) {
  RendezvousInfo info;  // rank 0 of 1
  ProcessGroup group(info);
  EXPECT_EQ(group.backend_name(), "local");
  auto t = torch::tensor({1.0, 2.0});
  all_reduce(t, ReduceOp::kMean, group);
  EXPECT_TRUE(torch::equal(t, torch::tensor({1.0, 2.0})));
  EXPECT_EQ(all_gather(t, group).size(), 1u);
  EXPECT_TRUE(torch::equal(reduce_scatter(t, ReduceOp::kSum, group), t));
  std::ostringstream out;
  EXPECT_EQ(launch::run_checks(group, out), 0) << out.str();
}

TEST(Collectives, MissingRankIsNamedAfterTheJoinTimeout) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  RendezvousInfo info;
  info.rank = 0;
  info.world_size = 3;
  info.local_world_size = 3;
  ProcessGroupOptions options;
  options.join_timeout = std::chrono::milliseconds(500);
  try {
    ProcessGroup group(info, options, store);
    FAIL() << "joined without ranks 1 and 2";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("rank 0/3"), std::string::npos) << message;
    EXPECT_NE(message.find("waiting for rank(s) 1, 2"), std::string::npos) << message;
  }
}

}  // namespace
}  // namespace difftrain::distributed
