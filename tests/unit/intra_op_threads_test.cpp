// configure_threads() and set_intra_op_threads(): the intra-op thread count is applied, and
// applying the count LibTorch already runs starts no threads (at::set_num_threads re-creates
// LibTorch 1.13's pthreadpool each time, and its new threads spin ~30 ms before they sleep: that
// cost a launched rank 100+ ms of CPU in its first micro-batch).
#include "difftrain/distributed/process_group.h"

#include <ATen/Parallel.h>
#include <dirent.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <string>

namespace {

std::set<std::string> thread_ids() {
  std::set<std::string> ids;
  if (DIR* dir = opendir("/proc/self/task")) {
    while (dirent* e = readdir(dir)) {
      if (e->d_name[0] != '.') ids.insert(e->d_name);
    }
    closedir(dir);
  }
  return ids;
}

}  // namespace

// The count is process-wide: put back what the process ran before (the sanitizer build runs the
// whole suite in one process, and other tests' float tolerances assume its thread count).
class IntraOpThreads : public ::testing::Test {
 protected:
  void SetUp() override { before_ = at::get_num_threads(); }
  void TearDown() override {
    unsetenv("DIFFTRAIN_NUM_THREADS");
    at::set_num_threads(before_);
  }

 private:
  int before_ = 1;
};

TEST_F(IntraOpThreads, TheCountAlreadyInForceStartsNoThreads) {
  // As in a launched rank: the count set once, LibTorch's pools and OpenMP team running.
  at::set_num_threads(2);
  at::parallel_for(0, 1 << 16, 1, [](int64_t, int64_t) {});
  const auto before = thread_ids();
  setenv("DIFFTRAIN_NUM_THREADS", "2", 1);
  for (int i = 0; i < 3; ++i) EXPECT_EQ(difftrain::distributed::configure_threads(), 2);
  difftrain::distributed::set_intra_op_threads(2);
  at::parallel_for(0, 1 << 16, 1, [](int64_t, int64_t) {});
  EXPECT_EQ(thread_ids(), before) << "threads were started (or ended) for an unchanged count";
}

TEST_F(IntraOpThreads, ANewCountIsApplied) {
  difftrain::distributed::set_intra_op_threads(1);
  EXPECT_EQ(at::get_num_threads(), 1);
  setenv("DIFFTRAIN_NUM_THREADS", "2", 1);
  EXPECT_EQ(difftrain::distributed::configure_threads(), 2);
  EXPECT_EQ(at::get_num_threads(), 2);
}
