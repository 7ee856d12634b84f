#pragma once

// One file per command: each adds its subcommand to the app and runs it once parsed.

#include <CLI/CLI.hpp>

#include <cctype>
#include <string>

namespace difftrain::cli {

CLI::App* add_launch_command(CLI::App& app);
int run_launch();

/// The whole command line, as main() runs it (argv[0] is the program); `difftrain launch` also
/// runs it in forked ranks (launch::LaunchOptions::self_main).
int run_cli(int argc, char** argv);

/// Takes `PROGRAM ARGS...` after a `--` of `difftrain launch` out of `args` (CLI11 would read them
/// as its own positionals) and keeps them for run_launch().
void take_launch_program_after_dashes(std::vector<std::string>& args);

CLI::App* add_config_command(CLI::App& app);
int run_config();

CLI::App* add_env_command(CLI::App& app);
int run_env();

CLI::App* add_test_command(CLI::App& app);
int run_test();

CLI::App* add_sample_command(CLI::App& app);
int run_sample();

CLI::App* add_forward_command(CLI::App& app);
int run_forward();

/// How --help shows a family option's value (train::OptionSpec::type): INT, FLOAT, TEXT, ...
inline std::string option_type_name(std::string type) {
  if (!type.empty() && type.back() == '?') type.pop_back();
  if (type == "string") return "TEXT";
  for (auto& c : type) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return type;
}

/// The registered families' own commands (families::FamilyCommand), one subcommand each.
void add_family_commands(CLI::App& app);
/// Whether one of them was parsed, and runs it (family_commands.cpp).
bool family_command_parsed();
int run_family_command();

CLI::App* add_train_command(CLI::App& app);
int run_train();
/// Takes everything after `difftrain train` out of `args` (the trainer parses its own options,
/// which may also come from YAML) and keeps it for run_train().
void take_train_args(std::vector<std::string>& args);
/// `difftrain lora merge ...` (cli/lora.cpp).
CLI::App* add_lora_command(CLI::App& app);
int run_lora();
/// `difftrain merge-weights CHECKPOINT_DIR OUTPUT_DIR` (cli/merge_weights.cpp).
CLI::App* add_merge_weights_command(CLI::App& app);
int run_merge_weights();
/// `difftrain estimate-memory ...` (cli/estimate_memory.cpp).
CLI::App* add_estimate_memory_command(CLI::App& app);
int run_estimate_memory();
/// `difftrain tokenize --model DIR (--prompt P | --prompt_file F)` (cli/tokenize.cpp).
CLI::App* add_tokenize_command(CLI::App& app);
int run_tokenize();

}  // namespace difftrain::cli
