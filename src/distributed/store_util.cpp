#include "difftrain/distributed/store_util.h"

#include <c10/util/Exception.h>

namespace difftrain::distributed {

std::string first_line(const std::exception& e) {
  std::string text;
  if (auto c10_error = dynamic_cast<const c10::Error*>(&e)) {
    text = c10_error->what_without_backtrace();
  } else {
    text = e.what();
  }
  return text.substr(0, text.find('\n'));
}

std::vector<uint8_t> to_bytes(const std::string& text) { return {text.begin(), text.end()}; }

std::string from_bytes(const std::vector<uint8_t>& bytes) { return {bytes.begin(), bytes.end()}; }

}  // namespace difftrain::distributed
