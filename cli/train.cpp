// `difftrain train [--config FILE.yaml] [--<option> VALUE ...]`: the ready-made trainer. Options
// are the Diffusers training scripts' names and are parsed by the library (train_config.h), since
// they also come from YAML; this file only hands them over.
#include "commands.h"
#include "difftrain/core/error.h"
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
      "Train a diffusion model of any registered family (full or LoRA) on fashion_mnist, mnist "
      "or an image folder; "
      "`difftrain train` alone trains the built-in Fashion-MNIST default. Run under "
      "`difftrain launch` for several processes. `difftrain train --help` lists every option.");
  cmd->set_help_flag();  // --help is the trainer's own (it lists the option table)
  return cmd;
}

namespace {

// The value of `--name V` / `--name=V` in the train arguments ("" when absent).
std::string arg_value(const std::string& name) {
  for (size_t i = 0; i < g_args.size(); ++i) {
    if (g_args[i] == "--" + name && i + 1 < g_args.size()) return g_args[i + 1];
    if (g_args[i].rfind("--" + name + "=", 0) == 0) return g_args[i].substr(name.size() + 3);
  }
  return "";
}

void print_rows(const std::vector<std::vector<std::string>>& rows) {
  for (const auto& row : rows) {
    std::cout << "  --" << row[0] << std::string(row[0].size() < 30 ? 30 - row[0].size() : 1, ' ')
              << row[1] << std::string(row[1].size() < 8 ? 8 - row[1].size() : 1, ' ') << row[2];
    if (row.size() > 3) std::cout << "  " << row[3];
    std::cout << "\n";
  }
}

int print_train_help() {
  std::cout << "usage: difftrain train [--config FILE.yaml] [--<option> VALUE ...]\n"
               "Flags override the YAML file. Booleans also work as bare flags (--use_ema).\n"
               "A pretrained folder's family starts from the defaults of the Diffusers script\n"
               "its run follows (the run header names it); the defaults below are the built-in\n"
               "job's. See docs/TRAINING.md.\n\n"
               "options (type, default):\n";
  print_rows(train::train_option_table());
  // A family's own options: of the model given, or of --family NAME.
  const families::ModelFamily* family = nullptr;
  if (const auto name = arg_value("family"); !name.empty()) {
    family = families::find_family(name);
    if (family == nullptr) {
      std::string known;
      for (const auto* f : families::families()) known += (known.empty() ? "" : ", ") + f->name();
      throw Error("--family " + name + ": no such model family; the families are " + known);
    }
  } else if (const auto model = arg_value("pretrained_model_name_or_path"); !model.empty()) {
    family = &families::family_of(model);
  }
  if (family != nullptr) {
    const auto specs = family->options();
    std::cout << "\noptions of the " << family->name() << " family (type, default, help):\n";
    if (specs.empty()) std::cout << "  (none beyond the trainer's)\n";
    print_rows(train::family_option_table(specs));
    return 0;
  }
  std::cout << "\nA family's own options (difftrain train --help --family NAME, or with\n"
               "--pretrained_model_name_or_path):\n";
  for (const auto* f : families::families()) {
    std::string names;
    for (const auto& spec : f->options()) names += (names.empty() ? "" : ", ") + spec.name;
    std::cout << "  " << f->name() << ": " << (names.empty() ? "(none)" : names) << "\n";
  }
  return 0;
}

}  // namespace

int run_train() {
  if (g_help) return print_train_help();
  families::run_training(families::parse_train_config(g_args));
  return 0;
}

}  // namespace difftrain::cli
