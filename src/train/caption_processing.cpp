// Caption dropout, shuffling and tag dropout (train/caption_processing.h).
#include "difftrain/train/caption_processing.h"

#include "difftrain/core/sample_rng.h"

#include <torch/torch.h>

namespace difftrain::train {
namespace {

std::string trim(const std::string& s) {
  const auto first = s.find_first_not_of(" \t\r\n");
  if (first == std::string::npos) return "";
  const auto last = s.find_last_not_of(" \t\r\n");
  return s.substr(first, last - first + 1);
}

// Python's str.split(sep) with each part trimmed; `drop_empty` leaves out empty parts.
std::vector<std::string> split_tags(const std::string& text, const std::string& sep,
                                    bool drop_empty) {
  std::vector<std::string> out;
  size_t start = 0;
  while (true) {
    const size_t at = sep.empty() ? std::string::npos : text.find(sep, start);
    const std::string part = trim(text.substr(start, at == std::string::npos ? at : at - start));
    if (!drop_empty || !part.empty()) out.push_back(part);
    if (at == std::string::npos) break;
    start = at + sep.size();
  }
  return out;
}

}  // namespace

std::string CaptionProcessing::fixed(const std::string& caption) const {
  std::string c = caption;
  if (!prefix.empty()) c = prefix + " " + c;
  if (!suffix.empty()) c = c + " " + suffix;
  return c;
}

std::string CaptionProcessing::apply(const std::string& caption, uint64_t seed, int64_t epoch,
                                     int64_t key) const {
  if (!drops() && !varies()) return caption;
  auto g = core::sample_generator(seed, epoch, key, core::SampleStream::kCaption);
  const auto uniform = [&g] { return torch::rand({1}, g, torch::kFloat64).item<double>(); };
  // kohya: the rate's draw, then the epoch rule (its current_epoch is 1-based).
  bool drop = dropout_rate > 0 && uniform() < dropout_rate;
  drop = drop || (dropout_every_n_epochs > 0 && (epoch + 1) % dropout_every_n_epochs == 0);
  if (drop) return "";
  if (!varies()) return caption;
  std::vector<std::string> fixed_tokens, flex_tokens, suffix_tokens;
  if (!keep_tokens_separator.empty() && caption.find(keep_tokens_separator) != std::string::npos) {
    const auto at = caption.find(keep_tokens_separator);
    const std::string fixed_part = caption.substr(0, at);
    std::string flex_part = caption.substr(at + keep_tokens_separator.size());
    const auto second = flex_part.find(keep_tokens_separator);
    if (second != std::string::npos) {
      suffix_tokens =
          split_tags(flex_part.substr(second + keep_tokens_separator.size()), separator, true);
      flex_part = flex_part.substr(0, second);
    }
    fixed_tokens = split_tags(fixed_part, separator, true);
    flex_tokens = split_tags(flex_part, separator, true);
  } else {
    // kohya keeps empty tags here (caption.strip().split(sep), each stripped).
    flex_tokens = split_tags(trim(caption), separator, false);
    if (keep_tokens > 0) {
      const auto n = std::min<size_t>(static_cast<size_t>(keep_tokens), flex_tokens.size());
      fixed_tokens.assign(flex_tokens.begin(), flex_tokens.begin() + static_cast<long>(n));
      flex_tokens.erase(flex_tokens.begin(), flex_tokens.begin() + static_cast<long>(n));
    }
  }
  if (shuffle && flex_tokens.size() > 1) {
    // Fisher-Yates from the back, as Python's random.shuffle walks it.
    for (size_t i = flex_tokens.size() - 1; i > 0; --i) {
      const auto j = static_cast<size_t>(
          torch::randint(0, static_cast<int64_t>(i) + 1, {1}, g, torch::kLong).item<int64_t>());
      std::swap(flex_tokens[i], flex_tokens[j]);
    }
  }
  if (tag_dropout_rate > 0) {
    std::vector<std::string> kept;
    for (auto& t : flex_tokens) {
      if (uniform() >= tag_dropout_rate) kept.push_back(std::move(t));
    }
    flex_tokens = std::move(kept);
  }
  std::string out;
  bool first = true;
  for (const auto* part : {&fixed_tokens, &flex_tokens, &suffix_tokens}) {
    for (const auto& t : *part) {
      out += (first ? "" : ", ") + t;
      first = false;
    }
  }
  return out;
}

}  // namespace difftrain::train
