// Fault injection on real `difftrain train` processes (issue 9, reliability): damaged checkpoints,
// SIGKILL at random moments of a save, kill -9 of a random rank under `difftrain launch
// --max_restarts`, a full disk during a save, and a stalled (SIGSTOPped) rank. Every random choice
// comes from a seeded RNG whose seed is printed (DIFFTRAIN_FAULT_SEED overrides it), and every
// test prints the facts it checks. DIFFTRAIN_FAULT_TRIALS sets the number of random SIGKILL
// trials (default 6; the long run in docs/RELIABILITY.md uses 100 or more).

#include "subprocess.h"
#include "train_util.h"

#include "difftrain/accel/checkpoint_manifest.h"
#include "difftrain/core/error.h"
#include "difftrain/train/trainer.h"

#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <random>
#include <regex>
#include <sstream>
#include <thread>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

uint64_t fault_seed(uint64_t fallback) {
  const char* env = std::getenv("DIFFTRAIN_FAULT_SEED");
  return env && *env ? std::strtoull(env, nullptr, 10) : fallback;
}

int fault_trials() {
  const char* env = std::getenv("DIFFTRAIN_FAULT_TRIALS");
  return env && *env ? std::max(1, std::atoi(env)) : 6;
}

std::vector<std::string> with_binary(const std::vector<std::string>& cmd) {
  std::vector<std::string> argv = {kDifftrain};
  argv.insert(argv.end(), cmd.begin(), cmd.end());
  return argv;
}

std::vector<std::string> under_launch(const std::vector<std::string>& launch_args,
                                      const std::vector<std::string>& cmd) {
  std::vector<std::string> argv = {kDifftrain, "launch"};
  argv.insert(argv.end(), launch_args.begin(), launch_args.end());
  argv.push_back(kDifftrain);
  argv.insert(argv.end(), cmd.begin(), cmd.end());
  return argv;
}

int64_t metric_lines(const std::string& out) {
  std::ifstream in(out + "/metrics.jsonl");
  int64_t n = 0;
  for (std::string line; std::getline(in, line);) n += !line.empty();
  return n;
}

// The pid of rank `rank` among the launcher's children, or -1: their RANK variable when they were
// exec'd, their name (difftrain-r<rank>) when they are forks of the launcher running difftrain.
pid_t rank_pid(pid_t launcher, int rank) {
  for (const auto& entry : fs::directory_iterator("/proc")) {
    const std::string name = entry.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::ifstream stat(entry.path() / "stat");
    std::string line;
    std::getline(stat, line);
    const auto close = line.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(line.substr(close + 2));
    char state = 0;
    pid_t ppid = 0;
    rest >> state >> ppid;
    if (ppid != launcher) continue;
    std::string comm;
    std::getline(std::ifstream(entry.path() / "comm"), comm);
    if (comm == "difftrain-r" + std::to_string(rank)) return static_cast<pid_t>(std::stol(name));
    std::ifstream env(entry.path() / "environ", std::ios::binary);
    const std::string want = "RANK=" + std::to_string(rank);
    for (std::string var; std::getline(env, var, '\0');) {
      if (var == want) return static_cast<pid_t>(std::stol(name));
    }
  }
  return -1;
}

// Waits until `ready()` or `timeout_s`; false on timeout.
template <typename F>
bool wait_for(F ready, double timeout_s, std::chrono::microseconds poll) {
  const auto deadline = Clock::now() + std::chrono::duration<double>(timeout_s);
  while (!ready()) {
    if (Clock::now() > deadline) return false;
    std::this_thread::sleep_for(poll);
  }
  return true;
}

std::vector<std::string> leftover_temps(const std::string& out) {
  std::vector<std::string> found;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(out, ec)) {
    const std::string name = e.path().filename().string();
    if (name.size() > 4 && name.substr(name.size() - 4) == ".tmp") found.push_back(name);
  }
  return found;
}

void flip_byte(const std::string& path, int64_t offset_from_end) {
  std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
  f.seekg(-offset_from_end, std::ios::end);
  char c = 0;
  f.get(c);
  f.seekp(-offset_from_end, std::ios::end);
  f.put(static_cast<char>(c ^ 0x40));
}

