// CLIP's byte-level BPE tokenizer: loading a Transformers tokenizer folder, the BPE merge loop,
// the per-word cache and the padded encoding. The text cleanup and the pre-tokenisation pattern
// are in clip_text.cpp.

#include "difftrain/models/tokenizers/clip_tokenizer.h"

#include "byte_bpe.h"
#include "clip_text.h"
#include "difftrain/core/error.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <mutex>
#include <sstream>
#include <string_view>

namespace difftrain::models {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using byte_bpe::Merge;
using byte_bpe::quoted;
using byte_bpe::short_dump;

constexpr const char* kMissing =
    "a CLIP tokenizer folder needs vocab.json and merges.txt (as CLIPTokenizer.save_pretrained "
    "writes them)";

json read_json(const std::string& path) { return byte_bpe::read_json(path, kMissing); }

// HF's CLIPTokenizer reads merges.txt lines [1, 49152 - 256 - 2 + 1): at most 48894 merges.
constexpr int64_t kMaxMerges = 49152 - 256 - 2;
// Longest encoding padded to; a tokenizer_config.json with HF's "very large" default must be
// overridden with set_model_max_length first.
constexpr int64_t kMaxPaddedLength = 1 << 16;
constexpr size_t kCacheShards = 16;
constexpr size_t kCacheWordsPerShard = 1 << 16;  // ~1M words in all, then a shard starts over

constexpr const char* kStartOfText = "<|startoftext|>";
constexpr const char* kEndOfText = "<|endoftext|>";

// Symbols after BPE are cached per pre-tokenised word, in shards so that data-loader threads
// rarely wait for each other.
class WordCache {
 public:
  bool find(const std::string& word, std::vector<int32_t>* symbols) const {
    const auto& s = shard(word);
    std::lock_guard<std::mutex> lock(s.mutex);
    const auto it = s.words.find(word);
    if (it == s.words.end()) return false;
    *symbols = it->second;
    return true;
  }
  void insert(const std::string& word, const std::vector<int32_t>& symbols) {
    auto& s = shard(word);
    std::lock_guard<std::mutex> lock(s.mutex);
    if (s.words.size() >= kCacheWordsPerShard) s.words.clear();  // bounded memory
    s.words.emplace(word, symbols);
  }
  void clear() {
    for (auto& s : shards_) {
      std::lock_guard<std::mutex> lock(s.mutex);
      s.words.clear();
    }
  }
  size_t size() const {
    size_t n = 0;
    for (const auto& s : shards_) {
      std::lock_guard<std::mutex> lock(s.mutex);
      n += s.words.size();
    }
    return n;
  }

 private:
  struct Shard {
    mutable std::mutex mutex;
    std::unordered_map<std::string, std::vector<int32_t>> words;
  };
  const Shard& shard(const std::string& w) const {
    return shards_[std::hash<std::string>{}(w) % kCacheShards];
  }
  Shard& shard(const std::string& w) { return shards_[std::hash<std::string>{}(w) % kCacheShards]; }
  std::array<Shard, kCacheShards> shards_;
};

// One special token of tokenizer_config.json / special_tokens_map.json: a string or an
// AddedToken object {"content": ...}.
void read_special(const json& config, const std::string& path, const char* key,
                  std::string* content) {
  if (!config.contains(key)) return;
  const auto& v = config.at(key);
  const json* text = &v;
  if (v.is_object()) {
    if (!v.contains("content"))
      text = nullptr;
    else
      text = &v.at("content");
  }
  if (text == nullptr || !text->is_string() || text->get<std::string>().empty()) {
    throw Error(path + ": " + key + " is " + short_dump(v) +
                ", expected a non-empty string or an AddedToken object {\"content\": \"...\"}: "
                "set it (CLIP uses \"<|startoftext|>\" for bos_token, \"<|endoftext|>\" for the "
                "others; SD 2.x pads with \"!\")");
  }
  *content = text->get<std::string>();
}

int64_t read_max_length(const json& config, const std::string& path) {
  const auto& v = config.at("model_max_length");
  int64_t n = 0;
  if (v.is_number_integer()) {
    n = v.is_number_unsigned() && v.get<uint64_t>() > static_cast<uint64_t>(INT64_MAX)
            ? INT64_MAX
            : v.get<int64_t>();
  } else if (v.is_number_float() && v.get<double>() >= 9e18) {
    n = INT64_MAX;  // HF's VERY_LARGE_INTEGER (1e30), i.e. "no limit"
  } else if (v.is_number_float() && v.get<double>() == std::floor(v.get<double>()) &&
             v.get<double>() > -9e18) {  // converting a double below int64's range is undefined
    n = static_cast<int64_t>(v.get<double>());
  } else {
    throw Error(path + ": model_max_length is " + short_dump(v) +
                ", expected an integer: set it to the text encoder's max_position_embeddings "
                "(77 for CLIP)");
  }
  if (n < 2) {
    throw Error(path + ": model_max_length is " + std::to_string(n) +
                ", expected at least 2 (bos + eos): set it to the text encoder's "
                "max_position_embeddings (77 for CLIP)");
  }
  return n;
}

}  // namespace

