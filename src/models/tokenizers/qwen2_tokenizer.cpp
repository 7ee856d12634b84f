// Qwen2's byte-level BPE tokenizer (qwen2_tokenizer.h): tokenizer.json or vocab.json +
// merges.txt, added tokens split out first, NFC, Qwen's pre-tokenizer pattern through PCRE2, BPE.

#include "difftrain/models/tokenizers/qwen2_tokenizer.h"

#include "byte_bpe.h"
#include "clip_text.h"
#include "difftrain/core/error.h"
#include "difftrain/models/tokenizers/chat_template.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <filesystem>
#include <unordered_map>

namespace difftrain::models {

namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;
using byte_bpe::Merge;

using byte_bpe::short_dump;

constexpr const char* kMissing =
    "a Qwen2 tokenizer folder needs tokenizer.json, or vocab.json and merges.txt (as "
    "Qwen2TokenizerFast.save_pretrained writes them)";

// Qwen2Tokenizer's PRETOKENIZE_REGEX, used when tokenizer.json names no Split pattern.
constexpr const char* kQwenPattern =
    R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

constexpr int64_t kDefaultMaxLength = 131072;

// A compiled PCRE2 pattern (UTF, Unicode properties for \s \w \d and classes).
std::shared_ptr<pcre2_code> compile(const std::string& pattern, const std::string& where) {
  int error = 0;
  PCRE2_SIZE offset = 0;
  pcre2_code* code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                                   PCRE2_UTF | PCRE2_UCP, &error, &offset, nullptr);
  if (code == nullptr) {
    std::array<PCRE2_UCHAR, 256> message{};
    pcre2_get_error_message(error, message.data(), message.size());
    throw Error(where + ": the pre-tokenizer pattern " + byte_bpe::quoted(pattern) +
                " does not compile at offset " + std::to_string(offset) + " (" +
                reinterpret_cast<const char*>(message.data()) + "): fix or re-save the file");
  }
  return {code, pcre2_code_free};
}

// The Split pre-tokenizer's pattern of tokenizer.json ("" when it has none).
std::string split_pattern(const json& node) {
  if (!node.is_object()) return "";
  if (node.value("type", "") == "Split" && node.contains("pattern") &&
      node.at("pattern").is_object() && node.at("pattern").contains("Regex") &&
      node.at("pattern").at("Regex").is_string()) {
    return node.at("pattern").at("Regex").get<std::string>();
  }
  if (node.contains("pretokenizers") && node.at("pretokenizers").is_array()) {
    for (const auto& p : node.at("pretokenizers")) {
      if (auto found = split_pattern(p); !found.empty()) return found;
    }
  }
  return "";
}

// An added-token id read from JSON: an integer >= 0.
int64_t token_id_of(const json& v, const std::string& path, const std::string& what) {
  if (!v.is_number_integer() || v.get<int64_t>() < 0) {
    throw Error(path + ": " + what + " has id " + short_dump(v) +
                ", expected an integer >= 0: fix or re-save the file");
  }
  return v.get<int64_t>();
}

}  // namespace

struct Qwen2Tokenizer::Impl {
  std::string dir;
  std::unordered_map<std::string, int64_t> vocab;
  std::unordered_map<std::string, int64_t> added;  // text -> id, looked up before the vocabulary
  std::vector<std::string> split_tokens;           // the added tokens, longest first
  std::array<bool, 256> split_first_byte{};
  std::vector<std::string> symbols;  // interned BPE symbols
  std::vector<int64_t> symbol_id;    // each one's id (-1: not in the vocabulary)
  std::array<int32_t, 256> byte_symbol{};
  std::unordered_map<uint64_t, Merge> merges;
  std::unordered_map<int64_t, std::string> id_text;  // id -> vocabulary string or added token
  std::unordered_map<std::string, uint8_t> byte_of;  // alphabet symbol -> byte
  std::shared_ptr<pcre2_code> pattern;
  int64_t pad_id = 0;
  int64_t max_length = kDefaultMaxLength;
  std::optional<ChatTemplate> chat_template;
  nlohmann::ordered_json special_tokens = nlohmann::ordered_json::object();