// 1. A corrupted newest checkpoint: `latest` warns, names it and why, and resumes from the one
// before; naming it explicitly is an error (exit 1) that names the damaged file.
TEST(Fault, CorruptedNewestCheckpointFallsBackToThePreviousGoodOne) {
  const auto dir = make_temp_dir("fault_corrupt");
  const std::string out = dir + "/out";
  const std::vector<std::string> args = {
      "--max_train_steps", "4",    "--checkpointing_steps", "2", "--train_batch_size", "4",
      "--use_ema",         "false"};
  const auto first = run(with_binary(train_cmd(dir, out, args)), {}, 120);
  ASSERT_EQ(first.exit_code, 0) << first.log();
  ASSERT_TRUE(accel::verify_checkpoint(out + "/checkpoint-4"));
  const auto straight = unet_weights(out);
  const std::string damaged = out + "/checkpoint-4/model.safetensors";
  flip_byte(damaged, 100);

  auto named = train_cmd(dir, out, args);
  named.insert(named.end(), {"--resume_from_checkpoint", out + "/checkpoint-4"});
  const auto refused = run(with_binary(named), {}, 120);
  std::printf("explicit corrupted checkpoint: exit %d\n", refused.exit_code);
  EXPECT_EQ(refused.exit_code, 1) << refused.log();
  EXPECT_NE(refused.err.find("checkpoint file '" + damaged + "' is corrupted (crc32 mismatch"),
            std::string::npos)
      << refused.log();

  EXPECT_EQ(train::latest_checkpoint(out), out + "/checkpoint-2");
  auto latest = train_cmd(dir, out, args);
  latest.insert(latest.end(), {"--resume_from_checkpoint", "latest"});
  const auto resumed = run(with_binary(latest), {}, 120);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.log();
  const bool warned = resumed.err.find("skipping " + out + "/checkpoint-4: checkpoint file '" +
                                       damaged + "' is corrupted") != std::string::npos;
  const bool fell_back =
      resumed.err.find("resumed from " + out + "/checkpoint-2 at step 2") != std::string::npos;
  // The resumed run re-saved checkpoint-4 and ends with the uninterrupted run's weights.
  const double diff = max_abs_diff(straight, unet_weights(out));
  std::printf(
      "latest: warned about checkpoint-4 %d, resumed from checkpoint-2 %d, "
      "checkpoint-4 verifies again %d, max abs diff to the straight run %.3g (must be 0)\n",
      warned, fell_back, accel::verify_checkpoint(out + "/checkpoint-4"), diff);
  EXPECT_TRUE(warned) << resumed.log();
  EXPECT_TRUE(fell_back) << resumed.log();
  EXPECT_EQ(diff, 0.0);
}

