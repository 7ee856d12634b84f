#pragma once
// Ranks as threads of one test process: each thread joins a real Gloo group on loopback through
// a shared c10d HashStore. For unit tests of collective logic (STYLE.md: Tests).

#include "difftrain/distributed/process_group.h"

#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <thread>
#include <vector>

namespace difftrain::distributed {

// Runs `body` on `world` threads, each with its own ProcessGroup; collects failures per rank.
inline void on_ranks(int world, const std::function<void(ProcessGroup&)>& body) {
  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<std::string> errors(static_cast<size_t>(world));
  std::vector<std::thread> threads;
  for (int r = 0; r < world; ++r) {
    threads.emplace_back([&, r]() {
      try {
        RendezvousInfo info;
        info.rank = r;
        info.world_size = world;
        info.local_rank = r;
        info.local_world_size = world;
        ProcessGroupOptions options;
        options.join_timeout = std::chrono::seconds(20);
        options.collective_timeout = std::chrono::seconds(20);
        ProcessGroup group(info, options, store);
        body(group);
      } catch (const std::exception& e) {
        errors[static_cast<size_t>(r)] = e.what();
      }
    });
  }
  for (auto& t : threads) t.join();
  for (int r = 0; r < world; ++r) EXPECT_EQ(errors[static_cast<size_t>(r)], "") << "rank " << r;
}

}  // namespace difftrain::distributed
