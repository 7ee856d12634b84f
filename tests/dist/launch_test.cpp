// `difftrain launch` end to end: real rank processes over loopback, checked from the outside.

#include "subprocess.h"

#include <signal.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <regex>
#include <sstream>
#include <thread>

#include "difftrain/distributed/net.h"
#include "program_paths.h"

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kDifftrain = difftrain_test::difftrain_bin();
const std::string kWorker = difftrain_test::dist_worker_bin();

std::vector<std::string> launch(std::vector<std::string> flags, std::vector<std::string> program) {
  std::vector<std::string> argv{kDifftrain, "launch"};
  argv.insert(argv.end(), flags.begin(), flags.end());
  argv.push_back(kWorker);
  argv.insert(argv.end(), program.begin(), program.end());
  return argv;
}

// The launcher reads the default config when one exists: keep the tests away from the user's.
std::map<std::string, std::string> test_env(std::map<std::string, std::string> extra = {}) {
  static const std::string cache = make_temp_dir("xdg");
  extra["XDG_CACHE_HOME"] = cache;
  return extra;
}

std::vector<pid_t> read_pids(const std::string& dir) {
  std::vector<pid_t> pids;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.path().extension() != ".pid") continue;
    pid_t pid = 0;
    std::ifstream(entry.path()) >> pid;
    if (pid > 0) pids.push_back(pid);
  }
  return pids;
}

void expect_all_gone(const std::vector<pid_t>& pids) {
  for (pid_t pid : pids) EXPECT_FALSE(alive(pid)) << "rank process " << pid << " was left running";
}

size_t count(const std::string& text, const std::string& needle) {
  size_t n = 0;
  for (size_t pos = text.find(needle); pos != std::string::npos; pos = text.find(needle, pos + 1))
    ++n;
  return n;
}

// Runs two processes side by side (two machines' launchers, or two hand-started ranks).
std::pair<ProcessResult, ProcessResult> run_pair(const std::vector<std::string>& argv0,
                                                 const std::map<std::string, std::string>& env0,
                                                 const std::vector<std::string>& argv1,
                                                 const std::map<std::string, std::string>& env1,
                                                 double timeout_s) {
  Process first(argv0, env0);
  Process second(argv1, env1);
  auto b = second.wait(timeout_s);
  auto a = first.wait(timeout_s);
  return {std::move(a), std::move(b)};
}

// Ranks 0 and 1 of a 2-rank job started by hand with the variables `env_for(rank)`.
void expect_hand_started_pair_passes(
    const std::function<std::map<std::string, std::string>(int)>& env_for) {
  const auto [a, b] =
      run_pair({kWorker, "collectives"}, env_for(0), {kWorker, "collectives"}, env_for(1), 60);
  EXPECT_EQ(a.exit_code, 0) << a.log();
  EXPECT_EQ(b.exit_code, 0) << b.log();
  EXPECT_NE(a.out.find("11 passed, 0 failed on 2 rank(s)"), std::string::npos) << a.log();
}

class CollectivesUnderLaunch : public ::testing::TestWithParam<int> {};

TEST_P(CollectivesUnderLaunch, EveryCheckPassesWithExactValues) {
  const int n = GetParam();
  const auto r =
      run(launch({"--num_processes", std::to_string(n)}, {"collectives"}), test_env(), 120);
  ASSERT_FALSE(r.timed_out) << r.log();
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.out.find("[rank 0] difftrain test: 11 passed, 0 failed on " + std::to_string(n) +
                       " rank(s)"),
            std::string::npos)
      << r.log();
  EXPECT_EQ(r.out.find("[FAIL]"), std::string::npos) << r.log();
  // Every output line carries its rank prefix.
  std::istringstream lines(r.out);
  for (std::string line; std::getline(lines, line);) {
    EXPECT_TRUE(std::regex_search(line, std::regex("^\\[rank [0-9]+\\] "))) << line;
  }
}

INSTANTIATE_TEST_SUITE_P(Ranks, CollectivesUnderLaunch, ::testing::Values(1, 2, 3, 4));

