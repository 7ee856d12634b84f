// `difftrain train [--config FILE.yaml] [--<option> VALUE ...]`: the ready-made trainer. Options
// are the Diffusers training scripts' names and are parsed by the library (train_config.h), since
// they also come from YAML; this file only hands them over.
#include "commands.h"
#include "difftrain/families/family.h"
#include "difftrain/train/trainer.h"

#include <iostream>

namespace difftrain::cli {
namespace {

std::vector<std::string> g_args;
bool g_help = false;

}  // namespace

void take_train_args(std::vector<std::string>& args) {
  if (args.size() < 2 || args[1] != "train") return;
  g_args.assign(args.begin() + 2, args.end());
  for (const auto& a : g_args) g_help = g_help || a == "--help" || a == "-h";
  args.resize(2);
}

CLI::App* add_train_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "train",
      "Train a diffusion UNet (full or LoRA) on fashion_mnist, mnist or an image folder; "
      "`difftrain train` alone trains the built-in Fashion-MNIST default. Run under "
      "`difftrain launch` for several processes. `difftrain train --help` lists every option.");
  cmd->set_help_flag();  // --help is the trainer's own (it lists the option table)
  return cmd;
}

int run_train() {
  if (g_help) {
    std::cout << "usage: difftrain train [--config FILE.yaml] [--<option> VALUE ...]\n"
                 "Flags override the YAML file. Booleans also work as bare flags (--use_ema).\n"
                 "A pretrained folder's family starts from the defaults of the Diffusers script\n"
                 "its run follows (the run header names it); the defaults below are the built-in\n"
                 "job's. See docs/TRAINING.md.\n\n"
                 "options (type, default):\n";
    for (const auto& row : train::train_option_table()) {
      std::cout << "  --" << row[0] << std::string(row[0].size() < 30 ? 30 - row[0].size() : 1, ' ')
                << row[1] << std::string(row[1].size() < 8 ? 8 - row[1].size() : 1, ' ') << row[2]
                << "\n";
    }
    return 0;
  }
  families::run_training(families::parse_train_config(g_args));
  return 0;
}

}  // namespace difftrain::cli
