#pragma once
// Private to src/train: an option's value as written (a flag or a YAML scalar) read as a type,
// with one-line errors naming where it came from; shared by the trainer's options
// (train_config.cpp) and the families' (option_spec.cpp).
#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::train::option_text {

/// A value as written, with where it came from for messages ("--name" or "FILE: name").
struct Raw {
  std::string text;
  std::string where;
};

/// Throws difftrain::Error "WHERE is \"TEXT\": expected EXPECTED".
[[noreturn]] void bad(const Raw& raw, const std::string& expected);
/// null, none, ~ or empty.
bool is_null(const Raw& raw);
bool to_bool(const Raw& raw);                      ///< true/false, 1/0, yes/no, on/off
int64_t to_int(const Raw& raw);                    ///< a decimal integer
double to_double(const Raw& raw);                  ///< a finite number
std::vector<std::string> to_list(const Raw& raw);  ///< comma-separated, trimmed, at least one

}  // namespace difftrain::train::option_text