TEST(Launch, RanksGetTheTorchrunAndDifftrainEnvironment) {
  const auto r = run(launch({"--num_processes", "2", "--num_cpu_threads_per_process", "3",
                             "--mixed_precision", "bf16", "--gradient_accumulation_steps", "4",
                             "--join_timeout", "12", "--collective_timeout", "90"},
                            {"env"}),
                     test_env(), 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  for (const char* line :
       {"[rank 1] RANK=1", "[rank 0] RANK=0", "[rank 1] WORLD_SIZE=2", "[rank 1] LOCAL_RANK=1",
        "[rank 1] LOCAL_WORLD_SIZE=2", "[rank 0] NODE_RANK=0", "[rank 0] MASTER_ADDR=127.0.0.1",
        "[rank 1] OMP_NUM_THREADS=3", "[rank 1] DIFFTRAIN_NUM_THREADS=3",
        "[rank 0] DIFFTRAIN_MIXED_PRECISION=bf16",
        "[rank 0] DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS=4", "[rank 0] DIFFTRAIN_RESTART_COUNT=0",
        "[rank 1] DIFFTRAIN_JOIN_TIMEOUT=12", "[rank 1] DIFFTRAIN_COLLECTIVE_TIMEOUT=90"}) {
    EXPECT_NE(r.out.find(line), std::string::npos) << line << "\n" << r.log();
  }
  // Default threads: cores / local ranks.
  const auto d = run(launch({"--num_processes", "2"}, {"env"}), test_env(), 60);
  const int cores = static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  EXPECT_NE(d.out.find("OMP_NUM_THREADS=" + std::to_string(std::max(1, cores / 2))),
            std::string::npos)
      << d.log();
}

// `difftrain launch ... difftrain CMD`: the ranks are forks of the launcher that run difftrain's
// main() without exec (no second LibTorch start-up). They must behave as exec'd ranks do.
TEST(Launch, DifftrainRanksAreForksOfTheLauncherAndBehaveAsExecdOnes) {
  const std::string forked = "(ranks start as forks of this launcher, without exec)";
  for (const bool exec : {false, true}) {
    SCOPED_TRACE(exec ? "DIFFTRAIN_LAUNCH_EXEC=1" : "forked ranks");
    auto env = test_env({{"OMP_NUM_THREADS", "2"}});
    if (exec) env["DIFFTRAIN_LAUNCH_EXEC"] = "1";
    const auto check =
        run({kDifftrain, "launch", "--num_processes", "2", kDifftrain, "test"}, env, 120);
    ASSERT_EQ(check.exit_code, 0) << check.log();
    EXPECT_EQ(check.err.find(forked) != std::string::npos, !exec) << check.log();
    EXPECT_NE(check.out.find("[rank 0] difftrain test: 11 passed, 0 failed on 2 rank(s)"),
              std::string::npos)
        << check.log();
    // The rank's environment and thread count are the launcher's choice, not the launcher's own.
    const auto info =
        run({kDifftrain, "launch", "--num_processes", "2", "--num_cpu_threads_per_process", "1",
             "--mixed_precision", "bf16", kDifftrain, "env"},
            env, 120);
    ASSERT_EQ(info.exit_code, 0) << info.log();
    for (const char* line : {"[rank 0] - threads: intra-op 1 (at::get_num_threads)",
                             "[rank 1] - threads: intra-op 1 (at::get_num_threads)"}) {
      EXPECT_NE(info.out.find(line), std::string::npos) << line << "\n" << info.log();
    }
    // A failing rank's error is printed once, prefixed, and its exit code returned.
    const auto bad = run({kDifftrain, "launch", "--num_processes", "2", kDifftrain, "train",
                          "--dataset", "imagefolder", "--train_data_dir", "/nonexistent/folder"},
                         env, 120);
    EXPECT_EQ(bad.exit_code, 1) << bad.log();
    EXPECT_EQ(count(bad.err, "[rank 0] difftrain: error:"), 1u) << bad.log();
    EXPECT_NE(bad.err.find("/nonexistent/folder"), std::string::npos) << bad.log();
  }
}

TEST(Launch, OneMachineJobsUseLoopbackOnly) {
  const auto r = run(launch({"--num_processes", "3"}, {"sockets"}), test_env(), 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();  // the worker exits 1 if any socket is off loopback
  // Gloo's full mesh: every rank holds a connection to each of the 2 others, all on 127.0.0.1.
  EXPECT_GE(count(r.out, "socket on 127.0.0.1:"), 6u) << r.log();
  EXPECT_EQ(count(r.out, "socket on "), count(r.out, "socket on 127.0.0.1:")) << r.log();
}

TEST(Launch, LinesFromManyRanksNeverInterleave) {
  const auto r = run(launch({"--num_processes", "4"}, {"spam", "300"}), test_env(), 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  std::istringstream lines(r.out);
  int whole = 0;
  const std::regex pattern("^\\[rank ([0-3])\\] <([0-3]):a{150}b{150}:([0-3])>$");
  for (std::string line; std::getline(lines, line);) {
    std::smatch m;
    if (std::regex_match(line, m, pattern)) {
      EXPECT_EQ(m[1], m[2]);
      EXPECT_EQ(m[2], m[3]);
      ++whole;
    } else {
      EXPECT_TRUE(std::regex_match(
          line, std::regex("^\\[rank [0-3]\\] partial line without newline from [0-3]$")))
          << "mangled line: " << line.substr(0, 120);
    }
  }
  EXPECT_EQ(whole, 4 * 300);
}

TEST(Launch, FailingRankStopsTheOthersAndItsCodeIsReturned) {
  const auto pid_dir = make_temp_dir("pids");
  const auto r = run(launch({"--num_processes", "3"}, {"exit", "7", "1"}),
                     test_env({{"DT_PID_DIR", pid_dir}}), 60);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_EQ(r.exit_code, 7) << r.log();
  EXPECT_LT(r.seconds, 10.0) << r.log();
  EXPECT_TRUE(std::regex_search(
      r.err, std::regex("difftrain launch: rank 1 \\(pid [0-9]+\\) exited with status 7; "
                        "stopped 2 other local rank\\(s\\); its output is above, "
                        "prefixed \\[rank 1\\]")))
      << r.log();
  const auto pids = read_pids(pid_dir);
  EXPECT_EQ(pids.size(), 3u);
  expect_all_gone(pids);
}

TEST(Launch, RanksFailingAtOnceAreReportedAsFailuresNotAsSignalsToTheLauncher) {
  // The launcher's SIGTERM to ranks that are still starting must never look like a signal to
  // the launcher itself (that would also skip --max_restarts).
  for (int i = 0; i < 10; ++i) {
    const auto r =
        run({kDifftrain, "launch", "--num_processes", "4", "/bin/false"}, test_env(), 30);
    ASSERT_EQ(r.exit_code, 1) << "run " << i << "\n" << r.log();
    EXPECT_EQ(r.err.find("interrupted"), std::string::npos) << r.log();
  }
}

TEST(Launch, KilledRankIsReportedWithItsSignal) {
  const auto pid_dir = make_temp_dir("pids");
  const auto log_dir = make_temp_dir("logs");
  const auto r = run(launch({"--num_processes", "2", "--log_dir", log_dir}, {"sigkill", "1"}),
                     test_env({{"DT_PID_DIR", pid_dir}}), 60);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_EQ(r.exit_code, 128 + SIGKILL) << r.log();
  EXPECT_NE(r.err.find("was killed by SIGKILL"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("log: " + log_dir + "/rank1.log"), std::string::npos) << r.log();
  std::stringstream log;
  log << std::ifstream(log_dir + "/rank1.log").rdbuf();
  EXPECT_NE(log.str().find("[rank 1] rank 1 leaving now"), std::string::npos) << log.str();
  expect_all_gone(read_pids(pid_dir));
}

TEST(Launch, SigintToTheLauncherEndsEveryRank) {
  const auto pid_dir = make_temp_dir("pids");
  Process launcher(launch({"--num_processes", "3"}, {"sleep", "60"}),
                   test_env({{"DT_PID_DIR", pid_dir}}));
  for (int i = 0; i < 200 && read_pids(pid_dir).size() < 3; ++i) usleep(50 * 1000);
  const auto pids = read_pids(pid_dir);
  ASSERT_EQ(pids.size(), 3u);
  launcher.signal(SIGINT);
  const auto r = launcher.wait(20);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_EQ(r.exit_code, 128 + SIGINT) << r.log();
  EXPECT_NE(r.err.find("interrupted by SIGINT"), std::string::npos) << r.log();
  EXPECT_LT(r.seconds, 10.0);
  expect_all_gone(pids);
}

TEST(Launch, KilledLauncherLeavesNoRankBehind) {
  const auto pid_dir = make_temp_dir("pids");
  Process launcher(launch({"--num_processes", "2"}, {"sleep", "60"}),
                   test_env({{"DT_PID_DIR", pid_dir}}));
  for (int i = 0; i < 200 && read_pids(pid_dir).size() < 2; ++i) usleep(50 * 1000);
  const auto pids = read_pids(pid_dir);
  ASSERT_EQ(pids.size(), 2u);
  kill(launcher.pid(), SIGKILL);  // no chance to clean up: the ranks' parent-death signal must act
  const auto r = launcher.wait(20);
  EXPECT_EQ(r.term_signal, SIGKILL);
  for (int i = 0; i < 100 && std::any_of(pids.begin(), pids.end(), alive); ++i) usleep(50 * 1000);
  expect_all_gone(pids);
}

TEST(Launch, SigtermToTheLauncherIsForwarded) {
  const auto pid_dir = make_temp_dir("pids");
  Process launcher(launch({"--num_processes", "2"}, {"sleep", "60"}),
                   test_env({{"DT_PID_DIR", pid_dir}}));
  for (int i = 0; i < 200 && read_pids(pid_dir).size() < 2; ++i) usleep(50 * 1000);
  ASSERT_EQ(read_pids(pid_dir).size(), 2u);
  launcher.signal(SIGTERM);
  const auto r = launcher.wait(20);
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.log();
  expect_all_gone(read_pids(pid_dir));
}

TEST(Launch, MaxRestartsRunsTheGroupAgain) {
  const auto marker_dir = make_temp_dir("restart");
  const auto r =
      run(launch({"--num_processes", "2", "--max_restarts", "1"}, {"fail_once", marker_dir}),
          test_env(), 120);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_EQ(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("exited with status 3"), std::string::npos) << r.log();
  EXPECT_NE(r.err.find("restarting the group (1/1)"), std::string::npos) << r.log();
  EXPECT_NE(r.out.find("11 passed, 0 failed on 2 rank(s)"), std::string::npos) << r.log();
  // Without restarts the same failure is final.
  const auto again_dir = make_temp_dir("restart");
  const auto once = run(launch({"--num_processes", "2"}, {"fail_once", again_dir}), test_env(), 60);
  EXPECT_EQ(once.exit_code, 3) << once.log();
}

TEST(Launch, TwoLaunchersFormOneFourRankGroup) {
  const std::string port = std::to_string(distributed::find_free_port());
  auto machine = [&](int rank) {
    return launch(
        {"--num_processes", "4", "--num_machines", "2", "--machine_rank", std::to_string(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", port},
        {"collectives"});
  };
  const auto [r0, r1] = run_pair(machine(0), test_env(), machine(1), test_env(), 120);
  ASSERT_EQ(r0.exit_code, 0) << r0.log() << r1.log();
  ASSERT_EQ(r1.exit_code, 0) << r0.log() << r1.log();
  EXPECT_NE(r0.out.find("[rank 0] difftrain test: 11 passed, 0 failed on 4 rank(s)"),
            std::string::npos)
      << r0.log();
  EXPECT_NE(
      r0.out.find("[rank 0] difftrain test: 4 rank(s), backend gloo, rendezvous 127.0.0.1:" + port),
      std::string::npos)
      << r0.log();
  // Machine 1 runs global ranks 2 and 3.
  EXPECT_EQ(count(r1.out, "[rank 0]"), 0u) << r1.log();
  EXPECT_EQ(r1.out.find("[FAIL]"), std::string::npos) << r1.log();
}

TEST(Launch, ARankFailingOnOneMachineStopsTheOther) {
  const std::string port = std::to_string(distributed::find_free_port());
  auto machine = [&](int rank) {
    return launch(
        {"--num_processes", "4", "--num_machines", "2", "--machine_rank", std::to_string(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", port},
        {"exit", "5", "3"});
  };
  const auto [r0, r1] = run_pair(machine(0), test_env(), machine(1), test_env(), 60);
  ASSERT_FALSE(r0.timed_out || r1.timed_out) << r0.log() << r1.log();
  EXPECT_EQ(r1.exit_code, 5) << r1.log();
  EXPECT_EQ(r0.exit_code, 5) << r0.log();
  EXPECT_NE(r0.err.find("stopped this machine's ranks: rank 3 (pid"), std::string::npos)
      << r0.log();
  EXPECT_NE(r0.err.find("on machine 1"), std::string::npos) << r0.log();
  EXPECT_LT(r0.seconds, 20.0);
}

TEST(Launch, RestartsSpanMachines) {
  // Rank 0 on machine 0 fails once; both machines restart together and then pass.
  const std::string port = std::to_string(distributed::find_free_port());
  const auto marker_dir = make_temp_dir("restart");
  auto machine = [&](int rank) {
    return launch(
        {"--num_processes", "4", "--num_machines", "2", "--machine_rank", std::to_string(rank),
         "--main_process_ip", "127.0.0.1", "--main_process_port", port, "--max_restarts", "1"},
        {"fail_once", marker_dir});
  };
  const auto [r0, r1] = run_pair(machine(0), test_env(), machine(1), test_env(), 120);
  EXPECT_EQ(r0.exit_code, 0) << r0.log() << r1.log();
  EXPECT_EQ(r1.exit_code, 0) << r0.log() << r1.log();
  EXPECT_NE(r0.err.find("restarting the group (1/1)"), std::string::npos) << r0.log();
  EXPECT_NE(r1.err.find("another machine failed (rank 0 (pid"), std::string::npos) << r1.log();
  EXPECT_NE(r0.out.find("[rank 0] difftrain test: 11 passed, 0 failed on 4 rank(s)"),
            std::string::npos)
      << r0.log();
}

TEST(Launch, MachineThatNeverArrivesIsNamed) {
  const std::string port = std::to_string(distributed::find_free_port());
  const auto r = run({kDifftrain, "launch", "--num_processes", "2", "--num_machines", "2",
                      "--machine_rank", "0", "--main_process_ip", "127.0.0.1",
                      "--main_process_port", port, "--join_timeout", "2", kWorker, "collectives"},
                     test_env(), 30);
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_NE(
      r.err.find(
          "timed out after 2 s waiting for machine(s) 1 to join the rendezvous at 127.0.0.1:" +
          port),
      std::string::npos)
      << r.log();
}

TEST(Rendezvous, WrongPortIsAClearErrorWithinTheJoinTimeout) {
  const std::string port = std::to_string(distributed::find_free_port());  // nobody listens there
  const auto r = run({kWorker, "collectives"},
                     test_env({{"RANK", "1"},
                               {"WORLD_SIZE", "2"},
                               {"MASTER_ADDR", "127.0.0.1"},
                               {"MASTER_PORT", port},
                               {"DIFFTRAIN_JOIN_TIMEOUT", "3"}}),
                     30);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_LT(r.seconds, 15.0);
  EXPECT_NE(r.err.find("rank 1/2 could not reach the rendezvous at 127.0.0.1:" + port +
                       " within 3 s: is rank 0"),
            std::string::npos)
      << r.log();
}

TEST(Rendezvous, UnresolvableAddressIsAClearError) {
  const auto r = run({kWorker, "collectives"},
                     test_env({{"RANK", "1"},
                               {"WORLD_SIZE", "2"},
                               {"MASTER_ADDR", "no-such-host.invalid"},
                               {"MASTER_PORT", "29500"},
                               {"DIFFTRAIN_JOIN_TIMEOUT", "3"}}),
                     30);
  ASSERT_FALSE(r.timed_out) << r.log();
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_NE(r.err.find("no-such-host.invalid"), std::string::npos) << r.log();
}

TEST(Rendezvous, AbsentRankIsNamedByRankZero) {
  const std::string port = std::to_string(distributed::find_free_port());
  const auto r = run({kWorker, "collectives"},
                     test_env({{"RANK", "0"},
                               {"WORLD_SIZE", "3"},
                               {"MASTER_ADDR", "127.0.0.1"},
                               {"MASTER_PORT", port},
                               {"DIFFTRAIN_JOIN_TIMEOUT", "2"}}),
                     30);
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_NE(r.err.find("rank 0/3: timed out after 2 s waiting for rank(s) 1, 2 to join the "
                       "rendezvous at 127.0.0.1:" +
                       port),
            std::string::npos)
      << r.log();
}

TEST(Rendezvous, TorchrunStyleEnvWithoutTheLauncherWorks) {
  // Two ranks started by hand, as torchrun would: rank 0 hosts the TCP store.
  const std::string port = std::to_string(distributed::find_free_port());
  auto env_for = [&](int rank) {
    return test_env({{"RANK", std::to_string(rank)},
                     {"WORLD_SIZE", "2"},
                     {"LOCAL_RANK", std::to_string(rank)},
                     {"LOCAL_WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", port}});
  };
  expect_hand_started_pair_passes(env_for);
}

TEST(Rendezvous, ASecondJobOnTheSamePortFailsAndTheFirstGoesOn) {
  // Job A: two ranks started by hand (torchrun style) running all-reduces for 15 s. Job B's rank
  // 1 arrives 5 s later on the same MASTER_PORT (its rank 0 could not host the store: the port
  // is taken), so it reaches job A's store. Before the rank claim it overwrote A's key and hung in
  // Gloo's connect to A's ranks, whatever DIFFTRAIN_JOIN_TIMEOUT said.
  const std::string port = std::to_string(distributed::find_free_port());
  auto env_for = [&](int rank) {
    return test_env({{"RANK", std::to_string(rank)},
                     {"WORLD_SIZE", "2"},
                     {"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", port},
                     {"DIFFTRAIN_JOIN_TIMEOUT", "3"}});
  };
  Process a0({kWorker, "loop", "15"}, env_for(0));
  Process a1({kWorker, "loop", "15"}, env_for(1));
  std::this_thread::sleep_for(std::chrono::seconds(5));
  const auto b1 = run({kWorker, "collectives"}, env_for(1), 30);
  const auto ra0 = a0.wait(60);
  const auto ra1 = a1.wait(60);
  ASSERT_FALSE(b1.timed_out) << b1.log();
  EXPECT_EQ(b1.exit_code, 1) << b1.log();
  EXPECT_LT(b1.seconds, 10.0) << b1.log();
  EXPECT_NE(b1.err.find("rank 1 of the rendezvous at 127.0.0.1:" + port +
                        " is already taken: another job uses this MASTER_ADDR:MASTER_PORT"),
            std::string::npos)
      << b1.log();
  // Job A never noticed.
  EXPECT_EQ(ra0.exit_code, 0) << ra0.log();
  EXPECT_EQ(ra1.exit_code, 0) << ra1.log();
  EXPECT_NE(ra0.out.find("loop done"), std::string::npos) << ra0.log();
  EXPECT_NE(ra1.out.find("loop done"), std::string::npos) << ra1.log();
}

TEST(Rendezvous, OpenMpiStyleEnvWorks) {
  const std::string port = std::to_string(distributed::find_free_port());
  auto env_for = [&](int rank) {
    return test_env({{"OMPI_COMM_WORLD_RANK", std::to_string(rank)},
                     {"OMPI_COMM_WORLD_SIZE", "2"},
                     {"OMPI_COMM_WORLD_LOCAL_RANK", std::to_string(rank)},
                     {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                     {"MASTER_ADDR", "127.0.0.1"},
                     {"MASTER_PORT", port}});
  };
  expect_hand_started_pair_passes(env_for);
}

}  // namespace
}  // namespace difftrain::testing
