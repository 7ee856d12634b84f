// SentencePiece model files and the unigram encoder (sentencepiece_unigram.h).
#include "sentencepiece_unigram.h"

#include "difftrain/core/error.h"

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <limits>

namespace difftrain::models::detail {
namespace {

const char kSpaceSymbol[] = "\xe2\x96\x81";  // "▁"

// Protobuf wire format, just what ModelProto needs.
class ProtoReader {
 public:
  ProtoReader(const char* data, size_t size, const std::string& source)
      : p_(data), end_(data + size), source_(source) {}
  bool done() const { return p_ >= end_; }
  uint64_t varint() {
    uint64_t v = 0;
    for (int shift = 0; shift < 64; shift += 7) {
      if (p_ >= end_) fail();
      const auto b = static_cast<uint8_t>(*p_++);
      v |= static_cast<uint64_t>(b & 0x7F) << shift;
      if ((b & 0x80) == 0) return v;
    }
    fail();
  }
  std::pair<uint32_t, uint32_t> key() {
    const uint64_t k = varint();
    return {static_cast<uint32_t>(k >> 3), static_cast<uint32_t>(k & 7)};
  }
  std::string bytes() {
    const uint64_t n = varint();
    if (n > static_cast<uint64_t>(end_ - p_)) fail();
    std::string out(p_, static_cast<size_t>(n));
    p_ += n;
    return out;
  }
  float fixed32_float() {
    if (end_ - p_ < 4) fail();
    uint32_t u = 0;
    for (int i = 0; i < 4; ++i) u |= static_cast<uint32_t>(static_cast<uint8_t>(p_[i])) << (8 * i);
    p_ += 4;
    float f = 0;
    std::memcpy(&f, &u, 4);
    return f;
  }
  void skip(uint32_t wire) {
    switch (wire) {
      case 0: varint(); return;
      case 1: advance(8); return;
      case 2: bytes(); return;
      case 5: advance(4); return;
      default: fail();
    }
  }
  [[noreturn]] void fail() const {
    throw Error(source_ +
                ": not a SentencePiece model (its protobuf data is damaged); copy the tokenizer's "
                "spiece.model from the model repository again");
  }