  // emit(id, text) for every token of one stretch of text without added tokens.
  template <typename Emit>
  void tokenize_plain(std::string_view text, Emit&& emit) const {
    if (text.empty()) return;
    const std::string normal = clip_text::encode_utf8(clip_text::nfc(clip_text::decode_utf8(text)));
    std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> match(
        pcre2_match_data_create_from_pattern(pattern.get(), nullptr), pcre2_match_data_free);
    const auto* subject = reinterpret_cast<PCRE2_SPTR>(normal.data());
    PCRE2_SIZE at = 0;
    while (at < normal.size()) {
      const int rc =
          pcre2_match(pattern.get(), subject, normal.size(), at, 0, match.get(), nullptr);
      if (rc == PCRE2_ERROR_NOMATCH) break;
      if (rc < 0) {
        throw Error("Qwen2Tokenizer: the pre-tokenizer pattern failed on a prompt (PCRE2 error " +
                    std::to_string(rc) + ")");
      }
      const PCRE2_SIZE* span = pcre2_get_ovector_pointer(match.get());
      if (span[1] == span[0]) {  // an empty match: step over one character, as findall does
        ++at;
        while (at < normal.size() && (static_cast<unsigned char>(normal[at]) & 0xC0) == 0x80) ++at;
        continue;
      }
      std::vector<int32_t> word;
      word.reserve(span[1] - span[0]);
      for (PCRE2_SIZE i = span[0]; i < span[1]; ++i) {
        word.push_back(byte_symbol[static_cast<unsigned char>(normal[i])]);
      }
      for (int32_t s : byte_bpe::merge_symbols(std::move(word), merges)) {
        emit(symbol_id[static_cast<size_t>(s)], symbols[static_cast<size_t>(s)]);
      }
      at = span[1];
    }
  }

  template <typename Emit>
  void tokenize(const std::string& text, Emit&& emit) const {
    byte_bpe::split_at_tokens(
        text, split_tokens, split_first_byte,
        [&](std::string_view plain) { tokenize_plain(plain, emit); },
        [&](const std::string& t) { emit(added.at(t), t); });
  }
};