struct ClipTokenizer::Impl {
  std::string dir;
  std::unordered_map<std::string, int64_t> vocab;
  // Added tokens (text -> id): looked up before the vocabulary, as HF does.
  std::unordered_map<std::string, int64_t> added;
  // Texts split out of the raw text before cleaning (special and added tokens), longest first.
  std::vector<std::string> split_tokens;
  std::array<bool, 256> split_first_byte{};
  // Interned BPE symbols and each one's id (-1: not in the vocabulary -> unk).
  std::vector<std::string> symbols;
  std::vector<int64_t> symbol_id;
  std::array<int32_t, 256> byte_symbol{}, byte_symbol_end{};  // a byte's symbol, without/with </w>
  std::unordered_map<uint64_t, Merge> merges;
  int64_t unk_id = 0;
  mutable WordCache cache;

  int64_t lookup(const std::string& token) const {
    if (auto it = added.find(token); it != added.end()) return it->second;
    if (auto it = vocab.find(token); it != vocab.end()) return it->second;
    return -1;
  }

  // HF's CLIPTokenizer.bpe on one word's bytes: merge the lowest-ranked adjacent pair (every
  // occurrence, left to right) until no pair has a rank.
  std::vector<int32_t> bpe(const std::string& word) const {
    std::vector<int32_t> w;
    w.reserve(word.size());
    for (size_t i = 0; i < word.size(); ++i) {
      const auto b = static_cast<unsigned char>(word[i]);
      w.push_back(i + 1 < word.size() ? byte_symbol[b] : byte_symbol_end[b]);
    }
    return byte_bpe::merge_symbols(std::move(w), merges);
  }

  template <typename Emit>
  void tokenize_chunk(std::string_view chunk, Emit&& emit) const {
    if (chunk.empty()) return;
    const auto pieces = clip_text::pre_tokenize(clip_text::clean(chunk));
    std::vector<int32_t> syms;
    for (const auto& piece : pieces) {
      if (piece == kStartOfText || piece == kEndOfText) {  // HF's bpe() cache holds these as-is
        emit(lookup(piece), piece);
        continue;
      }
      if (!cache.find(piece, &syms)) {
        syms = bpe(piece);
        cache.insert(piece, syms);
      }
      for (int32_t s : syms)
        emit(symbol_id[static_cast<size_t>(s)], symbols[static_cast<size_t>(s)]);
    }
  }

  // emit(id or -1, token) for every token of `text`.
  template <typename Emit>
  void tokenize(const std::string& text, Emit&& emit) const {
    byte_bpe::split_at_tokens(
        text, split_tokens, split_first_byte,
        [&](std::string_view plain) { tokenize_chunk(plain, emit); },
        [&](const std::string& t) { emit(lookup(t), t); });
  }
};

