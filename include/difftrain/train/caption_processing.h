#pragma once
// What a training run does to a caption before it is encoded: kohya sd-scripts' prefix and
// suffix, caption dropout (whole caption, every N epochs), tag shuffling with kept tokens, tag
// dropout, and Diffusers' --proportion_empty_prompts (its name for the dropout). Every draw comes
// from the sample's own stream (core::SampleStream::kCaption keyed by seed, epoch and the
// example's index), so the same samples drop on any number of ranks and after a resume.
#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::train {

/// The caption options of a run (the text-image option group's values).
struct CaptionProcessing {
  std::string prefix, suffix;  ///< --caption_prefix / --caption_suffix, joined with a space
  /// --caption_dropout_rate (kohya) or --proportion_empty_prompts (Diffusers): the caption is
  /// replaced by "" with this probability.
  double dropout_rate = 0.0;
  /// --caption_dropout_every_n_epochs: every caption is "" in epochs N, 2N, ... (1-based, as
  /// kohya counts them); 0 = never.
  int64_t dropout_every_n_epochs = 0;
  double tag_dropout_rate = 0.0;  ///< --caption_tag_dropout_rate: each free tag dropped
  bool shuffle = false;           ///< --shuffle_caption: the free tags in random order
  /// --keep_tokens: the first N tags stay in place (without a keep_tokens_separator in the text).
  int64_t keep_tokens = 0;
  /// --keep_tokens_separator: text before it is fixed, after a second one a fixed suffix.
  std::string keep_tokens_separator;
  std::string separator = ",";  ///< --caption_separator between tags

  /// Whether the text can change from epoch to epoch beyond "" (shuffling, tag dropout): such
  /// captions cannot be served from a text-embedding cache.
  bool varies() const { return shuffle || tag_dropout_rate > 0; }
  /// Whether some captions become "" (the cache then holds the empty caption's embedding too).
  bool drops() const { return dropout_rate > 0 || dropout_every_n_epochs > 0; }
  /// Whether fixed() changes a caption.
  bool affixes() const { return !prefix.empty() || !suffix.empty(); }

  /// The caption with prefix and suffix (what every epoch starts from; kohya: "prefix caption
  /// suffix").
  std::string fixed(const std::string& caption) const;

  /// Caption `caption` (fixed() applied already) for example `key` in `epoch` (0-based) under
  /// `seed`, as kohya's BaseDataset.process_caption: "" when dropped (the rate's draw first, then
  /// the epoch rule); else with shuffling or tag dropout the tags split at `separator` and
  /// trimmed (empty ones dropped), the fixed ones (keep_tokens, or before keep_tokens_separator,
  /// and after a second one) in place, the free ones shuffled, then each dropped with
  /// tag_dropout_rate, joined with ", ". Otherwise the caption as given.
  std::string apply(const std::string& caption, uint64_t seed, int64_t epoch, int64_t key) const;
};

}  // namespace difftrain::train