Qwen2Tokenizer Qwen2Tokenizer::from_folder(const std::string& dir) {
  if (!fs::is_directory(dir)) {
    throw Error("Qwen2 tokenizer folder '" + dir + "' does not exist: " + kMissing);
  }
  auto impl = std::make_shared<Impl>();
  impl->dir = dir;
  const std::string tokenizer_path = (fs::path(dir) / "tokenizer.json").string();
  const std::string config_path = (fs::path(dir) / "tokenizer_config.json").string();
  std::vector<std::pair<std::string, std::string>> merges;
  std::string pattern = kQwenPattern;
  std::string vocab_source;
  if (fs::exists(tokenizer_path)) {
    const json t = byte_bpe::read_json(tokenizer_path, kMissing);
    if (!t.is_object() || !t.contains("model") || !t.at("model").is_object() ||
        t.at("model").value("type", "") != "BPE" || !t.at("model").contains("vocab") ||
        !t.at("model").contains("merges") || !t.at("model").at("merges").is_array()) {
      throw Error(tokenizer_path +
                  ": expected a BPE model with vocab and merges (a Qwen2 tokenizer.json): use the "
                  "tokenizer folder saved with the model");
    }
    const json& model = t.at("model");
    impl->vocab = byte_bpe::vocab_from_json(model.at("vocab"), tokenizer_path);
    for (const auto& m : model.at("merges")) {
      if (m.is_string()) {  // "a b" (tokenizers before 0.20)
        const auto text = m.get<std::string>();
        const auto space = text.find(' ');
        if (space == std::string::npos || space == 0 || space + 1 == text.size() ||
            text.find(' ', space + 1) != std::string::npos) {
          throw Error(tokenizer_path + ": merge " + byte_bpe::quoted(text) +
                      " is not two symbols \"a b\": use the tokenizer.json saved with the model");
        }
        merges.emplace_back(text.substr(0, space), text.substr(space + 1));
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {
        merges.emplace_back(m[0].get<std::string>(), m[1].get<std::string>());
      } else {
        throw Error(tokenizer_path + ": merge " + short_dump(m) +
                    " is neither \"a b\" nor [\"a\", \"b\"]: use the tokenizer.json saved with "
                    "the model");
      }
    }
    if (t.contains("added_tokens") && t.at("added_tokens").is_array()) {
      for (const auto& a : t.at("added_tokens")) {
        if (!a.is_object() || !a.contains("content") || !a.at("content").is_string() ||
            a.at("content").get<std::string>().empty() || !a.contains("id")) {
          throw Error(tokenizer_path + ": added token " + short_dump(a) +
                      " is not {\"id\": N, \"content\": \"...\"}: fix or re-save the file");
        }
        impl->added[a.at("content").get<std::string>()] = token_id_of(
            a.at("id"), tokenizer_path, "added token " + byte_bpe::quoted(a.at("content")));
      }
    }
    if (t.contains("pre_tokenizer")) {
      if (auto found = split_pattern(t.at("pre_tokenizer")); !found.empty()) pattern = found;
    }
    vocab_source = tokenizer_path;
  } else {
    const std::string vocab_path = (fs::path(dir) / "vocab.json").string();
    impl->vocab = byte_bpe::vocab_from_json(byte_bpe::read_json(vocab_path, kMissing), vocab_path);
    merges = byte_bpe::read_merges((fs::path(dir) / "merges.txt").string(), INT64_MAX, kMissing);
    vocab_source = vocab_path;
  }
  std::string pad = "<|endoftext|>";
  if (fs::exists(config_path)) {
    const json c = byte_bpe::read_json(config_path, kMissing);
    if (!c.is_object()) {
      throw Error(config_path + ": expected a JSON object, got " + std::string(c.type_name()) +
                  ": fix or re-save the file");
    }
    if (c.contains("added_tokens_decoder") && c.at("added_tokens_decoder").is_object()) {
      for (const auto& [key, token] : c.at("added_tokens_decoder").items()) {
        if (!token.is_object() || !token.contains("content") || !token.at("content").is_string() ||
            token.at("content").get<std::string>().empty() || key.empty() || key.size() > 18 ||
            key.find_first_not_of("0123456789") != std::string::npos) {
          throw Error(config_path + ": added_tokens_decoder entry " + byte_bpe::quoted(key) + ": " +
                      short_dump(token) +
                      " is not an id >= 0 -> {\"content\": \"...\"}: fix or re-save the file");
        }
        impl->added.emplace(token.at("content").get<std::string>(), std::stoll(key));
      }
    }
    if (c.contains("pad_token")) {
      const auto& p = c.at("pad_token");
      if (p.is_string()) pad = p.get<std::string>();
      if (p.is_object() && p.contains("content") && p.at("content").is_string()) {
        pad = p.at("content").get<std::string>();
      }
    }
    // Transformers' special_tokens_map: the named special tokens the config sets.
    for (const char* name : {"bos_token", "eos_token", "unk_token", "pad_token"}) {
      if (!c.contains(name)) continue;
      const auto& t = c.at(name);
      if (t.is_string()) impl->special_tokens[name] = t.get<std::string>();
      if (t.is_object() && t.contains("content") && t.at("content").is_string()) {
        impl->special_tokens[name] = t.at("content").get<std::string>();
      }
    }
    if (c.contains("chat_template")) {
      const auto& t = c.at("chat_template");
      std::string source;
      if (t.is_string()) source = t.get<std::string>();
      // A list of named templates: Transformers uses the one named "default".
      if (t.is_array()) {
        for (const auto& named : t) {
          if (named.is_object() && named.value("name", "") == "default" &&
              named.contains("template") && named.at("template").is_string()) {
            source = named.at("template").get<std::string>();
          }
        }
      }
      if (!source.empty()) impl->chat_template = ChatTemplate::parse(source, config_path);
    }
    if (c.contains("model_max_length") && c.at("model_max_length").is_number_integer() &&
        c.at("model_max_length").get<int64_t>() >= 1) {
      impl->max_length = c.at("model_max_length").get<int64_t>();
    }
  }
  impl->pattern = compile(pattern, vocab_source);
  // chat_template.jinja (what newer Transformers saves) wins over tokenizer_config.json's.
  const std::string jinja_path = (fs::path(dir) / "chat_template.jinja").string();
  if (fs::exists(jinja_path)) {
    impl->chat_template =
        ChatTemplate::parse(byte_bpe::read_file(jinja_path, kMissing), jinja_path);
  }

  // Intern the symbols: every byte, then every merge's parts and result.
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const auto& [a, b] = merges[rank];
    if (!impl->vocab.count(a) || !impl->vocab.count(b) || !impl->vocab.count(a + b)) {
      throw Error(vocab_source + ": merge " + std::to_string(rank) + " " +
                  byte_bpe::quoted(a + " " + b) +
                  " joins symbols the vocabulary lacks: use the files saved together with the "
                  "model");
    }
  }
  byte_bpe::Symbols symbols;
  const auto bytes = byte_bpe::byte_unicode();
  for (size_t b = 0; b < 256; ++b) {
    impl->byte_symbol[b] = symbols.intern(bytes[b]);
    impl->byte_of[bytes[b]] = static_cast<uint8_t>(b);
  }
  impl->merges = byte_bpe::merge_table(merges, symbols);
  impl->symbols = std::move(symbols.texts);
  for (const auto& s : impl->symbols) {
    const auto it = impl->vocab.find(s);
    impl->symbol_id.push_back(it == impl->vocab.end() ? -1 : it->second);
  }
  for (const auto& [token, id] : impl->vocab) impl->id_text.emplace(id, token);
  for (const auto& [token, id] : impl->added) impl->id_text[id] = token;

  std::vector<std::string> split;
  for (const auto& [token, id] : impl->added) split.push_back(token);
  std::sort(split.begin(), split.end(), [](const std::string& a, const std::string& b) {
    return a.size() != b.size() ? a.size() > b.size() : a < b;
  });
  for (const auto& s : split) impl->split_first_byte[static_cast<unsigned char>(s[0])] = true;
  impl->split_tokens = std::move(split);

  const auto pad_it = impl->added.find(pad);
  const auto pad_vocab = impl->vocab.find(pad);
  if (pad_it == impl->added.end() && pad_vocab == impl->vocab.end()) {
    throw Error(config_path + ": pad_token " + byte_bpe::quoted(pad) +
                " is neither an added token nor in the vocabulary: fix pad_token or use the "
                "tokenizer folder saved with the model");
  }
  impl->pad_id = pad_it != impl->added.end() ? pad_it->second : pad_vocab->second;

  Qwen2Tokenizer t;
  t.impl_ = std::move(impl);
  return t;
}