ClipTokenizer ClipTokenizer::from_folder(const std::string& dir) {
  if (!fs::is_directory(dir)) {
    throw Error("CLIP tokenizer folder '" + dir +
                "' does not exist: give a Transformers tokenizer folder (vocab.json, merges.txt), "
                "e.g. the tokenizer/ of a Stable Diffusion pipeline");
  }
  auto impl = std::make_shared<Impl>();
  impl->dir = dir;
  const std::string vocab_path = (fs::path(dir) / "vocab.json").string();
  const std::string merges_path = (fs::path(dir) / "merges.txt").string();
  impl->vocab = byte_bpe::vocab_from_json(read_json(vocab_path), vocab_path);
  const auto merges = byte_bpe::read_merges(merges_path, kMaxMerges, kMissing);

  // Intern the symbols: every byte alone and with </w>, then every merge's parts and result.
  byte_bpe::Symbols symbols;
  const auto bytes = byte_bpe::byte_unicode();
  for (size_t b = 0; b < 256; ++b) {
    impl->byte_symbol[b] = symbols.intern(bytes[b]);
    impl->byte_symbol_end[b] = symbols.intern(bytes[b] + "</w>");
  }
  impl->merges = byte_bpe::merge_table(merges, symbols);
  impl->symbols = std::move(symbols.texts);

  // Special tokens: CLIPTokenizer's defaults, then tokenizer_config.json, then
  // special_tokens_map.json (which overrides, as in HF's from_pretrained).
  std::string bos = kStartOfText, eos = kEndOfText, unk = kEndOfText, pad = kEndOfText;
  int64_t max_length = 77;
  const std::string config_path = (fs::path(dir) / "tokenizer_config.json").string();
  const std::string map_path = (fs::path(dir) / "special_tokens_map.json").string();
  const std::string added_path = (fs::path(dir) / "added_tokens.json").string();
  const auto read_object = [](const std::string& path) {
    auto j = read_json(path);
    if (!j.is_object()) {
      throw Error(path + ": expected a JSON object, got " + std::string(j.type_name()) +
                  ": fix or re-save the file");
    }
    return j;
  };
  std::string source = "the defaults";  // where the special tokens came from, for messages
  if (fs::exists(config_path)) {
    const auto config = read_object(config_path);
    for (auto [key, target] : {std::pair{"bos_token", &bos}, std::pair{"eos_token", &eos},
                               std::pair{"unk_token", &unk}, std::pair{"pad_token", &pad}}) {
      read_special(config, config_path, key, target);
    }
    if (config.contains("model_max_length")) max_length = read_max_length(config, config_path);
    if (config.contains("added_tokens_decoder")) {
      const auto& decoder = config.at("added_tokens_decoder");
      if (!decoder.is_object()) {
        throw Error(config_path + ": added_tokens_decoder is " + short_dump(decoder) +
                    ", expected an object {\"id\": {\"content\": ...}}: fix or re-save the file");
      }
      for (const auto& [key, token] : decoder.items()) {
        int64_t id = -1;
        size_t used = 0;
        try {
          id = std::stoll(key, &used);
        } catch (const std::exception&) {
          used = 0;
        }
        if (used != key.size() || id < 0 || !token.is_object() || !token.contains("content") ||
            !token.at("content").is_string() || token.at("content").get<std::string>().empty()) {
          throw Error(config_path + ": added_tokens_decoder entry " + quoted(key) + ": " +
                      short_dump(token) +
                      " is not an id >= 0 -> {\"content\": \"...\"}: fix or re-save the file");
        }
        impl->added[token.at("content").get<std::string>()] = id;
      }
    }
    source = config_path;
  }
  if (fs::exists(map_path)) {
    const auto map = read_object(map_path);
    for (auto [key, target] : {std::pair{"bos_token", &bos}, std::pair{"eos_token", &eos},
                               std::pair{"unk_token", &unk}, std::pair{"pad_token", &pad}}) {
      read_special(map, map_path, key, target);
    }
    source = source == "the defaults" ? map_path : source + " / " + map_path;
  }
  if (fs::exists(added_path)) {
    const auto added = read_object(added_path);
    for (const auto& [token, id] : added.items()) {
      if (token.empty() || !id.is_number_integer() || id.get<int64_t>() < 0) {
        throw Error(added_path + ": entry " + quoted(token) + " -> " + short_dump(id) +
                    " is not a token -> id >= 0: fix or re-save the file");
      }
      impl->added[token] = id.get<int64_t>();
    }
  }

  ClipTokenizer t;
  const auto special_id = [&](const char* key, const std::string& token) {
    const int64_t id = impl->lookup(token);
    if (id < 0) {
      throw Error(vocab_path + ": the " + key + " " + quoted(token) + " (from " + source +
                  ") is not in the vocabulary: fix " + key +
                  " or use the vocab.json the tokenizer was saved with");
    }
    return id;
  };
  t.bos_id_ = special_id("bos_token", bos);
  t.eos_id_ = special_id("eos_token", eos);
  t.unk_id_ = special_id("unk_token", unk);
  t.pad_id_ = special_id("pad_token", pad);
  t.model_max_length_ = max_length;
  impl->unk_id = t.unk_id_;

  for (const auto& s : impl->symbols) impl->symbol_id.push_back(impl->lookup(s));
  std::vector<std::string> split = {bos, eos, unk, pad};
  for (const auto& [token, id] : impl->added) split.push_back(token);
  std::sort(split.begin(), split.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() > b.size() : a < b;
  });
  split.erase(std::unique(split.begin(), split.end()), split.end());
  for (const auto& s : split) impl->split_first_byte[static_cast<unsigned char>(s[0])] = true;
  impl->split_tokens = std::move(split);
  t.impl_ = std::move(impl);
  return t;
}

