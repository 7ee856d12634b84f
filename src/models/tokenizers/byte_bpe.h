#pragma once
// What the byte-level BPE tokenizers share (private to src/models/tokenizers): CLIP's
// (clip_tokenizer.cpp) and Qwen2's (qwen2_tokenizer.cpp). Reading vocab.json / merges.txt as
// Transformers saves them, GPT-2's byte -> unicode alphabet, and the merge loop.

#include <nlohmann/json.hpp>

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace difftrain::models::byte_bpe {

/// The bytes of `path`; throws difftrain::Error "cannot open 'PATH': `missing`" when it cannot be
/// opened (`missing` says what the folder needs).
std::string read_file(const std::string& path, const std::string& missing);
/// `path` parsed as JSON; throws difftrain::Error naming the file when it is not JSON.
nlohmann::json read_json(const std::string& path, const std::string& missing);

/// A value for a one-line message: JSON-quoted and shortened.
std::string quoted(const std::string& text);
/// A JSON value for a one-line message, shortened.
std::string short_dump(const nlohmann::json& value);

/// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
/// (controls, space, 0x7F-0xA0, soft hyphen) for U+0100 onwards in byte order; as UTF-8.
std::array<std::string, 256> byte_unicode();

/// vocab.json: token -> id >= 0. Throws difftrain::Error naming the file and the token.
std::unordered_map<std::string, int64_t> vocab_from_json(const nlohmann::json& j,
                                                         const std::string& path);

/// merges.txt as Transformers reads it: the file stripped of surrounding whitespace, split at
/// '\n', the first line (the "#version" header) skipped, at most `max_merges` lines, each "a b".
std::vector<std::pair<std::string, std::string>> read_merges(const std::string& path,
                                                             int64_t max_merges,
                                                             const std::string& missing);

/// One merge of interned symbols: its rank and the symbol of the concatenation.
struct Merge {
  int32_t rank;
  int32_t merged;
};

/// The key of the symbol pair (a, b) in a merge table.
uint64_t pair_key(int32_t a, int32_t b);

/// Interned BPE symbols: each distinct text gets the next index.
struct Symbols {
  std::vector<std::string> texts;
  std::unordered_map<std::string, int32_t> index;
  int32_t intern(const std::string& text);
};

/// The merge table of `merges` (rank: the position; a repeated pair: the last wins), interning
/// each merge's parts and result in `symbols`.
std::unordered_map<uint64_t, Merge> merge_table(
    const std::vector<std::pair<std::string, std::string>>& merges, Symbols& symbols);

/// The rows a token embedding needs: the vocabulary plus the added tokens not in it
/// (Transformers' `len(tokenizer)`).
int64_t vocab_rows(const std::unordered_map<std::string, int64_t>& vocab,
                   const std::unordered_map<std::string, int64_t>& added);

/// BPE on one word's symbols, as Transformers' `bpe()`: merge the lowest-ranked adjacent pair
/// (every occurrence, left to right) until no pair has a rank.
std::vector<int32_t> merge_symbols(std::vector<int32_t> word,
                                   const std::unordered_map<uint64_t, Merge>& merges);

/// Splits `text` at the tokens of `longest_first` (added and special tokens, longest first;
/// `first_byte[b]`: some token starts with byte b), as Transformers does before anything else:
/// plain(view) for each stretch between them (possibly empty), token(text) for each token.
template <typename Plain, typename Token>
void split_at_tokens(const std::string& text, const std::vector<std::string>& longest_first,
                     const std::array<bool, 256>& first_byte, Plain&& plain, Token&& token) {
  size_t chunk_start = 0, pos = 0;
  while (pos < text.size()) {
    const std::string* match = nullptr;
    if (first_byte[static_cast<unsigned char>(text[pos])]) {
      for (const auto& t : longest_first) {
        if (text.compare(pos, t.size(), t) == 0) {
          match = &t;
          break;
        }
      }
    }
    if (match == nullptr) {
      ++pos;
      continue;
    }
    plain(std::string_view(text).substr(chunk_start, pos - chunk_start));
    token(*match);
    pos += match->size();
    chunk_start = pos;
  }
  plain(std::string_view(text).substr(chunk_start));
}

}  // namespace difftrain::models::byte_bpe
