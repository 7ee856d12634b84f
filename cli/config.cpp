#include "difftrain/launch/config.h"
#include "commands.h"
#include "difftrain/core/error.h"

#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <iostream>

namespace difftrain::cli {

namespace {

CLI::App* g_cmd = nullptr;
CLI::App* g_show = nullptr;
std::string g_config_file;
std::string g_show_file;
launch::LaunchConfig g_flags_config;
struct Values {
  int num_processes = 1, num_machines = 1, machine_rank = 0, main_process_port = 29500;
  int num_cpu_threads_per_process = 0, gradient_accumulation_steps = 1, max_restarts = 0;
  std::string main_process_ip, mixed_precision = "no", log_dir;
} g_values;
std::vector<CLI::Option*> g_value_options;

template <typename T>
CLI::Option* flag(const std::string& name, T& target, const std::string& help) {
  std::string dashed = name;
  std::replace(dashed.begin(), dashed.end(), '_', '-');
  auto* option = g_cmd->add_option("--" + name + ",--" + dashed, target, help);
  g_value_options.push_back(option);
  return option;
}

template <typename T>
void take(const std::string& name, std::optional<T>& target, const T& value) {
  for (auto* o : g_value_options) {
    if (o->check_lname(name) && o->count() > 0) target = value;
  }
}

}  // namespace

CLI::App* add_config_command(CLI::App& app) {
  g_cmd = app.add_subcommand(
      "config",
      "Write the default launch config (like `accelerate config`): asks questions on a terminal, "
      "else takes flags; `difftrain config show` prints a config and what it cannot honour");
  g_cmd->add_option("--config_file,--config-file", g_config_file,
                    "Where to write (default $XDG_CACHE_HOME/difftrain/default_config.yaml)");
  flag("num_processes", g_values.num_processes, "Ranks in total");
  flag("num_machines", g_values.num_machines, "Machines");
  flag("machine_rank", g_values.machine_rank, "This machine's index");
  flag("main_process_ip", g_values.main_process_ip, "Address of machine 0");
  flag("main_process_port", g_values.main_process_port, "Rendezvous port of machine 0");
  flag("num_cpu_threads_per_process", g_values.num_cpu_threads_per_process,
       "Threads per rank (0 = auto)");
  flag("mixed_precision", g_values.mixed_precision, "no | fp16 | bf16")
      ->check(CLI::IsMember({"no", "fp16", "bf16"}));
  flag("gradient_accumulation_steps", g_values.gradient_accumulation_steps, "Accumulation steps");
  flag("max_restarts", g_values.max_restarts, "Group restarts after a failure");
  flag("log_dir", g_values.log_dir, "Per-rank log folder");
  g_show = g_cmd->add_subcommand("show", "Print a config file as difftrain reads it");
  g_show->add_option("--config_file,--config-file,file", g_show_file,
                     "The file (default: the default config)");
  return g_cmd;
}

int run_config() {
  if (g_show->parsed()) {
    const std::string path = g_show_file.empty() ? launch::default_config_path() : g_show_file;
    const launch::LaunchConfig c = launch::load_config(path);
    const std::string yaml = launch::config_to_yaml(c);
    std::cout << "# " << path << " as difftrain reads it\n"
              << (yaml.rfind("{}", 0) == 0 ? "# (no settings: every flag keeps its default)\n"
                                           : yaml);
    for (const auto& note : c.notes) std::cout << "# note: " << note << "\n";
    return 0;
  }
  const std::string path = g_config_file.empty() ? launch::default_config_path() : g_config_file;
  const bool any_flag = std::any_of(g_value_options.begin(), g_value_options.end(),
                                    [](CLI::Option* o) { return o->count() > 0; });
  launch::LaunchConfig c;
  if (!any_flag && isatty(STDIN_FILENO)) {
    launch::LaunchConfig defaults;
    if (std::filesystem::exists(path)) {
      try {
        defaults = launch::load_config(path);
      } catch (const Error&) {
        // An unreadable old file is simply replaced.
      }
    }
    c = launch::ask_config(std::cin, std::cout, defaults);
  } else {
    c.compute_environment = "LOCAL_MACHINE";
    take("num_processes", c.num_processes, g_values.num_processes);
    take("num_machines", c.num_machines, g_values.num_machines);
    take("machine_rank", c.machine_rank, g_values.machine_rank);
    take("main_process_ip", c.main_process_ip, g_values.main_process_ip);
    take("main_process_port", c.main_process_port, g_values.main_process_port);
    take("num_cpu_threads_per_process", c.num_cpu_threads_per_process,
         g_values.num_cpu_threads_per_process);
    take("mixed_precision", c.mixed_precision, g_values.mixed_precision);
    take("gradient_accumulation_steps", c.gradient_accumulation_steps,
         g_values.gradient_accumulation_steps);
    take("max_restarts", c.max_restarts, g_values.max_restarts);
    take("log_dir", c.log_dir, g_values.log_dir);
    if (!c.num_processes) c.num_processes = 1;
    if (!c.mixed_precision) c.mixed_precision = "no";
    c.distributed_type = *c.num_processes > 1 ? "MULTI_CPU" : "NO";
  }
  launch::save_config(path, c);
  std::cout << "difftrain config: wrote " << path << "\n" << launch::config_to_yaml(c);
  return 0;
}

}  // namespace difftrain::cli
