// difftrain's command line (cli/run.h: run_cli): this file only registers the commands and turns
// exceptions into exit codes. The `difftrain` program is program.cpp.

#include "commands.h"
#include "difftrain/cli/run.h"
#include "difftrain/core/env.h"
#include "difftrain/core/error.h"
#include "difftrain/core/exit.h"
#include "difftrain/core/log.h"
#include "difftrain/version.h"

#include <c10/util/Exception.h>

#include <iostream>

namespace difftrain::cli {

int run_cli(int argc, char** argv) {
  difftrain::log::init();
  difftrain::remember_user_command(argc, argv);
  CLI::App app{"difftrain: distributed training of diffusion models on LibTorch", "difftrain"};
  app.set_version_flag("--version", std::string("difftrain ") + DIFFTRAIN_VERSION);
  app.require_subcommand(1);
  auto* launch = difftrain::cli::add_launch_command(app);
  auto* config = difftrain::cli::add_config_command(app);
  auto* env = difftrain::cli::add_env_command(app);
  auto* test = difftrain::cli::add_test_command(app);
  auto* sample = difftrain::cli::add_sample_command(app);
  auto* forward = difftrain::cli::add_forward_command(app);
  auto* train = difftrain::cli::add_train_command(app);
  auto* lora = difftrain::cli::add_lora_command(app);
  auto* merge_weights = difftrain::cli::add_merge_weights_command(app);
  auto* estimate_memory = difftrain::cli::add_estimate_memory_command(app);
  auto* tokenize = difftrain::cli::add_tokenize_command(app);
  difftrain::cli::add_family_commands(app);
  std::vector<std::string> args(argv, argv + argc);
  difftrain::cli::take_launch_program_after_dashes(args);
  difftrain::cli::take_train_args(args);
  try {
    std::vector<std::string> reversed(args.rbegin(), args.rend() - 1);  // CLI11 wants them reversed
    app.parse(reversed);
  } catch (const CLI::ParseError& e) {
    return app.exit(e);
  }
  try {
    if (launch->parsed()) return difftrain::cli::run_launch();
    if (config->parsed()) return difftrain::cli::run_config();
    if (env->parsed()) return difftrain::cli::run_env();
    if (test->parsed()) return difftrain::cli::run_test();
    if (sample->parsed()) return difftrain::cli::run_sample();
    if (forward->parsed()) return difftrain::cli::run_forward();
    if (train->parsed()) return difftrain::cli::run_train();
    if (lora->parsed()) return difftrain::cli::run_lora();
    if (merge_weights->parsed()) return difftrain::cli::run_merge_weights();
    if (estimate_memory->parsed()) return difftrain::cli::run_estimate_memory();
    if (tokenize->parsed()) return difftrain::cli::run_tokenize();
    if (difftrain::cli::family_command_parsed()) return difftrain::cli::run_family_command();
  } catch (const difftrain::Error& e) {
    std::string message = e.what();
    const std::string own_prefix = "difftrain launch: ";  // the launcher names itself already
    if (message.rfind(own_prefix, 0) == 0) message = message.substr(own_prefix.size());
    std::cerr << "difftrain: error: " << message << std::endl;
    return 1;
  } catch (const c10::Error& e) {
    std::cerr << "difftrain: error: " << e.what_without_backtrace() << std::endl;
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "difftrain: error: " << e.what() << std::endl;
    return 1;
  }
  return 0;
}

}  // namespace difftrain::cli
