// T5Tokenizer over the SentencePiece unigram model (t5_tokenizer.h, sentencepiece_unigram.h).
#include "difftrain/models/tokenizers/t5_tokenizer.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "sentencepiece_unigram.h"

#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>

namespace difftrain::models {
namespace fs = std::filesystem;

struct T5Tokenizer::Processor {
  explicit Processor(const std::string& bytes, const std::string& source) : sp(bytes, source) {}
  detail::SentencePieceUnigram sp;
};

T5Tokenizer T5Tokenizer::load(const std::string& dir) {
  const fs::path model = fs::path(dir) / "spiece.model";
  std::error_code ec;
  if (!fs::is_regular_file(model, ec)) {
    throw Error(model.string() +
                ": no such file; expected a T5 tokenizer folder with the SentencePiece model "
                "spiece.model (a FluxPipeline's tokenizer_2/)");
  }
  auto p = std::make_shared<Processor>(io::read_file(model.string()), model.string());
  T5Tokenizer t;
  t.dir_ = dir;
  t.pieces_ = p->sp.piece_size();
  t.pad_id_ = p->sp.pad_id() >= 0 ? p->sp.pad_id() : 0;
  t.eos_id_ = p->sp.eos_id() >= 0 ? p->sp.eos_id() : 1;
  const fs::path config = fs::path(dir) / "tokenizer_config.json";
  if (fs::is_regular_file(config, ec)) {
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(io::read_file(config.string()));
    } catch (const nlohmann::json::exception& e) {
      throw Error(config.string() + ": not valid JSON (" + e.what() + ")");
    }
    if (j.contains("extra_ids") && j["extra_ids"].is_number_integer()) {
      t.extra_ids_ = j["extra_ids"].get<int64_t>();
    }
    // Transformers writes 1e30 for "no limit"; only a real length is taken.
    if (j.contains("model_max_length") && j["model_max_length"].is_number_integer()) {
      t.model_max_length_ = j["model_max_length"].get<int64_t>();
    }
    if (t.extra_ids_ < 0) {
      throw Error(config.string() + ": extra_ids is " + std::to_string(t.extra_ids_) +
                  "; it must be >= 0");
    }
  }
  t.sp_ = std::move(p);
  return t;
}

std::vector<std::string> T5Tokenizer::pieces(const std::string& text) const {
  std::vector<std::string> out;
  for (auto& p : sp_->sp.encode(text)) out.push_back(std::move(p.first));
  return out;
}

std::vector<int64_t> T5Tokenizer::piece_ids(const std::string& text) const {
  std::vector<int64_t> out;
  for (const auto& p : sp_->sp.encode(text)) out.push_back(p.second);
  return out;
}

std::vector<int64_t> T5Tokenizer::encode(const std::string& text, int64_t max_length,
                                         bool* truncated) const {
  if (max_length < 1) {
    throw Error("T5 tokenizer: max_length is " + std::to_string(max_length) +
                "; it must be at least 1 (room for </s>)");
  }
  std::vector<int64_t> ids = piece_ids(text);
  const auto keep = static_cast<size_t>(max_length - 1);
  if (truncated != nullptr) *truncated = ids.size() > keep;
  if (ids.size() > keep) ids.resize(keep);
  ids.push_back(eos_id_);
  ids.resize(static_cast<size_t>(max_length), pad_id_);
  return ids;
}

torch::Tensor T5Tokenizer::operator()(const std::vector<std::string>& prompts,
                                      int64_t max_length) const {
  std::vector<int64_t> all;
  for (const auto& p : prompts) {
    const auto ids = encode(p, max_length);
    all.insert(all.end(), ids.begin(), ids.end());
  }
  return torch::tensor(all, torch::kInt64)
      .reshape({static_cast<int64_t>(prompts.size()), max_length});
}

}  // namespace difftrain::models
