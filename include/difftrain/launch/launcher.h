#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace difftrain::launch {

/// Settings of `difftrain launch` (Accelerate: `accelerate launch`; torchrun's
/// --nproc_per_node/--nnodes/--node_rank/--master_addr/--master_port/--max_restarts).
struct LaunchOptions {
  std::vector<std::string> command;  ///< program and its arguments
  int num_processes = 1;             ///< ranks over all machines
  int num_machines = 1;
  int machine_rank = 0;
  std::string main_process_ip;          ///< machine 0's address; required when num_machines > 1
  int main_process_port = 0;            ///< 0 = pick a free port (one machine only)
  int num_cpu_threads_per_process = 0;  ///< 0 = cores / local ranks
  std::string mixed_precision = "no";   ///< passed on as DIFFTRAIN_MIXED_PRECISION
  int gradient_accumulation_steps = 1;  ///< passed on as DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS
  int max_restarts = 0;                 ///< restart the whole group up to this often
  std::string log_dir;                  ///< also write rank<r>.log per rank here
  double term_timeout_s = 5.0;          ///< SIGTERM -> SIGKILL grace period
  double join_timeout_s =
      0;  ///< > 0: how long machines and ranks wait to join; else DIFFTRAIN_JOIN_TIMEOUT or 60 s
  double collective_timeout_s = 0;  ///< > 0: DIFFTRAIN_COLLECTIVE_TIMEOUT for the ranks
  std::map<std::string, std::string> extra_env;  ///< more variables for every rank
  /// The launching program's own main(). When set and the command is this very executable, a
  /// rank is a fork() of the launcher that runs self_main with the rank's environment and argv
  /// instead of exec'ing the program again: the rank skips the program's start-up (LibTorch's
  /// static initialisation, about 0.4 s here). Taken only while the launcher is single-threaded;
  /// DIFFTRAIN_LAUNCH_EXEC=1 always execs.
  std::function<int(int argc, char** argv)> self_main;
};

/// Checks the options; throws difftrain::Error naming the bad flag and the fix.
void validate(const LaunchOptions& options);

/// Runs `options.command` once per local rank with the torchrun environment (RANK, WORLD_SIZE,
/// LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK/NODE_RANK, MASTER_ADDR, MASTER_PORT) and difftrain's
/// own (DIFFTRAIN_*), prefixes every output line with `[rank r]`, and supervises the group:
/// when a rank fails every other rank is stopped (SIGTERM, SIGKILL after term_timeout_s) and the
/// launcher returns that rank's exit code (128 + signal when it was killed), or restarts the group
/// while max_restarts allows. SIGINT/SIGTERM/SIGHUP to the launcher are forwarded to every rank.
/// Returns the exit code for the launcher's process; throws difftrain::Error for bad options or
/// when machines cannot meet.
int run(const LaunchOptions& options);

/// The join timeout in force: --join_timeout, else DIFFTRAIN_JOIN_TIMEOUT, else 60 s.
double join_timeout_seconds(const LaunchOptions& options);

/// Default thread count per rank: available cores divided by local ranks, at least 1.
int default_threads_per_process(int local_processes);

}  // namespace difftrain::launch
