#include "difftrain/io/prompt_file.h"

#include "difftrain/core/error.h"

#include <filesystem>
#include <fstream>
#include <sstream>

namespace difftrain::io {

std::vector<std::string> read_prompt_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  // An ifstream opens a folder on Linux and then reads nothing: refuse it by name.
  if (!in || std::filesystem::is_directory(path)) {
    throw Error("cannot read --prompt_file '" + path +
                "': no such file or not readable; give a text file with one prompt per line");
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) throw Error("cannot read --prompt_file '" + path + "'");
  std::string s = text.str();
  std::vector<std::string> lines;
  if (s.empty()) return lines;
  if (s.back() == '\n') s.pop_back();
  size_t pos = 0;
  while (true) {
    const size_t eol = s.find('\n', pos);
    std::string line = s.substr(pos, eol == std::string::npos ? std::string::npos : eol - pos);
    if (!line.empty() && line.back() == '\r') line.pop_back();
    lines.push_back(std::move(line));
    if (eol == std::string::npos) break;
    pos = eol + 1;
  }
  return lines;
}

}  // namespace difftrain::io
