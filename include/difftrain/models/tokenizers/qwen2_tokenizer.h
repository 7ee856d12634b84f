#pragma once
// The byte-level BPE tokenizer of Qwen2 / Qwen2.5 / Qwen3 (Transformers' Qwen2Tokenizer and
// Qwen2TokenizerFast): the text encoders of Z-Image, Qwen-Image and FLUX.2 klein read prompts
// with it.

#include "difftrain/models/tokenizers/chat_template.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::models {

/// The ids of one prompt as `tokenizer(prompt, padding="max_length", max_length=N,
/// truncation=True)` returns them: no tokens added, cut on the right, padded on the right.
struct Qwen2Encoding {
  std::vector<int64_t> input_ids;       ///< N ids: the prompt's (at most N), then pad_id
  std::vector<int64_t> attention_mask;  ///< 1 for the prompt's ids, 0 for the padding
  int64_t num_tokens = 0;               ///< the prompt's ids before truncation
  bool truncated = false;               ///< num_tokens > N
};

/// Qwen2's tokenizer. Steps, as tokenizer.json describes them (and the slow Qwen2Tokenizer does):
/// added tokens (`<|endoftext|>`, `<|im_start|>`, `<|im_end|>`, `<think>`, ...) are split out of
/// the raw text first, the longest at each position, and map to their ids; the text between them
/// is NFC-normalised and split with Qwen's pre-tokenizer pattern (PCRE2 with Unicode properties:
/// contractions, letter runs with one leading non-letter, single digits, symbol runs, newline and
/// space runs); each piece's UTF-8 bytes go through GPT-2's byte -> unicode alphabet, merge
/// lowest rank first, and are looked up in the vocabulary. Nothing is added (no bos/eos), nothing
/// is lower-cased. Safe to call from several threads; copies share the tables.
class Qwen2Tokenizer {
 public:
  /// Reads `dir`/tokenizer.json (model.vocab, model.merges as "a b" strings or [a, b] pairs,
  /// added_tokens, the Split pre-tokenizer's pattern) or, without it, `dir`/vocab.json +
  /// merges.txt, and `dir`/tokenizer_config.json when present (added_tokens_decoder, pad_token,
  /// model_max_length). Throws difftrain::Error naming the file for a missing or malformed one, a
  /// merge of symbols the vocabulary lacks, or a pattern PCRE2 cannot compile.
  static Qwen2Tokenizer from_folder(const std::string& dir);
  /// Whether `dir` is a Qwen2 tokenizer folder: its tokenizer_config.json names a
  /// `tokenizer_class` starting with "Qwen2" (Qwen2Tokenizer, Qwen2TokenizerFast).
  static bool is_folder(const std::string& dir);

  /// The ids of `text`, no truncation.
  std::vector<int64_t> encode(const std::string& text) const;
  /// The vocabulary strings of `text`'s ids (byte-level: a space is "Ġ").
  std::vector<std::string> tokens(const std::string& text) const;
  /// The ids of one prompt, cut and padded to `max_length` (>= 1).
  Qwen2Encoding encode_padded(const std::string& text, int64_t max_length) const;
  /// The UTF-8 text of `ids` (invalid byte sequences become U+FFFD, as errors="replace");
  /// added tokens are written as their text.
  std::string decode(const std::vector<int64_t>& ids) const;

  /// The id of `token` (an added token or a vocabulary entry), if any.
  std::optional<int64_t> token_id(const std::string& token) const;
  /// pad_token's id (tokenizer_config.json; `<|endoftext|>` when it names none).
  int64_t pad_id() const;
  /// tokenizer_config.json's model_max_length (131072 when absent).
  int64_t model_max_length() const;
  /// The vocabulary plus the added tokens not in it: the rows the embedding needs at least.
  int64_t vocab_size() const;

  /// The folder's chat template (chat_template.jinja, else tokenizer_config.json's
  /// `chat_template`: a string, or the entry named "default" of a list), or null.
  const ChatTemplate* chat_template() const;
  /// Transformers' `apply_chat_template(messages, tokenize=False, add_generation_prompt,
  /// **extra)` with this folder's template and special tokens (bos/eos/unk/pad_token as
  /// tokenizer_config.json names them). ZImagePipeline: messages [{"role": "user", "content":
  /// prompt}], add_generation_prompt true, extra {"enable_thinking": true}. Throws
  /// difftrain::Error naming the folder when it has no template.
  std::string apply_chat_template(const nlohmann::ordered_json& messages,
                                  bool add_generation_prompt,
                                  const nlohmann::ordered_json& extra = {}) const;

 private:
  struct Impl;
  std::shared_ptr<const Impl> impl_;
  const Impl& impl() const;
};

}  // namespace difftrain::models