const ClipTokenizer::Impl& ClipTokenizer::impl() const {
  if (!impl_) {
    throw Error("ClipTokenizer is empty: load one with ClipTokenizer::from_folder(dir)");
  }
  return *impl_;
}

std::vector<int64_t> ClipTokenizer::bpe_ids(const std::string& text) const {
  std::vector<int64_t> ids;
  const auto& im = impl();
  im.tokenize(text, [&](int64_t id, const std::string&) { ids.push_back(id < 0 ? unk_id_ : id); });
  return ids;
}

std::vector<std::string> ClipTokenizer::bpe_tokens(const std::string& text) const {
  std::vector<std::string> tokens;
  impl().tokenize(text, [&](int64_t, const std::string& token) { tokens.push_back(token); });
  return tokens;
}

ClipEncoding ClipTokenizer::encode(const std::string& text) const {
  if (model_max_length_ > kMaxPaddedLength) {
    throw Error("ClipTokenizer: model_max_length " + std::to_string(model_max_length_) + " of " +
                impl().dir + " is too long to pad to (at most " + std::to_string(kMaxPaddedLength) +
                "): call set_model_max_length with the text encoder's max_position_embeddings");
  }
  const auto ids = bpe_ids(text);
  const size_t keep = std::min(ids.size(), static_cast<size_t>(model_max_length_ - 2));
  ClipEncoding out;
  out.num_tokens = static_cast<int64_t>(ids.size());
  out.truncated = ids.size() > keep;
  out.input_ids.reserve(static_cast<size_t>(model_max_length_));
  out.input_ids.push_back(bos_id_);
  out.input_ids.insert(out.input_ids.end(), ids.begin(), ids.begin() + static_cast<long>(keep));
  out.input_ids.push_back(eos_id_);
  out.input_ids.resize(static_cast<size_t>(model_max_length_), pad_id_);
  return out;
}

torch::Tensor ClipTokenizer::encode_batch(const std::vector<std::string>& texts) const {
  std::vector<int64_t> flat;
  for (const auto& text : texts) {
    const auto e = encode(text);
    flat.insert(flat.end(), e.input_ids.begin(), e.input_ids.end());
  }
  return torch::tensor(flat, torch::kLong)
      .view({static_cast<int64_t>(texts.size()), model_max_length_});
}

void ClipTokenizer::set_model_max_length(int64_t n) {
  if (n < 2 || n > kMaxPaddedLength) {
    throw Error("ClipTokenizer::set_model_max_length: " + std::to_string(n) + " is not in [2, " +
                std::to_string(kMaxPaddedLength) +
                "]: use the text encoder's max_position_embeddings (77 for CLIP)");
  }
  model_max_length_ = n;
}

void ClipTokenizer::clear_word_cache() const { impl().cache.clear(); }

size_t ClipTokenizer::word_cache_size() const { return impl().cache.size(); }

int64_t ClipTokenizer::vocab_size() const {
  const auto& im = impl();
  return byte_bpe::vocab_rows(im.vocab, im.added);
}

}  // namespace difftrain::models
