// A program the dist tests run under `difftrain launch`. Its first argument picks what it does:
//   collectives            the self-test (exact values of every collective); exit 1 on a failure
//   exit CODE RANK         rank RANK exits with CODE after the group has formed; the others wait
//   sigkill RANK           rank RANK kills itself with SIGKILL; the others wait
//   sleep SECONDS          every rank sleeps (to be interrupted)
//   fail_once DIR          first run: rank 0 exits 3; after a restart: the self-test
//   loop SECONDS           all_reduce in a loop for up to SECONDS, printing progress
//   env                    prints its rendezvous variables
//   sockets                joins, then lists its TCP sockets (any state) by local address; exit 1
//                          unless every one is on loopback
//   spam LINES             writes long lines in pieces (whole-line relay)
// Every rank writes its pid to $DT_PID_DIR/<rank>.pid when DT_PID_DIR is set.

#include "../proc_net.h"
#include "difftrain/core/error.h"
#include "difftrain/distributed/collectives.h"
#include "difftrain/launch/self_check.h"

#include <signal.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

std::string env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}

void write_pid() {
  const std::string dir = env("DT_PID_DIR");
  if (dir.empty()) return;
  std::ofstream(dir + "/" + env("RANK") + ".pid") << getpid() << "\n";
}

// TCP sockets of this process, by local "address:port" (an IPv6 one is reported as such and
// counts as not loopback).
std::vector<std::string> tcp_sockets() {
  const auto inodes = difftrain::testing::socket_inodes("/proc/self/fd");
  std::vector<std::string> out;
  for (const char* table : {"/proc/self/net/tcp", "/proc/self/net/tcp6"}) {
    for (const auto& row : difftrain::testing::read_tcp_table(table)) {
      if (!inodes.count(row.inode)) continue;
      const auto colon = row.local.find(':');
      const std::string hex = row.local.substr(0, colon);
      const int port = std::stoi(row.local.substr(colon + 1), nullptr, 16);
      if (hex.size() != 8) {
        out.push_back("ipv6:" + std::to_string(port));
        continue;
      }
      const unsigned long address = std::stoul(hex, nullptr, 16);  // little-endian on x86
      out.push_back(std::to_string(address & 0xff) + "." + std::to_string((address >> 8) & 0xff) +
                    "." + std::to_string((address >> 16) & 0xff) + "." +
                    std::to_string(address >> 24) + ":" + std::to_string(port));
    }
  }
  return out;
}

void sleep_s(double s) {
  std::this_thread::sleep_for(std::chrono::milliseconds(static_cast<long>(s * 1000)));
}

int run(int argc, char** argv) {
  write_pid();
  const std::string mode = argc > 1 ? argv[1] : "collectives";
  auto arg = [&](int i) { return argc > i ? std::string(argv[i]) : std::string(); };
  if (mode == "env") {
    for (const char* k :
         {"DIFFTRAIN_COLLECTIVE_TIMEOUT", "DIFFTRAIN_JOIN_TIMEOUT", "RANK", "WORLD_SIZE",
          "LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT",
          "OMP_NUM_THREADS", "DIFFTRAIN_NUM_THREADS", "DIFFTRAIN_MIXED_PRECISION",
          "DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS", "DIFFTRAIN_RESTART_COUNT"}) {
      std::cout << k << "=" << env(k) << "\n";
    }
    return 0;
  }
  if (mode == "sleep") {
    sleep_s(std::stod(arg(2)));
    return 0;
  }
  if (mode == "spam") {
    // Long lines written in pieces, from every rank at once: the launcher must keep them whole.
    const std::string r = env("RANK");
    const int lines = std::stoi(arg(2));
    for (int i = 0; i < lines; ++i) {
      std::cout << "<" << r << ":" << std::string(150, 'a');
      std::cout.flush();
      std::cout << std::string(150, 'b') << ":" << r << ">\n";
      if (i % 7 == 0) std::cout.flush();
    }
    std::cout << "partial line without newline from " << r;
    return 0;
  }
  if (mode == "collectives") return difftrain::launch::run_self_check(std::cout) == 0 ? 0 : 1;
  if (mode == "fail_once") {
    const std::string marker = arg(2) + "/failed_once";
    if (env("RANK") == "0" && !std::filesystem::exists(marker)) {
      std::ofstream(marker) << "1\n";
      std::cerr << "failing on purpose (restart count " << env("DIFFTRAIN_RESTART_COUNT") << ")\n";
      return 3;
    }
    return difftrain::launch::run_self_check(std::cout) == 0 ? 0 : 1;
  }
  auto& group = difftrain::distributed::init_process_group();
  if (mode == "exit" || mode == "sigkill") {
    difftrain::distributed::barrier(group);
    const int victim = std::stoi(arg(mode == "exit" ? 3 : 2));
    if (group.rank() == victim) {
      std::cout << "rank " << victim << " leaving now" << std::endl;
      if (mode == "sigkill") kill(getpid(), SIGKILL);
      return std::stoi(arg(2));
    }
    sleep_s(120);
    return 0;
  }
  if (mode == "sockets") {
    difftrain::distributed::barrier(group);
    int outside = 0;
    for (const auto& s : tcp_sockets()) {
      std::cout << "socket on " << s << std::endl;
      if (s.rfind("127.", 0) != 0) ++outside;
    }
    difftrain::distributed::barrier(group);  // keep every socket open until every rank has looked
    return outside == 0 ? 0 : 1;
  }
  if (mode == "loop") {
    const double limit = std::stod(arg(2));
    const auto start = std::chrono::steady_clock::now();
    // The ranks agree when to stop: each adds its "time is up" vote to the last element, so no
    // rank leaves while another still waits in an all-reduce (each rank's clock differs a little).
    for (int i = 0;; ++i) {
      auto t = torch::ones({1024});
      const bool up =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() > limit;
      t[1023] = up ? 1.0F : 0.0F;
      difftrain::distributed::all_reduce(t, difftrain::distributed::ReduceOp::kSum, group);
      if (t[0].item<float>() != static_cast<float>(group.size())) {
        std::cerr << "wrong all_reduce value " << t[0].item<float>() << "\n";
        return 1;
      }
      if (i % 20 == 0) std::cout << "iteration " << i << std::endl;
      if (t[1023].item<float>() > 0.0F) break;
      sleep_s(0.05);
    }
    std::cout << "loop done" << std::endl;
    return 0;
  }
  std::cerr << "dist_worker: unknown mode " << mode << "\n";
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(argc, argv);
  } catch (const std::exception& e) {
    std::cerr << "dist_worker: error: " << e.what() << std::endl;
    return 1;
  }
}
