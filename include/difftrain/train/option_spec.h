#pragma once
// Options a model family declares for `difftrain train` (families/family.h: ModelFamily::options),
// beside the trainer's own (train_config.h): each with its name, type, default, help and check,
// read from the flags and the YAML file like the trainer's, shown by `difftrain train --help` with
// a model or `--family NAME`, saved with the run's configuration and checked at resume.
// Components a family composes declare groups of them (train/flow_matching_options.h).
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace difftrain::train {

/// One option of a family.
struct OptionSpec {
  std::string name;  ///< as on the command line, without the dashes
  /// bool | int | float | string | list (comma-separated); a "?" suffix: may be null.
  std::string type;
  nlohmann::json default_value;  ///< of that type (null for an unset "?" option)
  std::string help;              ///< one line for --help and docs
  /// Throws difftrain::Error (one line naming `where`, e.g. "--logit_std") for a bad value;
  /// empty: any value of the type.
  std::function<void(const nlohmann::json& value, const std::string& where)> check;
  bool structural = false;  ///< a change makes a checkpoint another run: refused at resume
  bool exactness = false;   ///< a change breaks bit-exact continuation: a warning at resume
  /// A folder or file the run reads (a "string" option): the output folder may be neither it nor
  /// inside it, and --overwrite_output_dir never deletes it (TrainerOptions::inputs).
  bool input_path = false;
  /// How many values the flag takes: 1 (the value is of `type`), N > 1 (exactly N, e.g. 2 for
  /// `--original_size H W`) or -1 (any number, the flag repeatable: `--prompt_2 A --prompt_2 B`);
  /// other than 1, the value is a JSON array of `type` elements. `difftrain sample`'s options.
  int64_t values = 1;
};

/// The value of `spec` from the texts its flag was given (one per value, as the command line
/// split them): parse_option_value() of each, an array unless spec.values is 1, then spec.check.
/// Throws difftrain::Error naming `where` for the wrong number of values or a bad one.
nlohmann::json parse_option_values(const OptionSpec& spec, const std::vector<std::string>& texts,
                                   const std::string& where);

/// A check for OptionSpec::check: every number in the value (a number or an array of them) lies
/// in [lo, hi].
std::function<void(const nlohmann::json&, const std::string&)> range_check(double lo, double hi);

/// `text` (a flag's value or a YAML scalar; lists comma-separated) as `type`. Throws
/// difftrain::Error "WHERE is \"TEXT\": expected ..." for a value that is not one.
nlohmann::json parse_option_value(const std::string& type, const std::string& text,
                                  const std::string& where);

/// A check for OptionSpec::check: the value is one of `allowed` (strings).
std::function<void(const nlohmann::json&, const std::string&)> one_of_check(
    std::vector<std::string> allowed);

/// The options of a run's family, with their values (given, else the defaults).
struct FamilyOptions {
  std::string family;  ///< the family's name ("" = no family)
  std::vector<OptionSpec> specs;
  nlohmann::json values = nlohmann::json::object();  ///< name -> value, every spec's

  /// The spec named `name`, or nullptr.
  const OptionSpec* find(const std::string& name) const;
  /// The value of `name`; throws difftrain::Error naming the family when it declares no such
  /// option (a family reading another's option is a bug).
  const nlohmann::json& at(const std::string& name) const;
  double number(const std::string& name) const { return at(name).get<double>(); }
  int64_t integer(const std::string& name) const { return at(name).get<int64_t>(); }
  bool flag(const std::string& name) const { return at(name).get<bool>(); }
  std::string text(const std::string& name) const { return at(name).get<std::string>(); }
  /// Every spec's default where `values` has none; then every check. Throws difftrain::Error.
  void complete_and_check();
};

/// How parse_train_config() learns a run's family options (families::parse_train_config() gives
/// it from the registry); empty members: no family options.
struct FamilyOptionLookup {
  /// The family a run of `pretrained_model` ("" = none) trains, with its specs (values empty).
  std::function<FamilyOptions(const std::string& pretrained_model)> options_for;
  /// The families that declare option `name` (none: empty), for the refusal of another
  /// family's.
  std::function<std::vector<std::string>(const std::string& name)> owner_of;
  /// What the run's `family` does instead of option `name` ("" = nothing to add), appended to
  /// that refusal (ModelFamily::instead_of_option()).
  std::function<std::string(const std::string& family, const std::string& name)> instead_of;
  /// Where another tool's flag `name` points (ModelFamily::other_tools_options(): the run's
  /// `family` first, then every registered one's; "" = none).
  std::function<std::string(const std::string& family, const std::string& name)> other_tools_hint;
};

}  // namespace difftrain::train
