#include "commands.h"
#include "difftrain/launch/launcher.h"
#include "difftrain/launch/resolve.h"

#include <algorithm>
#include <iostream>
#include <map>
#include <string>
#include <vector>

namespace difftrain::cli {

namespace {

launch::LaunchFlags g_flags_in;
launch::LaunchOptions& g_options = g_flags_in.options;
CLI::App* g_cmd = nullptr;
std::map<std::string, CLI::Option*> g_flags;
std::vector<std::string> g_after_dashes;

// Flag names as Accelerate spells them; the dashed spelling works too.
template <typename T>
CLI::Option* flag(const std::string& name, T& target, const std::string& help,
                  const std::string& short_name = "") {
  std::string dashed = name;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  auto* option = g_cmd->add_option((short_name.empty() ? "" : "-" + short_name + ",") + "--" +
                                       name + (dashed != name ? ",--" + dashed : ""),
                                   target, help);
  g_flags[name] = option;
  return option;
}

}  // namespace

CLI::App* add_launch_command(CLI::App& app) {
  g_cmd = app.add_subcommand(
      "launch",
      "Run PROGRAM once per rank, like `accelerate launch` / torchrun: difftrain launch [options] "
      "PROGRAM [ARGS...]");
  g_cmd->prefix_command();  // everything from PROGRAM on belongs to the program
  flag("num_processes", g_options.num_processes, "Ranks in total, over all machines (default 1)",
       "n");
  flag("num_machines", g_options.num_machines, "Machines in the job (default 1)");
  flag("machine_rank", g_options.machine_rank, "This machine's index, 0 = main (default 0)");
  flag("main_process_ip", g_options.main_process_ip, "Address of machine 0 (multi-machine)");
  flag("main_process_port", g_options.main_process_port,
       "Rendezvous port on machine 0 (0 = any free port; one machine needs no port at all)");
  flag("num_cpu_threads_per_process", g_options.num_cpu_threads_per_process,
       "Intra-op threads per rank (0 = cores / local ranks); sets OMP_NUM_THREADS");
  flag("mixed_precision", g_options.mixed_precision, "no | fp16 | bf16 (DIFFTRAIN_MIXED_PRECISION)")
      ->check(CLI::IsMember({"no", "fp16", "bf16"}));
  flag("gradient_accumulation_steps", g_options.gradient_accumulation_steps,
       "Passed on as DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS (default 1)");
  flag("max_restarts", g_options.max_restarts,
       "Restart the whole group up to K times after a failure (default 0)");
  flag("log_dir", g_options.log_dir, "Also write each rank's output to DIR/rank<r>.log");
  flag("term_timeout", g_options.term_timeout_s,
       "Seconds between SIGTERM and SIGKILL when stopping ranks (default 5)");
  flag("join_timeout", g_options.join_timeout_s,
       "Seconds machines and ranks wait for each other to join (default 60)");
  flag("collective_timeout", g_options.collective_timeout_s,
       "Seconds one collective may wait for its peers before failing (default 1800)");
  g_cmd->add_flag_callback(
      "--cpu", []() { g_options.extra_env["DIFFTRAIN_BACKEND"] = "gloo"; },
      "Run on the CPU with Gloo even in a CUDA build (Accelerate's --cpu)");
  flag("sharding_strategy", g_flags_in.sharding_strategy,
       "NO_SHARD | SHARD_OPTIMIZER | SHARD_GRAD_OP | FULL_SHARD (or zero0..zero3): passed on as "
       "DIFFTRAIN_SHARDING_STRATEGY (with the DIFFTRAIN_FSDP_* defaults)");
  flag(
      "offload_optimizer_device", g_flags_in.offload_optimizer_device,
      "none | cpu: ZeRO-Offload of the master weights, gradients and optimizer state to host "
      "memory, stepped on the CPU (needs a sharding strategy); DIFFTRAIN_OFFLOAD_OPTIMIZER_DEVICE");
  flag("offload_param_device", g_flags_in.offload_param_device,
       "none | cpu: FULL_SHARD's parameter shards in host memory too; "
       "DIFFTRAIN_OFFLOAD_PARAM_DEVICE");
  flag("deepspeed_config_file", g_flags_in.deepspeed_config_file,
       "DeepSpeed JSON config: its ZeRO stage, fp16/bf16 and gradient_accumulation_steps are "
       "passed on to the ranks (wins over the config file's)");
  auto* config = g_cmd->add_option("--config_file,--config-file", g_flags_in.config_file,
                                   "Launch config YAML (difftrain's or Accelerate's); default: "
                                   "the one `difftrain config` wrote, if any");
  (void)config;
  g_cmd->footer(
      "Environment of each rank: RANK WORLD_SIZE LOCAL_RANK LOCAL_WORLD_SIZE GROUP_RANK NODE_RANK "
      "MASTER_ADDR MASTER_PORT OMP_NUM_THREADS DIFFTRAIN_NUM_THREADS DIFFTRAIN_MIXED_PRECISION "
      "DIFFTRAIN_GRADIENT_ACCUMULATION_STEPS DIFFTRAIN_RESTART_COUNT DIFFTRAIN_LAUNCHED=1; with "
      "sharding (distributed_type FSDP/DEEPSPEED, --sharding_strategy, --deepspeed_config_file) "
      "also DIFFTRAIN_SHARDING_STRATEGY DIFFTRAIN_FSDP_AUTO_WRAP_POLICY "
      "DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP DIFFTRAIN_FSDP_MIN_NUM_PARAMS "
      "DIFFTRAIN_FSDP_FORWARD_PREFETCH DIFFTRAIN_FSDP_BACKWARD_PREFETCH "
      "DIFFTRAIN_SYNC_EACH_BATCH DIFFTRAIN_OFFLOAD_OPTIMIZER_DEVICE "
      "DIFFTRAIN_OFFLOAD_PARAM_DEVICE.\n"
      "Precedence: flags > config file > defaults.");
  return g_cmd;
}

void take_launch_program_after_dashes(std::vector<std::string>& args) {
  if (args.size() < 2 || args[1] != "launch") return;
  for (size_t i = 2; i < args.size(); ++i) {
    if (args[i] == "--") {
      g_after_dashes.assign(args.begin() + static_cast<long>(i) + 1, args.end());
      args.resize(i);
      return;
    }
    if (!args[i].empty() && args[i][0] != '-') {
      // A value of an option or the PROGRAM itself: only a `--` before PROGRAM matters, and
      // prefix_command() handles everything after PROGRAM.
      const std::string& previous = args[i - 1];
      const bool takes_value = previous != "--cpu" && previous != "--help" && previous != "-h";
      const bool is_flag = previous.rfind("--", 0) == 0 || previous == "-n";
      if (i > 2 && takes_value && is_flag && previous.find('=') == std::string::npos) {
        continue;
      }
      return;
    }
  }
}

int run_launch() {
  g_options.command = g_cmd->remaining();
  if (g_options.command.empty()) g_options.command = g_after_dashes;
  for (const auto& [name, option] : g_flags) {
    if (option->count() > 0) g_flags_in.given.insert(name);
  }
  launch::LaunchOptions options = launch::resolve_launch_options(
      g_flags_in, [](const std::string& line) { std::cerr << line << "\n"; });
  options.self_main = run_cli;
  return launch::run(options);
}

}  // namespace difftrain::cli
