#pragma once
// The T5 tokenizer of FLUX.1's second text encoder: a SentencePiece unigram model
// (`tokenizer_2/spiece.model`, read by src/models/tokenizers/sentencepiece_unigram.h) with
// Transformers' T5Tokenizer conventions (slow tokenizer, legacy=True, as FluxPipeline calls it with
// padding="max_length", truncation=True): the pieces' ids, cut to max_length - 1, then `</s>`, then
// `<pad>` (0) up to max_length. No BOS. The 100 `<extra_id_N>` tokens follow the pieces
// (`<extra_id_N>` = vocab_size
// - 1 - N); prompts are encoded as plain text (an `<extra_id_N>` or `</s>` written inside a prompt
// is not split out, where Transformers would).

#include <torch/types.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::models {

class T5Tokenizer {
 public:
  /// Reads `dir`/spiece.model and, when present, tokenizer_config.json (`extra_ids`, default 100;
  /// `model_max_length`, default 512). Throws difftrain::Error naming the file when spiece.model
  /// is missing or not a SentencePiece model, or tokenizer_config.json is not valid JSON.
  static T5Tokenizer load(const std::string& dir);

  /// The SentencePiece pieces of `text` (its normaliser applied: NFKC, whitespace runs collapsed,
  /// "▁" for spaces), without `</s>`.
  std::vector<std::string> pieces(const std::string& text) const;
  /// The pieces' ids, without `</s>` or padding.
  std::vector<int64_t> piece_ids(const std::string& text) const;
  /// input_ids of `text` padded to `max_length` (>= 1): piece_ids cut to max_length - 1, `</s>`,
  /// then pad ids. `truncated` (when given) says whether pieces were cut.
  std::vector<int64_t> encode(const std::string& text, int64_t max_length,
                              bool* truncated = nullptr) const;
  /// encode() of every prompt: int64 [N, max_length].
  torch::Tensor operator()(const std::vector<std::string>& prompts, int64_t max_length) const;

  /// Pieces + extra ids (what the encoder's embedding must hold at least).
  int64_t vocab_size() const { return pieces_ + extra_ids_; }
  int64_t pad_id() const { return pad_id_; }
  int64_t eos_id() const { return eos_id_; }
  int64_t model_max_length() const { return model_max_length_; }
  /// Where it was read from.
  const std::string& dir() const { return dir_; }

 private:
  struct Processor;
  std::shared_ptr<const Processor> sp_;
  std::string dir_;
  int64_t pieces_ = 0, extra_ids_ = 100, pad_id_ = 0, eos_id_ = 1, model_max_length_ = 512;
};

}  // namespace difftrain::models