// 2. SIGKILL from outside at a random moment of a random save: 0-60 ms after its
// `checkpoint-<k>.tmp` folder appears (a save of this tiny model, an fsync per file, takes
// ~10-50 ms here), so while files are written, during the manifest and rename, or just after.
// Every `checkpoint-<n>` folder left then verifies, `latest` is never a `.tmp` and is at least
// checkpoint-<k-1>, and resuming from it finishes the run.
TEST(Fault, SigkillAtRandomMomentsOfASaveLeavesAVerifyingLatest) {
  const uint64_t seed = fault_seed(20261124);
  const int trials = fault_trials();
  std::mt19937_64 rng(seed);
  std::printf("DIFFTRAIN_FAULT_SEED %llu, DIFFTRAIN_FAULT_TRIALS %d\n",
              static_cast<unsigned long long>(seed), trials);
  const auto dir = make_temp_dir("fault_sigkill");
  const std::vector<std::string> args = {"--max_train_steps",  "8", "--checkpointing_steps", "1",
                                         "--train_batch_size", "4"};
  int in_save = 0, after_save = 0, finished_first = 0;
  for (int t = 0; t < trials; ++t) {
    const std::string out = dir + "/trial" + std::to_string(t);
    const int step = std::uniform_int_distribution<int>(1, 5)(rng);
    const int delay_us = std::uniform_int_distribution<int>(0, 60000)(rng);
    Process p(with_binary(train_cmd(dir, out, args)));
    const std::string temp = out + "/checkpoint-" + std::to_string(step) + ".tmp";
    const bool saw = wait_for([&] { return fs::exists(temp); }, 60, std::chrono::microseconds(200));
    std::this_thread::sleep_for(std::chrono::microseconds(delay_us));
    const bool renamed = fs::exists(out + "/checkpoint-" + std::to_string(step));
    p.signal(SIGKILL);
    const auto r = p.wait(60);
    ASSERT_TRUE(saw) << "trial " << t << ": " << temp << " never appeared\n" << r.log();
    const bool killed = r.term_signal == SIGKILL;
    if (!killed) {
      ASSERT_EQ(r.exit_code, 0) << r.log();  // the run was faster than the delay: no fault
      ++finished_first;
    } else {
      (renamed ? after_save : in_save) += 1;
    }
    const std::string latest = train::latest_checkpoint(out);
    // Every folder under its final name is complete and verifies.
    int folders = 0, bad = 0;
    static const std::regex kName(R"(checkpoint-(\d+))");
    for (const auto& e : fs::directory_iterator(out)) {
      if (!std::regex_match(e.path().filename().string(), kName)) continue;
      ++folders;
      try {
        if (!fs::exists(e.path() / "trainer_state.json") || !accel::verify_checkpoint(e.path()))
          ++bad;
      } catch (const Error& err) {
        ++bad;
        ADD_FAILURE() << "trial " << t << ": " << err.what();
      }
    }
    std::printf(
        "trial %d: SIGKILL %5d us after %s appeared (%s) -> %d checkpoint folders, %d bad; "
        "latest '%s'\n",
        t, delay_us, fs::path(temp).filename().c_str(),
        !killed   ? "run already finished"
        : renamed ? "save done"
                  : "save in progress",
        folders, bad, fs::path(latest).filename().c_str());
    EXPECT_EQ(bad, 0) << "trial " << t;
    EXPECT_EQ(latest.find(".tmp"), std::string::npos);
    if (step > 1) {
      EXPECT_FALSE(latest.empty()) << "trial " << t;
      const int64_t latest_step = std::stoll(latest.substr(latest.rfind('-') + 1));
      EXPECT_GE(latest_step, step - 1) << "trial " << t << ": latest " << latest;
    }
    auto cmd = train_cmd(dir, out, args);
    cmd.insert(cmd.end(), {"--resume_from_checkpoint", "latest"});
    const auto resumed = run(with_binary(cmd), {}, 120);
    ASSERT_EQ(resumed.exit_code, 0) << "trial " << t << "\n" << resumed.log();
    if (!latest.empty()) {
      EXPECT_NE(resumed.err.find("resumed from " + latest), std::string::npos) << resumed.log();
    }
    EXPECT_TRUE(accel::verify_checkpoint(out + "/checkpoint-8"));
    EXPECT_TRUE(fs::exists(out + "/unet/diffusion_pytorch_model.safetensors"));
    EXPECT_TRUE(leftover_temps(out).empty()) << "trial " << t;
    fs::remove_all(out);
  }
  std::printf("%d of %d kills landed inside a save, %d just after it; %d runs finished first\n",
              in_save, trials, after_save, finished_first);
  EXPECT_GT(in_save, 0);
}

