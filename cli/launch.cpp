#include "commands.h"
#include "difftrain/accel/sharding.h"
#include "difftrain/accel/sharding_config.h"
#include "difftrain/core/error.h"
#include "difftrain/launch/config.h"
#include "difftrain/launch/launcher.h"

#include <algorithm>
#include <filesystem>
#include <iostream>

namespace difftrain::cli {

namespace {

launch::LaunchOptions g_options;
std::string g_config_file;
std::string g_sharding_strategy;
std::string g_deepspeed_config_file;
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

bool given(const std::string& name) { return g_flags.at(name)->count() > 0; }

// Sharding for the ranks: from the config file (distributed_type FSDP / DEEPSPEED), then
// --deepspeed_config_file, then --sharding_strategy; passed on as DIFFTRAIN_* variables. What
// those files ask for and cannot be honoured is printed here, once.
void take_sharding(const std::string& config_path) {
  accel::ExternalTrainingConfig ext;
  auto print = [](const std::vector<std::string>& warnings, const std::string& skip) {
    for (const auto& w : warnings) {
      if (!skip.empty() && w.rfind(skip, 0) == 0) {
        // "FILE: key=value: why" about a top-level key (no dot): load_config() has reported it.
        const std::string rest = w.substr(skip.size());
        const auto eq = rest.find('=');
        if (eq != std::string::npos && eq < rest.find(':') &&
            rest.substr(0, eq).find('.') == std::string::npos) {
          continue;
        }
      }
      std::cerr << "difftrain launch: warning: " << w << "\n";
    }
  };
  if (!config_path.empty()) {
    ext = accel::read_accelerate_config(config_path);
    print(ext.warnings, config_path + ": ");
  }
  if (!g_deepspeed_config_file.empty()) {
    const accel::ExternalTrainingConfig ds = accel::read_deepspeed_config(g_deepspeed_config_file);
    print(ds.warnings, "");
    if (ds.sharding_set) {
      ext.sharding = ds.sharding;
      ext.sharding_set = true;
    }
    if (ds.mixed_precision) ext.mixed_precision = ds.mixed_precision;
    if (ds.gradient_accumulation_steps)
      ext.gradient_accumulation_steps = ds.gradient_accumulation_steps;
    if (ds.gradient_clipping) ext.gradient_clipping = ds.gradient_clipping;
    if (ds.train_micro_batch_size_per_gpu) {
      ext.train_micro_batch_size_per_gpu = ds.train_micro_batch_size_per_gpu;
    }
  }
  if (given("sharding_strategy")) {
    ext.sharding.strategy =
        accel::parse_sharding_strategy(g_sharding_strategy, "--sharding_strategy");
    ext.sharding_set = true;
  }
  if (ext.sharding_set) {
    for (const auto& [name, value] : accel::sharding_env(ext.sharding)) {
      g_options.extra_env[name] = value;
    }
  }
  if (ext.mixed_precision && !given("mixed_precision")) {
    g_options.mixed_precision = *ext.mixed_precision;
  }
  if (ext.gradient_accumulation_steps && !given("gradient_accumulation_steps")) {
    g_options.gradient_accumulation_steps = static_cast<int>(*ext.gradient_accumulation_steps);
  }
  if (ext.gradient_clipping || ext.train_micro_batch_size_per_gpu) {
    std::cerr << "difftrain launch: note: gradient_clipping and train_micro_batch_size_per_gpu "
                 "are training options the ranks do not get from the launcher: give the same "
                 "file to `difftrain train --deepspeed_config` (or --accelerate_config_file)\n";
  }
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
  flag("sharding_strategy", g_sharding_strategy,
       "NO_SHARD | SHARD_OPTIMIZER | SHARD_GRAD_OP | FULL_SHARD (or zero0..zero3): passed on as "
       "DIFFTRAIN_SHARDING_STRATEGY (with the DIFFTRAIN_FSDP_* defaults)");
  flag("deepspeed_config_file", g_deepspeed_config_file,
       "DeepSpeed JSON config: its ZeRO stage, fp16/bf16 and gradient_accumulation_steps are "
       "passed on to the ranks (wins over the config file's)");
  auto* config = g_cmd->add_option("--config_file,--config-file", g_config_file,
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
      "DIFFTRAIN_SYNC_EACH_BATCH.\n"
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
  // Fill what the flags left unset from the config file.
  std::string path = g_config_file;
  if (path.empty() && std::filesystem::exists(launch::default_config_path())) {
    path = launch::default_config_path();
  }
  if (!path.empty()) {
    const launch::LaunchConfig c = launch::load_config(path);
    for (const auto& note : c.notes)
      std::cerr << "difftrain launch: config " << path << ": " << note << "\n";
    auto take = [&](const std::string& name, auto& target, const auto& value) {
      if (value && !given(name)) target = *value;
    };
    take("num_processes", g_options.num_processes, c.num_processes);
    take("num_machines", g_options.num_machines, c.num_machines);
    take("machine_rank", g_options.machine_rank, c.machine_rank);
    take("main_process_ip", g_options.main_process_ip, c.main_process_ip);
    take("main_process_port", g_options.main_process_port, c.main_process_port);
    take("num_cpu_threads_per_process", g_options.num_cpu_threads_per_process,
         c.num_cpu_threads_per_process);
    take("mixed_precision", g_options.mixed_precision, c.mixed_precision);
    take("gradient_accumulation_steps", g_options.gradient_accumulation_steps,
         c.gradient_accumulation_steps);
    take("max_restarts", g_options.max_restarts, c.max_restarts);
    take("log_dir", g_options.log_dir, c.log_dir);
  }
  take_sharding(path);
  return launch::run(g_options);
}

}  // namespace difftrain::cli
