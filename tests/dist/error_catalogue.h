// The bad-input catalogue's rows (docs/ERRORS.md, "Bad-input catalogue"): each builds one bad input
// in a temp folder and says which `difftrain` command to run on it, the exact one-line message and
// the exit code (error_catalogue_cases.cpp). error_catalogue_test.cpp runs them and checks the doc.
#pragma once

#include "source_dir.h"

#include <functional>
#include <map>
#include <memory>
#include <ostream>
#include <string>
#include <vector>

namespace difftrain::testing {

inline const std::string kCatalogueGolden =
    std::string(difftrain_test::source_dir()) + "/tests/golden";

// What a row's setup hands back: the arguments after `difftrain`, and the values of the
// placeholders its message uses besides <tmp> and <golden>.
struct BadRun {
  std::vector<std::string> args;
  std::map<std::string, std::string> vars = {};
  std::shared_ptr<void> hold = nullptr;  // kept alive while the command runs (a bound socket)
};

struct Case {
  std::string name;     ///< gtest name
  std::string how;      ///< how to reproduce, as the catalogue says it
  std::string message;  ///< the exact line, placeholders <tmp>, <golden>, <port>
  int exit_code;
  std::function<BadRun(const std::string& tmp)> setup;
  bool cli11 = false;  ///< a CLI11 parse error: first stderr line, no `difftrain: error: ` prefix
};

// gtest names a failing row by this.
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

/// Every row, in the catalogue's order.
const std::vector<Case>& error_catalogue_cases();
/// The transformer families' rows (Z-Image, Qwen-Image, ...: error_catalogue_families.cpp),
/// which come last.
std::vector<Case> family_error_cases();

}  // namespace difftrain::testing
