// Qwen2's byte-level BPE tokenizer: every case of tests/golden/z_image/tokenizer/expected.json
// (the slow Qwen2Tokenizer's algorithm in plain Python, make_tokenizer.py) from tokenizer.json and
// from vocab.json + merges.txt alike; padding and truncation as the pipeline asks; decoding; the
// one-line refusals of broken folders.
#include "difftrain/models/tokenizers/qwen2_tokenizer.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

using difftrain::models::Qwen2Tokenizer;
using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::temp_dir;
using difftrain::test::write_text;
using nlohmann::json;
namespace fs = std::filesystem;

const std::string kDir = kGoldenDir + "z_image/tokenizer";

json expected() {
  std::ifstream in(kDir + "/expected.json");
  return json::parse(in);
}

// A copy of the fixture folder without the files in `drop`.
std::string copy_without(const std::string& stem, const std::vector<std::string>& drop) {
  const auto dir = temp_dir(stem);
  for (const auto& entry : fs::directory_iterator(kDir)) {
    const auto name = entry.path().filename().string();
    if (std::find(drop.begin(), drop.end(), name) == drop.end()) {
      fs::copy_file(entry.path(), fs::path(dir) / name, fs::copy_options::overwrite_existing);
    }
  }
  return dir;
}

TEST(Qwen2Tokenizer, EveryHardCaseMatchesTheReferenceFromEitherFileSet) {
  const auto cases = expected().at("cases");
  ASSERT_GE(cases.size(), 25u);
  const auto from_json = Qwen2Tokenizer::from_folder(kDir);
  const auto from_txt =
      Qwen2Tokenizer::from_folder(copy_without("qwen2_tok_txt", {"tokenizer.json"}));
  for (const auto& c : cases) {
    const auto text = c.at("text").get<std::string>();
    const auto want = c.at("ids").get<std::vector<int64_t>>();
    EXPECT_EQ(from_json.encode(text), want) << json(text).dump();
    EXPECT_EQ(from_txt.encode(text), want) << json(text).dump();
  }
}

TEST(Qwen2Tokenizer, AddedTokensAreSplitOutFirstAndDecodeBack) {
  const auto t = Qwen2Tokenizer::from_folder(kDir);
  const auto start = t.token_id("<|im_start|>");
  const auto end = t.token_id("<|im_end|>");
  ASSERT_TRUE(start && end);
  const auto ids = t.encode("<|im_start|>user\nhi<|im_end|>");
  ASSERT_GE(ids.size(), 3u);
  EXPECT_EQ(ids.front(), *start);
  EXPECT_EQ(ids.back(), *end);
  EXPECT_EQ(t.pad_id(), *t.token_id("<|endoftext|>"));
  EXPECT_EQ(t.model_max_length(), 131072);
  // Decoding gives the text back (NFC applied), added tokens as their text.
  for (const std::string& text : {std::string("<|im_start|>user\nA cat on a chair<|im_end|>"),
                                  std::string("小狗在山上跑 🙂 café\t\n  x")}) {
    EXPECT_EQ(t.decode(t.encode(text)), text);
  }
  // Byte-level symbols: a space is part of the next word's first symbol ("Ġ").
  const auto tokens = t.tokens("a cat");
  ASSERT_EQ(tokens.size(), 2u);
  EXPECT_EQ(tokens[1].rfind("\xC4\xA0", 0), 0u);  // U+0120
}

TEST(Qwen2Tokenizer, PaddingAndTruncationAsThePipelineAsks) {
  const auto t = Qwen2Tokenizer::from_folder(kDir);
  const auto ids = t.encode("a photo of a cat sitting on a red chair");
  const auto padded = t.encode_padded("a photo of a cat sitting on a red chair", 32);
  ASSERT_EQ(padded.input_ids.size(), 32u);
  ASSERT_EQ(padded.attention_mask.size(), 32u);
  EXPECT_FALSE(padded.truncated);
  EXPECT_EQ(padded.num_tokens, static_cast<int64_t>(ids.size()));
  for (size_t i = 0; i < 32; ++i) {
    EXPECT_EQ(padded.input_ids[i], i < ids.size() ? ids[i] : t.pad_id());
    EXPECT_EQ(padded.attention_mask[i], i < ids.size() ? 1 : 0);
  }
  const auto cut = t.encode_padded("a photo of a cat sitting on a red chair", 4);
  EXPECT_TRUE(cut.truncated);
  EXPECT_EQ(cut.input_ids, std::vector<int64_t>(ids.begin(), ids.begin() + 4));
  EXPECT_EQ(cut.attention_mask, std::vector<int64_t>(4, 1));
  const auto empty = t.encode_padded("", 3);
  EXPECT_EQ(empty.input_ids, std::vector<int64_t>(3, t.pad_id()));
  EXPECT_EQ(empty.attention_mask, std::vector<int64_t>(3, 0));
  EXPECT_NE(error_of([&] { (void)t.encode_padded("x", 0); }).find("max_length 0"),
            std::string::npos);
}

TEST(Qwen2Tokenizer, BrokenFoldersAreRefusedInOneLine) {
  const auto one_line = [](const std::string& message, const std::string& part) {
    EXPECT_NE(message.find(part), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  };
  one_line(error_of([] { (void)Qwen2Tokenizer::from_folder("/nonexistent/tok"); }),
           "needs tokenizer.json, or vocab.json and merges.txt");
  one_line(error_of([] {
             (void)Qwen2Tokenizer::from_folder(
                 copy_without("qwen2_tok_none", {"tokenizer.json", "merges.txt"}));
           }),
           "merges.txt': a Qwen2 tokenizer folder needs");
  auto dir = copy_without("qwen2_tok_badjson", {});
  write_text(dir + "/tokenizer.json", "{\"model\": ");
  one_line(error_of([&] { (void)Qwen2Tokenizer::from_folder(dir); }), "not valid JSON");
  dir = copy_without("qwen2_tok_merge", {"tokenizer.json"});
  write_text(dir + "/merges.txt", "#version: 0.2\nq zz\n");
  one_line(error_of([&] { (void)Qwen2Tokenizer::from_folder(dir); }),
           "joins symbols the vocabulary lacks");
  dir = copy_without("qwen2_tok_pattern", {});
  {
    std::ifstream in(kDir + "/tokenizer.json");
    auto j = json::parse(in);
    j["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "(unclosed";
    write_text(dir + "/tokenizer.json", j.dump());
  }
  one_line(error_of([&] { (void)Qwen2Tokenizer::from_folder(dir); }), "does not compile");
  dir = copy_without("qwen2_tok_pad", {});
  write_text(dir + "/tokenizer_config.json", "{\"pad_token\": \"<|nope|>\"}");
  one_line(error_of([&] { (void)Qwen2Tokenizer::from_folder(dir); }), "pad_token \"<|nope|>\"");
}

}  // namespace
