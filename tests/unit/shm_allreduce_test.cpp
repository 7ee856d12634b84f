// The shared-memory all-reduce (ShmAllReduce): ranks as threads of this process on a HashStore
// (the group picks it because every rank is on this machine), and one real forked process for a
// peer that exits. Sums are checked against a float64 recomputation and, for two ranks, bit for
// bit against Gloo's; every rank must hold the same bits.

#include "difftrain/distributed/shm_allreduce.h"
#include "difftrain/core/error.h"
#include "difftrain/distributed/collectives.h"
#include "thread_ranks.h"

#include <torch/csrc/distributed/c10d/FileStore.hpp>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <gtest/gtest.h>

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <thread>
#include <utility>

namespace difftrain::distributed {
namespace {

using Clock = std::chrono::steady_clock;

// Rank r's values: a fixed scramble of [-1, 1) (no global RNG: the ranks are threads).
torch::Tensor rank_values(int rank, int64_t n, torch::ScalarType dtype) {
  const auto i = torch::arange(n, torch::kFloat64);
  const auto x = torch::sin(i * 12.9898 + 78.233 * (rank + 1)) * 43758.5453;
  return ((x - x.floor()) * 2 - 1).to(dtype);
}

class ShmOnThreads : public ::testing::TestWithParam<int> {};

TEST_P(ShmOnThreads, SumsAndMeansMatchFloat64AndAreTheSameBitsOnEveryRank) {
  const int world = GetParam();
  // 0, 1, odd, and 2.5 M floats: three 4 MiB chunks with a ragged last one.
  const std::vector<int64_t> sizes{0, 1, 17, 1000, 2'500'001};
  std::mutex m;
  std::vector<std::vector<torch::Tensor>> results(static_cast<size_t>(world));
  on_ranks(world, [&](ProcessGroup& g) {
    if (g.shm() == nullptr) throw std::runtime_error("ranks on one machine did not get shm");
    std::vector<torch::Tensor> mine;
    for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
      for (int64_t n : sizes) {
        auto sum = rank_values(g.rank(), n, dtype);
        all_reduce(sum, ReduceOp::kSum, g);
        auto mean = rank_values(g.rank(), n, dtype);
        all_reduce_async(mean, ReduceOp::kMean, g).wait();
        mine.push_back(sum);
        mine.push_back(mean);
      }
    }
    std::lock_guard<std::mutex> lock(m);
    results[static_cast<size_t>(g.rank())] = std::move(mine);
  });
  ASSERT_EQ(results[0].size(), sizes.size() * 4);
  size_t k = 0;
  double worst32 = 0, worst64 = 0;
  for (auto dtype : {torch::kFloat32, torch::kFloat64}) {
    for (int64_t n : sizes) {
      auto want = torch::zeros({n}, torch::kFloat64);
      for (int r = 0; r < world; ++r) want += rank_values(r, n, torch::kFloat64);
      for (int which = 0; which < 2; ++which, ++k) {
        const auto expect = which == 0 ? want : want / world;
        const auto& got = results[0][k];
        ASSERT_EQ(got.numel(), n);
        const double diff = n ? (got.to(torch::kFloat64) - expect).abs().max().item<double>() : 0;
        (dtype == torch::kFloat32 ? worst32 : worst64) =
            std::max(dtype == torch::kFloat32 ? worst32 : worst64, diff);
        EXPECT_LT(diff, dtype == torch::kFloat32 ? 2e-6 : 1e-14) << "n " << n;
        for (int r = 1; r < world; ++r)
          EXPECT_TRUE(torch::equal(results[static_cast<size_t>(r)][k], got)) << "rank " << r;
      }
    }
  }
  std::printf("world %d: max abs diff to float64: float32 %.3g, float64 %.3g\n", world, worst32,
              worst64);
}

TEST_P(ShmOnThreads, AsyncReducesInFlightFinishInLaunchOrderWhateverTheWaitOrder) {
  const int world = GetParam();
  on_ranks(world, [&](ProcessGroup& g) {
    std::vector<torch::Tensor> tensors;
    std::vector<PendingAllReduce> pending;
    for (int i = 0; i < 5; ++i) {
      tensors.push_back(torch::full({1000 * (i + 1) + i}, float(g.rank() + 1) * (i + 1)));
      pending.push_back(all_reduce_async(tensors.back(), ReduceOp::kSum, g));
    }
    auto ints = torch::full({3}, g.rank() + 1, torch::kLong);  // not a float: through Gloo
    all_reduce(ints, ReduceOp::kSum, g);
    for (int i = 4; i >= 0; --i) pending[static_cast<size_t>(i)].wait();
    const float ranks = world * (world + 1) / 2.0f;
    for (int i = 0; i < 5; ++i) {
      const auto want = torch::full_like(tensors[static_cast<size_t>(i)], ranks * (i + 1));
      if (!torch::equal(tensors[static_cast<size_t>(i)], want))
        throw std::runtime_error("tensor " + std::to_string(i));
    }
    if (ints.sum().item<int64_t>() != 3 * static_cast<int64_t>(ranks))
      throw std::runtime_error("ints");
  });
}

INSTANTIATE_TEST_SUITE_P(World, ShmOnThreads, ::testing::Values(2, 3));

TEST(ShmAllReduce, TwoRanksGiveGloosBitsExactly) {
  on_ranks(2, [&](ProcessGroup& g) {
    auto shm = rank_values(g.rank(), 300'001, torch::kFloat32);
    auto gloo = shm.clone();
    all_reduce(shm, ReduceOp::kSum, g);
    std::vector<torch::Tensor> tensors{gloo};
    g.wait(g.backend().allreduce(tensors, c10d::AllreduceOptions()), "gloo all_reduce");
    if (!torch::equal(shm, gloo)) {
      throw std::runtime_error("max abs diff " +
                               std::to_string((shm - gloo).abs().max().item<double>()));
    }
  });
}

TEST(ShmAllReduce, OffSwitchKeepsGloo) {
  ::setenv("DIFFTRAIN_SHM_ALLREDUCE", "0", 1);
  on_ranks(2, [&](ProcessGroup& g) {
    if (g.shm() != nullptr) throw std::runtime_error("DIFFTRAIN_SHM_ALLREDUCE=0 was ignored");
    auto t = torch::full({5}, 1.0f + g.rank());
    all_reduce(t, ReduceOp::kMean, g);
    if (!torch::equal(t, torch::full({5}, 1.5f))) throw std::runtime_error("mean");
  });
  ::unsetenv("DIFFTRAIN_SHM_ALLREDUCE");
}

// Launches a sum of n ones that is expected to fail; returns its message and how long it took.
std::pair<std::string, double> failing_reduce(ShmAllReduce& shm, int64_t n) {
  auto t = torch::ones({n});
  const auto start = Clock::now();
  std::string message;
  try {
    shm.launch(t)->wait();
  } catch (const std::exception& e) {
    message = e.what();
  }
  const double took = std::chrono::duration<double>(Clock::now() - start).count();
  std::printf("after %.2f s: %s\n", took, message.c_str());
  return {message, took};
}

TEST(ShmAllReduce, APeerThatNeverComesIsAClearErrorAndLaterCallsFailAtOnce) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::unique_ptr<ShmAllReduce> peer;
  std::thread other([&] { peer = ShmAllReduce::create(*store, 1, 2, std::chrono::seconds(1)); });
  auto shm = ShmAllReduce::create(*store, 0, 2, std::chrono::milliseconds(400));
  other.join();
  ASSERT_TRUE(shm && peer);
  const auto [message, took] = failing_reduce(*shm, 100);
  EXPECT_NE(message.find("rank 0 waited"), std::string::npos) << message;
  EXPECT_NE(message.find("DIFFTRAIN_COLLECTIVE_TIMEOUT"), std::string::npos) << message;
  EXPECT_LT(took, 5.0);
  const auto [again, again_took] = failing_reduce(*shm, 100);
  EXPECT_NE(again.find("an earlier all-reduce failed"), std::string::npos) << again;
  EXPECT_LT(again_took, 0.5);
}

TEST(ShmAllReduce, APeerProcessThatExitsIsNamedLongBeforeTheTimeout) {
  const auto dir =
      std::filesystem::temp_directory_path() / ("difftrain_shm_" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  const std::string path = (dir / "store").string();
  std::fflush(nullptr);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // Rank 1: joins the transport, then exits without ever reducing.
    try {
      c10d::FileStore store(path, 2);
      auto shm = ShmAllReduce::create(store, 1, 2, std::chrono::seconds(60));
      ::_exit(shm ? 0 : 3);
    } catch (...) {
      ::_exit(4);
    }
  }
  std::unique_ptr<ShmAllReduce> shm;
  {
    c10d::FileStore store(path, 2);
    shm = ShmAllReduce::create(store, 0, 2, std::chrono::seconds(60));
  }
  int status = 0;
  ::waitpid(child, &status, 0);  // reaped: its pid is gone
  ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << status;
  ASSERT_TRUE(shm);
  const auto [message, took] = failing_reduce(*shm, 1000);
  EXPECT_NE(message.find("rank 1 (pid " + std::to_string(child) + ") exited"), std::string::npos)
      << message;
  EXPECT_LT(took, 5.0);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace difftrain::distributed
