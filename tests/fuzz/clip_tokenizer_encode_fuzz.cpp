// Fuzzes models::ClipTokenizer::encode on arbitrary bytes as the prompt (invalid UTF-8, HTML
// entities, special-token texts, long words), with a small fixed vocabulary written once.
#include "difftrain/models/tokenizers/clip_tokenizer.h"
#include "fuzz_files.h"
#include "fuzz_util.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <optional>

namespace {
std::optional<difftrain::models::ClipTokenizer> tokenizer;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  // Printable ASCII (alone and word-final), a few merges and their results, the special tokens.
  nlohmann::json vocab = nlohmann::json::object();
  int64_t id = 0;
  for (char c = '!'; c <= '~'; ++c) vocab[std::string(1, c)] = id++;
  for (char c = '!'; c <= '~'; ++c) vocab[std::string(1, c) + "</w>"] = id++;
  const char* merges =
      "#version: 0.2\nt h\nth e</w>\na </w>\nc a\nca t</w>\ni n\nin g</w>\n"
      "h e\nl l\nhe ll\nhell o</w>\n";
  for (const char* s : {"th", "the</w>", "a</w>", "ca", "cat</w>", "in", "ing</w>", "he", "ll",
                        "hell", "hello</w>", "<|startoftext|>", "<|endoftext|>"}) {
    vocab[s] = id++;
  }
  difftrain::fuzz::write_scratch("tok/vocab.json", vocab.dump());
  const std::string path = difftrain::fuzz::write_scratch("tok/merges.txt", merges);
  tokenizer = difftrain::models::ClipTokenizer::from_folder(
      std::filesystem::path(path).parent_path().string());
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    const std::string prompt(bytes);
    const auto encoding = tokenizer->encode(prompt);
    (void)tokenizer->bpe_tokens(prompt);
    if (encoding.input_ids.size() != static_cast<size_t>(tokenizer->model_max_length())) abort();
  });
}