// 3. kill -9 of a random rank at a random step under `difftrain launch --max_restarts 1`: the
// launcher restarts the group, the trainer resumes from the newest checkpoint, and the exported
// weights are bit-identical to an uninterrupted run (the resume is exact: model, optimizer,
// scheduler, loader position and every rank's RNG are in the checkpoint, and the steps after it
// are recomputed the same way).
TEST(Fault, KilledRankIsRestartedAndTheRunMatchesAnUninterruptedOne) {
  const uint64_t seed = fault_seed(20261124);
  std::mt19937_64 rng(seed + 3);
  const int rank = std::uniform_int_distribution<int>(0, 1)(rng);
  const int step = std::uniform_int_distribution<int>(1, 7)(rng);
  std::printf("DIFFTRAIN_FAULT_SEED %llu: kill -9 rank %d once step %d is logged\n",
              static_cast<unsigned long long>(seed), rank, step);
  const auto dir = make_temp_dir("fault_rank");
  const std::vector<std::string> args = {
      "--max_train_steps",  "8",    "--checkpointing_steps",    "3",
      "--train_batch_size", "4",    "--resume_from_checkpoint", "latest",
      "--use_ema",          "false"};
  const std::vector<std::string> launch = {"--num_processes", "2", "--max_restarts", "1"};
  const auto straight = run(under_launch(launch, train_cmd(dir, dir + "/straight", args)), {}, 180);
  ASSERT_EQ(straight.exit_code, 0) << straight.log();

  const std::string out = dir + "/faulty";
  Process p(under_launch(launch, train_cmd(dir, out, args)));
  const bool reached =
      wait_for([&] { return metric_lines(out) >= step; }, 120, std::chrono::milliseconds(2));
  const pid_t victim = rank_pid(p.pid(), rank);
  if (victim > 0) ::kill(victim, SIGKILL);
  const auto r = p.wait(180);
  ASSERT_TRUE(reached) << r.log();
  ASSERT_GT(victim, 0) << "rank " << rank << " not found among the launcher's children";
  const bool restarted = r.err.find("killed by SIGKILL") != std::string::npos &&
                         r.err.find("restarting the group (1/1)") != std::string::npos;
  const auto at = r.err.find("resumed from");
  const std::string resumed_line =
      at == std::string::npos ? "(no resume)" : r.err.substr(at, r.err.find('\n', at) - at);
  const double diff = max_abs_diff(unet_weights(dir + "/straight"), unet_weights(out));
  std::printf(
      "killed pid %d (rank %d) at step >= %d: exit %d, restarted %d, %s; max abs diff to "
      "the uninterrupted run %.3g (must be 0)\n",
      victim, rank, step, r.exit_code, restarted, resumed_line.c_str(), diff);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_TRUE(restarted) << r.log();
  EXPECT_EQ(diff, 0.0);
}

// 4. A full disk during the second checkpoint (a file-size limit, RLIMIT_FSIZE with SIGXFSZ
// ignored, so writes fail with EFBIG as they would with ENOSPC): a one-line error naming the file
// and the full disk, a non-zero exit, the previous checkpoint intact and verifying, and no
// half-written folder left for `latest`.
TEST(Fault, DiskFullDuringASaveIsAClearErrorAndKeepsThePreviousCheckpoint) {
  const auto dir = make_temp_dir("fault_disk");
  const std::string out = dir + "/out";
  const std::vector<std::string> common = {
      "--checkpointing_steps", "2", "--train_batch_size", "4", "--use_ema", "false"};
  auto first = train_cmd(dir, out, common);
  first.insert(first.end(), {"--max_train_steps", "2"});
  const auto r1 = run(with_binary(first), {}, 120);
  ASSERT_EQ(r1.exit_code, 0) << r1.log();
  ASSERT_TRUE(accel::verify_checkpoint(out + "/checkpoint-2"));

  // 64 blocks (32 KiB in dash's 512-byte blocks, 64 KiB in bash's): the JSON files and logs fit,
  // model.safetensors (~190 KiB) does not.
  auto second = train_cmd(dir, out, common);
  second.insert(second.end(), {"--max_train_steps", "4", "--resume_from_checkpoint", "latest"});
  std::vector<std::string> argv = {"/bin/sh", "-c", "trap '' XFSZ; ulimit -f 64; exec \"$@\"", "sh",
                                   kDifftrain};
  argv.insert(argv.end(), second.begin(), second.end());
  const auto r2 = run(argv, {}, 120);
  std::string error_line;
  for (size_t pos = 0; pos < r2.err.size();) {
    const auto end = r2.err.find('\n', pos);
    const std::string line = r2.err.substr(pos, end - pos);
    if (line.find("difftrain: error:") != std::string::npos) error_line = line;
    pos = end == std::string::npos ? r2.err.size() : end + 1;
  }
  const std::string latest = train::latest_checkpoint(out);
  std::printf("exit %d; error: %s\nlatest '%s', checkpoint-2 verifies %d, leftover .tmp %zu\n",
              r2.exit_code, error_line.c_str(), latest.c_str(),
              accel::verify_checkpoint(out + "/checkpoint-2"), leftover_temps(out).size());
  EXPECT_NE(r2.exit_code, 0) << r2.log();
  EXPECT_NE(error_line.find("cannot write '" + out + "/checkpoint-4.tmp/"), std::string::npos)
      << r2.log();
  EXPECT_NE(error_line.find("the disk is full"), std::string::npos) << r2.log();
  EXPECT_TRUE(accel::verify_checkpoint(out + "/checkpoint-2"));
  EXPECT_EQ(latest, out + "/checkpoint-2");
  EXPECT_FALSE(fs::exists(out + "/checkpoint-4"));
  EXPECT_TRUE(leftover_temps(out).empty()) << r2.log();
}

