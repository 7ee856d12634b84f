// Fuzzes loading a CLIP tokenizer folder (models::ClipTokenizer::from_folder): the input holds
// vocab.json, merges.txt, tokenizer_config.json and added_tokens.json separated by lines
// "--8<--" (see split_parts); an empty part is an absent file. The tokenizer then encodes a prompt.
#include "difftrain/models/tokenizers/clip_tokenizer.h"
#include "fuzz_files.h"
#include "fuzz_util.h"

#include <filesystem>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    const auto parts = difftrain::fuzz::split_parts<4>(bytes);
    const char* names[] = {"vocab.json", "merges.txt", "tokenizer_config.json",
                           "added_tokens.json"};
    std::string dir;
    for (size_t i = 0; i < parts.size(); ++i) {
      const std::string path =
          difftrain::fuzz::write_scratch(std::string("tok/") + names[i], parts[i]);
      if (i >= 2 && parts[i].empty()) std::filesystem::remove(path);
      dir = std::filesystem::path(path).parent_path().string();
    }
    auto tokenizer = difftrain::models::ClipTokenizer::from_folder(dir);
    if (tokenizer.model_max_length() > 4096) tokenizer.set_model_max_length(77);
    (void)tokenizer.encode("a photo of a <|endoftext|> cat, hello!! 123 don't");
  });
}
