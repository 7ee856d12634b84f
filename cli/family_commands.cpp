// The families' own commands (families::FamilyCommand, e.g. the UNet family's `eval`): each is a
// subcommand whose flags are its OptionSpecs; once parsed, the family runs it and the JSON it
// returns is printed on stdout.

#include "commands.h"
#include "difftrain/families/family.h"

#include <deque>
#include <iostream>
#include <map>

namespace difftrain::cli {
namespace {

struct Registered {
  families::FamilyCommand command;
  std::string family;
  CLI::App* app = nullptr;
  std::map<std::string, std::vector<std::string>> values;
  std::vector<std::pair<std::string, CLI::Option*>> flags;
};
std::deque<Registered> g_commands;  // stable addresses: CLI11 writes into `values`

}  // namespace

void add_family_commands(CLI::App& app) {
  g_commands.clear();  // a forked rank builds its command line again (launch's self_main)
  for (const auto* family : families::families()) {
    for (auto& command : family->commands()) {
      auto& r = g_commands.emplace_back();
      r.family = family->name();
      r.command = std::move(command);
      r.app = app.add_subcommand(r.command.name,
                                 r.command.help + " [the " + r.family + " family's command]");
      for (const auto& spec : r.command.options) {
        auto* opt = r.app->add_option("--" + spec.name, r.values[spec.name], spec.help);
        opt->type_name(option_type_name(spec.type));
        if (spec.values > 0) opt->expected(static_cast<int>(spec.values));
        if (spec.values == 1) opt->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
        r.flags.emplace_back(spec.name, opt);
      }
    }
  }
}

bool family_command_parsed() {
  for (const auto& r : g_commands) {
    if (r.app->parsed()) return true;
  }
  return false;
}

int run_family_command() {
  for (const auto& r : g_commands) {
    if (!r.app->parsed()) continue;
    std::map<std::string, std::vector<std::string>> given;
    for (const auto& [name, opt] : r.flags) {
      if (opt->count() > 0) given[name] = r.values.at(name);
    }
    const auto options = families::parse_family_flags(r.family, r.command.options, given);
    const auto result = r.command.run(options);
    if (!result.is_null()) std::cout << result.dump(2) << std::endl;
    return 0;
  }
  return 1;
}

}  // namespace difftrain::cli
