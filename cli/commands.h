#pragma once

// One file per command: each adds its subcommand to the app and runs it once parsed.

#include <CLI/CLI.hpp>

namespace difftrain::cli {

CLI::App* add_launch_command(CLI::App& app);
int run_launch();

CLI::App* add_config_command(CLI::App& app);
int run_config();

CLI::App* add_env_command(CLI::App& app);
int run_env();

CLI::App* add_test_command(CLI::App& app);
int run_test();

}  // namespace difftrain::cli