 private:
  void advance(size_t n) {
    if (static_cast<size_t>(end_ - p_) < n) fail();
    p_ += n;
  }
  const char* p_;
  const char* end_;
  const std::string& source_;
};

// Length of the valid UTF-8 character at `s` (n bytes left), or 0 when it is malformed.
size_t utf8_char_length(const char* s, size_t n) {
  const auto c = static_cast<uint8_t>(s[0]);
  if (c < 0x80) return 1;
  size_t len = 0;
  uint32_t cp = 0;
  if ((c & 0xE0) == 0xC0) {
    len = 2;
    cp = c & 0x1F;
  } else if ((c & 0xF0) == 0xE0) {
    len = 3;
    cp = c & 0x0F;
  } else if ((c & 0xF8) == 0xF0) {
    len = 4;
    cp = c & 0x07;
  } else {
    return 0;
  }
  if (n < len) return 0;
  for (size_t i = 1; i < len; ++i) {
    const auto b = static_cast<uint8_t>(s[i]);
    if ((b & 0xC0) != 0x80) return 0;
    cp = (cp << 6) | (b & 0x3F);
  }
  if ((len == 2 && cp < 0x80) || (len == 3 && (cp < 0x800 || (cp >= 0xD800 && cp <= 0xDFFF))) ||
      (len == 4 && (cp < 0x10000 || cp > 0x10FFFF))) {
    return 0;
  }
  return len;
}

}  // namespace

SentencePieceUnigram::SentencePieceUnigram(const std::string& bytes, const std::string& source) {
  ProtoReader top(bytes.data(), bytes.size(), source);
  int model_type = 1;
  std::string charsmap;
  while (!top.done()) {
    const auto [field, wire] = top.key();
    if (field == 1 && wire == 2) {  // SentencePiece pieces
      const std::string m = top.bytes();
      ProtoReader r(m.data(), m.size(), source);
      Piece piece;
      while (!r.done()) {
        const auto [f, w] = r.key();
        if (f == 1 && w == 2) {
          piece.text = r.bytes();
        } else if (f == 2 && w == 5) {
          piece.score = r.fixed32_float();
        } else if (f == 3 && w == 0) {
          piece.type = static_cast<int>(r.varint());
        } else {
          r.skip(w);
        }
      }
      pieces_.push_back(std::move(piece));
    } else if (field == 2 && wire == 2) {  // TrainerSpec
      const std::string m = top.bytes();
      ProtoReader r(m.data(), m.size(), source);
      while (!r.done()) {
        const auto [f, w] = r.key();
        const auto as_int = [&] { return static_cast<int>(static_cast<int64_t>(r.varint())); };
        if (w != 0) {
          r.skip(w);
        } else if (f == 3) {
          model_type = as_int();
        } else if (f == 35) {
          byte_fallback_ = r.varint() != 0;
        } else if (f == 40) {
          unk_id_ = as_int();
        } else if (f == 42) {
          eos_id_ = as_int();
        } else if (f == 43) {
          pad_id_ = as_int();
        } else {
          r.varint();
        }
      }
    } else if (field == 3 && wire == 2) {  // NormalizerSpec
      const std::string m = top.bytes();
      ProtoReader r(m.data(), m.size(), source);
      while (!r.done()) {
        const auto [f, w] = r.key();
        if (f == 2 && w == 2) {
          charsmap = r.bytes();
        } else if (f == 3 && w == 0) {
          add_dummy_prefix_ = r.varint() != 0;
        } else if (f == 4 && w == 0) {
          remove_extra_whitespaces_ = r.varint() != 0;
        } else if (f == 5 && w == 0) {
          escape_whitespaces_ = r.varint() != 0;
        } else {
          r.skip(w);
        }
      }
    } else {
      top.skip(wire);
    }
  }
  if (pieces_.empty()) top.fail();
  if (model_type != 1) {
    throw Error(source + ": a SentencePiece model of type " + std::to_string(model_type) +
                "; difftrain reads unigram models (type 1), which T5 uses");
  }
  if (unk_id_ < 0 || unk_id_ >= piece_size()) top.fail();
  bool first = true;
  for (int i = 0; i < piece_size(); ++i) {
    const Piece& p = pieces_[static_cast<size_t>(i)];
    if (p.type == 1 || p.type == 4 || p.type == 5) {
      index_.emplace(p.text, i);
      max_piece_bytes_ = std::max(max_piece_bytes_, p.text.size());
    }
    if (p.type == 1) {
      min_score_ = first ? p.score : std::min(min_score_, p.score);
      max_score_ = first ? p.score : std::max(max_score_, p.score);
      first = false;
    }
  }
  if (!charsmap.empty()) {
    if (charsmap.size() <= 4) top.fail();
    uint32_t trie_bytes = 0;
    for (int i = 0; i < 4; ++i) {
      trie_bytes |= static_cast<uint32_t>(static_cast<uint8_t>(charsmap[static_cast<size_t>(i)]))
                    << (8 * i);
    }
    if (trie_bytes >= charsmap.size() - 4 || trie_bytes % 4 != 0) top.fail();
    trie_.resize(trie_bytes / 4);
    for (size_t i = 0; i < trie_.size(); ++i) {
      uint32_t u = 0;
      for (size_t k = 0; k < 4; ++k) {
        u |= static_cast<uint32_t>(static_cast<uint8_t>(charsmap[4 + 4 * i + k])) << (8 * k);
      }
      trie_[i] = u;
    }
    normalized_ = charsmap.substr(4 + trie_bytes);
  }
}

std::pair<std::string, size_t> SentencePieceUnigram::normalize_prefix(const char* in,
                                                                      size_t n) const {
  // darts-clone's commonPrefixSearch: the longest input prefix with a replacement.
  size_t longest = 0;
  uint32_t value = 0;
  if (!trie_.empty()) {
    const auto offset = [](uint32_t u) { return (u >> 10) << ((u & (1U << 9)) >> 6); };
    const auto label = [](uint32_t u) { return u & ((1U << 31) | 0xFF); };
    const auto has_leaf = [](uint32_t u) { return ((u >> 8) & 1) == 1; };
    size_t pos = offset(trie_[0]);
    for (size_t i = 0; i < n; ++i) {
      const auto c = static_cast<uint8_t>(in[i]);
      pos ^= c;
      if (pos >= trie_.size()) break;
      const uint32_t unit = trie_[pos];
      if (label(unit) != c) break;
      pos ^= offset(unit);
      if (pos >= trie_.size()) break;
      if (has_leaf(unit)) {
        longest = i + 1;
        value = trie_[pos] & ((1U << 31) - 1);
      }
    }
  }
  if (longest > 0 && value < normalized_.size()) {
    return {std::string(normalized_.c_str() + value), longest};
  }
  const size_t len = utf8_char_length(in, n);
  if (len == 0) return {"\xEF\xBF\xBD", 1};  // U+FFFD for a malformed byte
  return {std::string(in, len), len};
}

std::string SentencePieceUnigram::normalize(const std::string& text) const {
  const char* in = text.data();
  size_t n = text.size();
  if (remove_extra_whitespaces_) {
    while (n > 0) {
      const auto p = normalize_prefix(in, n);
      if (p.first != " ") break;
      in += p.second;
      n -= p.second;
    }
  }
  std::string out;
  if (n == 0) return out;
  const std::string space = escape_whitespaces_ ? kSpaceSymbol : " ";
  if (add_dummy_prefix_) out += space;
  bool prev_space = remove_extra_whitespaces_;
  while (n > 0) {
    const auto p = normalize_prefix(in, n);
    std::string_view sp = p.first;
    while (prev_space && !sp.empty() && sp.front() == ' ') sp.remove_prefix(1);
    if (!sp.empty()) {
      for (char c : sp) {
        if (escape_whitespaces_ && c == ' ') {
          out += kSpaceSymbol;
        } else {
          out += c;
        }
      }
      prev_space = sp.back() == ' ';
    }
    in += p.second;
    n -= p.second;
    if (!remove_extra_whitespaces_) prev_space = false;
  }
  if (remove_extra_whitespaces_) {
    while (out.size() >= space.size() &&
           out.compare(out.size() - space.size(), space.size(), space) == 0) {
      out.resize(out.size() - space.size());
    }
  }
  return out;
}

std::vector<std::pair<std::string, int>> SentencePieceUnigram::encode(
    const std::string& text) const {
  const std::string s = normalize(text);
  std::vector<std::pair<std::string, int>> out;
  if (s.empty()) return out;
  // Best path ending at each byte position (SentencePiece's EncodeOptimized: ties keep the first
  // candidate found, scanning start positions and then piece lengths in increasing order).
  struct Best {
    int id = -1;
    size_t start = 0;
    float score = 0;
  };
  const float unk_score = min_score_ - 10.0F;
  std::vector<Best> best(s.size() + 1);
  best[0].id = 0;  // the empty prefix
  for (size_t start = 0; start < s.size();) {
    size_t len = utf8_char_length(s.data() + start, s.size() - start);
    if (len == 0) len = 1;
    if (best[start].id == -1 && start > 0) {
      start += len;
      continue;
    }
    const float here = best[start].score;
    bool single = false;
    for (size_t k = 1; k <= max_piece_bytes_ && start + k <= s.size(); ++k) {
      const auto it = index_.find(s.substr(start, k));
      if (it == index_.end()) continue;
      const Piece& piece = pieces_[static_cast<size_t>(it->second)];
      if (piece.type == 5) continue;  // unused
      const float score = piece.type == 4 ? static_cast<float>(k) * max_score_ - 0.1F : piece.score;
      Best& b = best[start + k];
      if (b.id == -1 || here + score > b.score) b = {it->second, start, here + score};
      if (k == len) single = true;
    }
    if (!single) {
      Best& b = best[start + len];
      if (b.id == -1 || here + unk_score > b.score) b = {unk_id_, start, here + unk_score};
    }
    start += len;
  }
  for (size_t end = s.size(); end > 0;) {
    const Best& b = best[end];
    out.emplace_back(s.substr(b.start, end - b.start), b.id);
    end = b.start;
  }
  std::reverse(out.begin(), out.end());
  // A run of unknown pieces is one <unk>; with byte fallback, unknown text becomes <0xXX> pieces.
  std::vector<std::pair<std::string, int>> merged;
  for (auto& p : out) {
    if (p.second == unk_id_ && byte_fallback_) {
      for (unsigned char c : p.first) {
        char name[8];
        std::snprintf(name, sizeof(name), "<0x%02X>", c);
        int id = unk_id_;
        for (int i = 0; i < piece_size(); ++i) {
          if (pieces_[static_cast<size_t>(i)].type == 6 &&
              pieces_[static_cast<size_t>(i)].text == name) {
            id = i;
            break;
          }
        }
        merged.emplace_back(name, id);
      }
      continue;
    }
    if (p.second == unk_id_ && !merged.empty() && merged.back().second == unk_id_) {
      merged.back().first += p.first;
      continue;
    }
    merged.push_back(std::move(p));
  }
  return merged;
}

}  // namespace difftrain::models::detail
