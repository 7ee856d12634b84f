#pragma once
// CLIP's byte-level BPE tokenizer (OpenAI CLIP `SimpleTokenizer`, Hugging Face `CLIPTokenizer`)
// read from a Transformers tokenizer folder: vocab.json + merges.txt (+ tokenizer_config.json).
// This is what Stable Diffusion 1.x/2.x pipelines use to turn prompts into the ids their CLIP
// text encoder reads.

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace difftrain::models {

/// The ids of one prompt, as `tokenizer(prompt, padding="max_length", truncation=True,
/// max_length=model_max_length)` returns them.
struct ClipEncoding {
  /// [bos] + bpe ids (at most model_max_length - 2) + [eos], padded with pad_id to
  /// model_max_length.
  std::vector<int64_t> input_ids;
  /// Number of BPE tokens of the prompt before truncation (no bos/eos).
  int64_t num_tokens = 0;
  /// Whether BPE tokens were cut off (num_tokens > model_max_length - 2).
  bool truncated = false;
};

/// CLIP's tokenizer. Steps (HF `CLIPTokenizer._tokenize` with ftfy's NFC normalisation):
/// NFC-normalise, unescape HTML entities, collapse every whitespace run to one space, strip,
/// lower-case (Unicode); split with CLIP's pattern (`<|startoftext|>`, `<|endoftext|>`, the
/// contractions 's 't 're 've 'm 'll 'd, runs of Unicode letters, single Unicode numbers, runs of
/// other non-space symbols); map each piece's UTF-8 bytes through GPT-2's byte->unicode table,
/// mark the last symbol with `</w>`, merge pairs lowest rank first (merges.txt order), and look
/// the pieces up in vocab.json (unknown pieces get unk_id). As HF's slow and fast tokenizers do,
/// the special tokens' texts (bos, eos, unk, pad) and added tokens are split out of the raw text
/// first and map to their ids; with SD 2.x's pad_token "!" every "!" of a prompt thus becomes id
/// 0 (diffusers issue #4153), as in Diffusers. Merges are cached per word (up to ~1M words, then
/// the cache starts over), so the tokenizer is fast on repeated words; every method is safe to
/// call from several threads, and copies share the vocabulary and the cache.
class ClipTokenizer {
 public:
  /// Reads `dir`/vocab.json, `dir`/merges.txt and, when present, `dir`/tokenizer_config.json
  /// (model_max_length, bos/eos/pad/unk tokens as strings or AddedToken objects,
  /// added_tokens_decoder), `dir`/special_tokens_map.json (overrides the special tokens, as in
  /// HF) and `dir`/added_tokens.json. As HF's CLIPTokenizer, it always lower-cases
  /// (do_lower_case is not read) and uses at most the first 48894 merges. Throws difftrain::Error
  /// naming the file for a missing or malformed file, a special token missing from the
  /// vocabulary, or model_max_length < 2.
  static ClipTokenizer from_folder(const std::string& dir);

  /// BPE ids of `text` without bos/eos, no truncation.
  std::vector<int64_t> bpe_ids(const std::string& text) const;
  /// The BPE tokens (vocabulary strings, e.g. "photo</w>") of `text`.
  std::vector<std::string> bpe_tokens(const std::string& text) const;
  /// The padded, truncated ids of one prompt (see ClipEncoding).
  ClipEncoding encode(const std::string& text) const;
  /// The ids of several prompts: [N, model_max_length] int64.
  torch::Tensor encode_batch(const std::vector<std::string>& texts) const;

  /// Length encode() pads and truncates to (tokenizer_config.json's model_max_length; 77 when
  /// absent).
  int64_t model_max_length() const { return model_max_length_; }
  /// Overrides model_max_length (e.g. to the text encoder's max_position_embeddings when the
  /// tokenizer config gives a huge value); >= 2.
  void set_model_max_length(int64_t n);
  /// Id of bos_token (`<|startoftext|>`, 49406 in CLIP's vocabulary).
  int64_t bos_id() const { return bos_id_; }
  /// Id of eos_token (`<|endoftext|>`, 49407).
  int64_t eos_id() const { return eos_id_; }
  /// Id of pad_token: 49407 (`<|endoftext|>`) for SD 1.x, 0 (`!`) for SD 2.x.
  int64_t pad_id() const { return pad_id_; }
  /// Id of unk_token, given to pieces missing from the vocabulary.
  int64_t unk_id() const { return unk_id_; }
  /// Entries of vocab.json plus added tokens whose text is not among them (HF `len(tokenizer)`):
  /// the rows a text encoder's token embedding needs.
  int64_t vocab_size() const;

 private:
  friend struct ClipTokenizerTestPeer;  // tests and bench/bench_tokenizer empty the word cache
  struct Impl;
  const Impl& impl() const;  // throws for a default-constructed tokenizer
  void clear_word_cache() const;
  size_t word_cache_size() const;
  std::shared_ptr<Impl> impl_;
  int64_t model_max_length_ = 77;
  int64_t bos_id_ = 0, eos_id_ = 0, pad_id_ = 0, unk_id_ = 0;
};

}  // namespace difftrain::models
