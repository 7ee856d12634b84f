// What the byte-level BPE tokenizers share (byte_bpe.h).
#include "byte_bpe.h"

#include "clip_text.h"
#include "difftrain/core/error.h"

#include <cstdint>
#include <fstream>
#include <sstream>
#include <string_view>

namespace difftrain::models::byte_bpe {

using json = nlohmann::json;

std::string read_file(const std::string& path, const std::string& missing) {
  std::ifstream in(path, std::ios::binary);
  if (!in) throw Error("cannot open '" + path + "': " + missing);
  std::ostringstream out;
  out << in.rdbuf();
  if (in.bad()) throw Error("cannot read '" + path + "'");
  return out.str();
}

json read_json(const std::string& path, const std::string& missing) {
  try {
    return json::parse(read_file(path, missing));
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    throw Error(path + ": not valid JSON (" + e.what() + "): fix or re-save the file");
  }
}

std::string quoted(const std::string& text) {
  auto s = json(text).dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 56) + "...\"";
  return s;
}

std::string short_dump(const json& value) {
  auto s = value.dump(-1, ' ', false, json::error_handler_t::replace);
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

std::array<std::string, 256> byte_unicode() {
  std::array<std::string, 256> out;
  char32_t next = 256;
  for (int b = 0; b < 256; ++b) {
    const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    const char32_t c = printable ? static_cast<char32_t>(b) : next++;
    out[static_cast<size_t>(b)] = clip_text::encode_utf8(std::u32string(1, c));
  }
  return out;
}

std::unordered_map<std::string, int64_t> vocab_from_json(const json& j, const std::string& path) {
  if (!j.is_object()) {
    throw Error(path + ": expected a JSON object of token -> id, got " +
                std::string(j.type_name()) + ": use the vocab.json saved with the tokenizer");
  }
  std::unordered_map<std::string, int64_t> vocab;
  vocab.reserve(j.size());
  for (const auto& [token, id] : j.items()) {
    if (!id.is_number_integer() || (id.is_number_unsigned() && id.get<uint64_t>() > INT64_MAX) ||
        id.get<int64_t>() < 0) {
      throw Error(path + ": the id of token " + quoted(token) + " is " + short_dump(id) +
                  ", expected an integer >= 0: use the vocab.json saved with the tokenizer");
    }
    vocab.emplace(token, id.get<int64_t>());
  }
  return vocab;
}

std::vector<std::pair<std::string, std::string>> read_merges(const std::string& path,
                                                             int64_t max_merges,
                                                             const std::string& missing) {
  const std::string text = read_file(path, missing);
  const auto is_ws = [](char c) {
    return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
  };
  size_t begin = 0, end = text.size();
  int64_t line_no = 1;  // of the file, for messages
  while (begin < end && is_ws(text[begin])) line_no += text[begin++] == '\n';
  while (end > begin && is_ws(text[end - 1])) --end;
  std::vector<std::pair<std::string, std::string>> merges;
  size_t pos = begin;
  for (int64_t index = 0; pos < end && index <= max_merges; ++index, ++line_no) {
    size_t eol = text.find('\n', pos);
    if (eol == std::string::npos || eol > end) eol = end;
    const std::string_view line(text.data() + pos, eol - pos);
    pos = eol + 1;
    if (index == 0) continue;  // "#version: 0.2"
    std::vector<std::string_view> parts;
    for (size_t i = 0; i < line.size();) {
      while (i < line.size() && is_ws(line[i])) ++i;
      size_t j = i;
      while (j < line.size() && !is_ws(line[j])) ++j;
      if (j > i) parts.push_back(line.substr(i, j - i));
      i = j;
    }
    if (parts.size() != 2) {
      throw Error(path + ":" + std::to_string(line_no) + ": expected two symbols \"a b\", got " +
                  quoted(std::string(line)) + " (" + std::to_string(parts.size()) +
                  " symbols): use the merges.txt saved with the tokenizer");
    }
    merges.emplace_back(std::string(parts[0]), std::string(parts[1]));
  }
  return merges;
}

uint64_t pair_key(int32_t a, int32_t b) {
  return (static_cast<uint64_t>(static_cast<uint32_t>(a)) << 32) | static_cast<uint32_t>(b);
}

int32_t Symbols::intern(const std::string& text) {
  const auto [it, inserted] = index.emplace(text, static_cast<int32_t>(texts.size()));
  if (inserted) texts.push_back(text);
  return it->second;
}

std::unordered_map<uint64_t, Merge> merge_table(
    const std::vector<std::pair<std::string, std::string>>& merges, Symbols& symbols) {
  std::unordered_map<uint64_t, Merge> table;
  table.reserve(merges.size());
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    const int32_t ia = symbols.intern(a), ib = symbols.intern(b), merged = symbols.intern(a + b);
    table[pair_key(ia, ib)] = {static_cast<int32_t>(rank), merged};  // a repeat: last wins
  }
  return table;
}

int64_t vocab_rows(const std::unordered_map<std::string, int64_t>& vocab,
                   const std::unordered_map<std::string, int64_t>& added) {
  int64_t n = static_cast<int64_t>(vocab.size());
  for (const auto& [token, id] : added) n += vocab.count(token) == 0 ? 1 : 0;
  return n;
}

std::vector<int32_t> merge_symbols(std::vector<int32_t> w,
                                   const std::unordered_map<uint64_t, Merge>& merges) {
  std::vector<int32_t> next;
  while (w.size() > 1) {
    const Merge* best = nullptr;
    int32_t first = 0, second = 0;
    for (size_t i = 0; i + 1 < w.size(); ++i) {
      const auto it = merges.find(pair_key(w[i], w[i + 1]));
      if (it != merges.end() && (best == nullptr || it->second.rank < best->rank)) {
        best = &it->second;
        first = w[i];
        second = w[i + 1];
      }
    }
    if (best == nullptr) break;
    next.clear();
    for (size_t i = 0; i < w.size();) {
      if (i + 1 < w.size() && w[i] == first && w[i + 1] == second) {
        next.push_back(best->merged);
        i += 2;
      } else {
        next.push_back(w[i++]);
      }
    }
    w.swap(next);
  }
  return w;
}

}  // namespace difftrain::models::byte_bpe
