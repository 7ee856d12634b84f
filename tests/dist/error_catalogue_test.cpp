// The bad-input catalogue (docs/ERRORS.md, "Bad-input catalogue"): every row builds one bad input
// in a temp folder, runs the real `difftrain` binary on it and checks the exit code, the exact
// one-line message, that nothing crashed or hung, and that it failed fast. A second test reads
// docs/ERRORS.md and checks that every row's message and exit code are documented there, so the
// doc and the program cannot drift apart.

#include "error_catalogue.h"
#include "train_util.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace difftrain::testing {
namespace {

const std::string kSource = difftrain_test::source_dir();
constexpr double kFastSeconds = 20;  // generous: the machine is shared; most rows take < 1 s

std::string substitute(std::string text, const std::map<std::string, std::string>& vars) {
  for (const auto& [key, value] : vars) {
    for (size_t at = text.find(key); at != std::string::npos; at = text.find(key, at)) {
      text.replace(at, key.size(), value);
      at += value.size();
    }
  }
  return text;
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> lines;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) {
    if (!line.empty()) lines.push_back(line);
  }
  return lines;
}

// The catalogue's markdown row for a case: what docs/ERRORS.md must contain.
std::string doc_line(const Case& c) {
  return (c.cli11 ? "`` " : "`` difftrain: error: ") + c.message + " ``";
}

class ErrorCatalogueRows : public ::testing::TestWithParam<Case> {};

TEST_P(ErrorCatalogueRows, ExactMessageAndExitCode) {
  const Case& c = GetParam();
  const std::string tmp = make_temp_dir("errcat");
  BadRun r = c.setup(tmp);
  std::vector<std::string> argv = {kDifftrain};
  argv.insert(argv.end(), r.args.begin(), r.args.end());
  const ProcessResult p = run(argv, {}, 90);
  r.hold.reset();
  std::map<std::string, std::string> vars = r.vars;
  vars["<tmp>"] = tmp;
  vars["<golden>"] = kCatalogueGolden;
  const std::string expected = (c.cli11 ? "" : "difftrain: error: ") + substitute(c.message, vars);

  EXPECT_FALSE(p.timed_out) << p.log();
  EXPECT_EQ(p.term_signal, 0) << p.log();
  EXPECT_EQ(p.exit_code, c.exit_code) << p.log();
  EXPECT_EQ(p.err.find("terminate called"), std::string::npos) << p.log();
  EXPECT_LT(p.seconds, kFastSeconds) << p.log();
  const auto lines = lines_of(p.err);
  ASSERT_FALSE(lines.empty()) << p.log();
  if (c.cli11) {
    // CLI11 prints its message, then "Run with --help for more information."
    EXPECT_EQ(lines.front(), expected) << p.log();
  } else {
    // The error is the last line, and the only `difftrain: error:` line.
    EXPECT_EQ(lines.back(), expected) << p.log();
    int count = 0;
    for (const auto& l : lines) count += l.rfind("difftrain: error: ", 0) == 0 ? 1 : 0;
    EXPECT_EQ(count, 1) << p.log();
  }
  std::printf("%s: exit %d in %.2f s\n", c.name.c_str(), p.exit_code, p.seconds);
}

INSTANTIATE_TEST_SUITE_P(ErrorCatalogue, ErrorCatalogueRows,
                         ::testing::ValuesIn(error_catalogue_cases()),
                         [](const auto& info) { return info.param.name; });

// docs/ERRORS.md's "Bad-input catalogue" section lists every row: its message (placeholders as
// they are) and its exit code on the same line.
TEST(ErrorCatalogueDoc, EveryRowIsDocumentedWithItsExitCode) {
  std::ifstream in(kSource + "/docs/ERRORS.md");
  ASSERT_TRUE(in) << kSource << "/docs/ERRORS.md";
  std::vector<std::string> section;
  bool inside = false;
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("## ", 0) == 0) inside = line == "## Bad-input catalogue";
    if (inside) section.push_back(line);
  }
  ASSERT_FALSE(section.empty()) << "no '## Bad-input catalogue' section in docs/ERRORS.md";
  int number = 0;
  for (const Case& c : error_catalogue_cases()) {
    ++number;
    const std::string needle = doc_line(c);
    const std::string exit_cell = "| " + std::to_string(c.exit_code) + " |";
    bool found = false;
    for (const auto& line : section) {
      if (line.find(needle) != std::string::npos && line.find(exit_cell) != std::string::npos) {
        found = true;
      }
    }
    EXPECT_TRUE(found) << c.name << " is not in docs/ERRORS.md's catalogue; its row:\n| " << number
                       << " | " << c.how << " | " << needle << " | " << c.exit_code << " |";
  }
  EXPECT_GE(error_catalogue_cases().size(), 36u);
}

}  // namespace
}  // namespace difftrain::testing