const Qwen2Tokenizer::Impl& Qwen2Tokenizer::impl() const {
  if (!impl_) {
    throw Error("Qwen2Tokenizer is empty: load one with Qwen2Tokenizer::from_folder(dir)");
  }
  return *impl_;
}

std::vector<int64_t> Qwen2Tokenizer::encode(const std::string& text) const {
  std::vector<int64_t> ids;
  const auto& im = impl();
  im.tokenize(text, [&](int64_t id, const std::string& token) {
    if (id < 0) {
      throw Error("Qwen2Tokenizer (" + im.dir + "): the symbol " + byte_bpe::quoted(token) +
                  " is not in the vocabulary: use the files saved together with the model");
    }
    ids.push_back(id);
  });
  return ids;
}

std::vector<std::string> Qwen2Tokenizer::tokens(const std::string& text) const {
  std::vector<std::string> out;
  impl().tokenize(text, [&](int64_t, const std::string& token) { out.push_back(token); });
  return out;
}

Qwen2Encoding Qwen2Tokenizer::encode_padded(const std::string& text, int64_t max_length) const {
  if (max_length < 1) {
    throw Error("Qwen2Tokenizer: max_length " + std::to_string(max_length) + " must be at least 1");
  }
  const auto ids = encode(text);
  Qwen2Encoding out;
  out.num_tokens = static_cast<int64_t>(ids.size());
  out.truncated = out.num_tokens > max_length;
  const auto keep = static_cast<size_t>(std::min(out.num_tokens, max_length));
  out.input_ids.assign(ids.begin(), ids.begin() + static_cast<std::ptrdiff_t>(keep));
  out.attention_mask.assign(keep, 1);
  out.input_ids.resize(static_cast<size_t>(max_length), impl().pad_id);
  out.attention_mask.resize(static_cast<size_t>(max_length), 0);
  return out;
}