// 5. A stalled rank (SIGSTOP) under `difftrain launch --collective_timeout 8`: the other rank's
// all-reduce times out, it names the stalled rank, and the launcher tears the job down (SIGKILL
// reaches a stopped process) with a non-zero exit, well before the test's own hard limit.
TEST(Fault, StalledRankIsNamedAndTheJobIsTornDownAfterTheCollectiveTimeout) {
  const uint64_t seed = fault_seed(20261124);
  std::mt19937_64 rng(seed + 5);
  const int rank = std::uniform_int_distribution<int>(0, 1)(rng);
  const int step = std::uniform_int_distribution<int>(2, 4)(rng);
  const double timeout_s = 8;
  std::printf(
      "DIFFTRAIN_FAULT_SEED %llu: SIGSTOP rank %d once step %d is logged; collective timeout %g "
      "s\n",
      static_cast<unsigned long long>(seed), rank, step, timeout_s);
  const auto dir = make_temp_dir("fault_stall");
  const std::string out = dir + "/out";
  Process p(
      under_launch({"--num_processes", "2", "--collective_timeout", "8", "--term_timeout", "2"},
                   train_cmd(dir, out,
                             {"--max_train_steps", "100000", "--checkpointing_steps", "0",
                              "--train_batch_size", "4", "--use_ema", "false"})));
  const bool reached =
      wait_for([&] { return metric_lines(out) >= step; }, 120, std::chrono::milliseconds(2));
  const pid_t victim = rank_pid(p.pid(), rank);
  if (victim > 0) ::kill(victim, SIGSTOP);
  const auto stopped_at = Clock::now();
  // Hard limit: the timeout, the lost-rank probe (<= 10 s), the launcher's grace, and a margin.
  const auto r = p.wait(60);
  const double took = std::chrono::duration<double>(Clock::now() - stopped_at).count();
  if (victim > 0) ::kill(victim, SIGKILL);  // never leave a stopped process behind
  ASSERT_TRUE(reached) << r.log();
  ASSERT_GT(victim, 0) << "rank " << rank << " not found among the launcher's children";
  std::string error_line;
  for (size_t pos = 0; pos < r.err.size();) {
    const auto end = r.err.find('\n', pos);
    const std::string line = r.err.substr(pos, end - pos);
    if (line.find("timed out") != std::string::npos ||
        line.find("failed after") != std::string::npos)
      error_line = line;
    pos = end == std::string::npos ? r.err.size() : end + 1;
  }
  std::printf("stopped pid %d (rank %d): job ended %.1f s later with exit %d (timed out %d)\n%s\n",
              victim, rank, took, r.exit_code, r.timed_out, error_line.c_str());
  EXPECT_FALSE(r.timed_out) << r.log();
  EXPECT_NE(r.exit_code, 0) << r.log();
  EXPECT_LT(took, timeout_s + 10 + 2 + 10) << r.log();
  EXPECT_NE(error_line.find("rank " + std::to_string(1 - rank) + "/2"), std::string::npos)
      << r.log();
  EXPECT_NE(error_line.find("rank(s) " + std::to_string(rank) + " "), std::string::npos) << r.log();
  EXPECT_NE(error_line.find("stalled, stopped or dead"), std::string::npos) << r.log();
}

}  // namespace
}  // namespace difftrain::testing
