#pragma once

#include <stdexcept>
#include <string>

namespace difftrain {

/// The one exception type difftrain's own code throws for bad input, bad configuration, failed
/// I/O and failed collectives. Its message is a single line that names the bad thing and the fix;
/// cli/main.cpp prints it and turns it into a non-zero exit code.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& message) : std::runtime_error(message) {}
};

}  // namespace difftrain
