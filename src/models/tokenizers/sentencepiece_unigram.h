#pragma once
// Internal to src/models: a reader of SentencePiece model files (`spiece.model`, a ModelProto in
// protobuf wire format) and the unigram encoder, with SentencePiece's semantics: the normaliser
// from the model's own precompiled character map (a darts-clone double-array trie of input byte
// sequences and their replacements: NFKC and whitespace rules for nmt_nfkc), dummy prefix,
// whitespace collapsing and escaping as "▁", then the Viterbi-best segmentation over piece scores,
// unknown characters as <unk> (a run of them merged into one), byte fallback when the model has
// it. Debian's libsentencepiece is not used: it carries its own copy of protobuf-lite whose
// exported symbols take the place of LibTorch's libprotobuf ones, and every process that loads
// both crashes while starting.

#include <cstdint>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

namespace difftrain::models::detail {

class SentencePieceUnigram {
 public:
  /// Parses the bytes of a .model file; `source` names it in errors. Throws difftrain::Error for
  /// a file that is not a SentencePiece model or one that is not of the unigram type.
  SentencePieceUnigram(const std::string& bytes, const std::string& source);

  /// SentencePiece's normalised form of `text` (with "▁" for spaces and the dummy prefix).
  std::string normalize(const std::string& text) const;
  /// The pieces and ids of `text` (normalised first), as SentencePieceProcessor::Encode.
  std::vector<std::pair<std::string, int>> encode(const std::string& text) const;

  int piece_size() const { return static_cast<int>(pieces_.size()); }
  int unk_id() const { return unk_id_; }
  int eos_id() const { return eos_id_; }
  int pad_id() const { return pad_id_; }

 private:
  struct Piece {
    std::string text;
    float score = 0;
    int type = 1;  // NORMAL 1, UNKNOWN 2, CONTROL 3, USER_DEFINED 4, UNUSED 5, BYTE 6
  };
  // Longest replacement of a prefix of `in` by the charsmap: (replacement, bytes consumed).
  std::pair<std::string, size_t> normalize_prefix(const char* in, size_t n) const;

  std::vector<Piece> pieces_;
  std::unordered_map<std::string, int> index_;
  size_t max_piece_bytes_ = 0;
  float min_score_ = 0, max_score_ = 0;
  int unk_id_ = 0, eos_id_ = 2, pad_id_ = -1;
  bool byte_fallback_ = false;
  bool add_dummy_prefix_ = true, remove_extra_whitespaces_ = true, escape_whitespaces_ = true;
  std::vector<uint32_t> trie_;  // darts-clone units
  std::string normalized_;      // the replacement strings, NUL-separated
};

}  // namespace difftrain::models::detail