std::string Qwen2Tokenizer::decode(const std::vector<int64_t>& ids) const {
  const auto& im = impl();
  std::string bytes;
  for (const int64_t id : ids) {
    const auto it = im.id_text.find(id);
    if (it == im.id_text.end()) {
      throw Error("Qwen2Tokenizer::decode: id " + std::to_string(id) +
                  " is not in the vocabulary of " + im.dir);
    }
    if (im.added.count(it->second)) {
      bytes += it->second;
      continue;
    }
    for (const char32_t c : clip_text::decode_utf8(it->second)) {
      const auto b = im.byte_of.find(clip_text::encode_utf8(std::u32string(1, c)));
      if (b != im.byte_of.end()) bytes.push_back(static_cast<char>(b->second));
    }
  }
  return clip_text::encode_utf8(clip_text::decode_utf8(bytes));  // errors="replace"
}

std::optional<int64_t> Qwen2Tokenizer::token_id(const std::string& token) const {
  const auto& im = impl();
  if (const auto it = im.added.find(token); it != im.added.end()) return it->second;
  if (const auto it = im.vocab.find(token); it != im.vocab.end()) return it->second;
  return std::nullopt;
}

int64_t Qwen2Tokenizer::pad_id() const { return impl().pad_id; }

int64_t Qwen2Tokenizer::model_max_length() const { return impl().max_length; }

int64_t Qwen2Tokenizer::vocab_size() const {
  const auto& im = impl();
  return byte_bpe::vocab_rows(im.vocab, im.added);
}

}  // namespace difftrain::models

namespace difftrain::models {

bool Qwen2Tokenizer::is_folder(const std::string& dir) {
  const auto path = fs::path(dir) / "tokenizer_config.json";
  if (!fs::is_regular_file(path)) return false;
  const json c = byte_bpe::read_json(path.string(), kMissing);
  return c.is_object() && c.contains("tokenizer_class") && c.at("tokenizer_class").is_string() &&
         c.at("tokenizer_class").get<std::string>().rfind("Qwen2", 0) == 0;
}

const ChatTemplate* Qwen2Tokenizer::chat_template() const {
  const auto& im = impl();
  return im.chat_template ? &*im.chat_template : nullptr;
}

std::string Qwen2Tokenizer::apply_chat_template(const nlohmann::ordered_json& messages,
                                                bool add_generation_prompt,
                                                const nlohmann::ordered_json& extra) const {
  const auto& im = impl();
  if (!im.chat_template) {
    throw Error("Qwen2 tokenizer folder '" + im.dir +
                "' has no chat template (tokenizer_config.json's chat_template or "
                "chat_template.jinja): use the tokenizer folder saved with the model");
  }
  return models::apply_chat_template(*im.chat_template, messages, add_generation_prompt,
                                     im.special_tokens, extra);
}

}  // namespace difftrain::models
