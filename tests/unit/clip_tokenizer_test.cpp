// CLIP tokenizer: every case of tests/golden/sd/tiny_sd/tokenizer_cases.json (ids, tokens,
// truncation), Unicode cleanup (NFC, HTML entities, lower-case, letters and numbers beyond
// ASCII), special and added tokens, SD-2-style padding, the word cache under threads, and every
// loading error.

#include "difftrain/models/tokenizers/clip_tokenizer.h"
#include "difftrain/core/error.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <thread>

namespace difftrain::models {
// The private hook tests and the benchmark use to see and empty the word cache.
struct ClipTokenizerTestPeer {
  static void clear_cache(const ClipTokenizer& t) { t.clear_word_cache(); }
  static size_t cache_size(const ClipTokenizer& t) { return t.word_cache_size(); }
};
}  // namespace difftrain::models

namespace {

using difftrain::models::ClipTokenizer;
using difftrain::models::ClipTokenizerTestPeer;
using difftrain::test::error_of;
using difftrain::test::temp_dir;
using nlohmann::json;
namespace fs = std::filesystem;

using difftrain::test::kTinySdGolden;
const std::string kTokenizerDir = kTinySdGolden + "tokenizer";

// Loading the 49408-entry vocabulary takes a moment: the tests share one tokenizer.
const ClipTokenizer& fixture() {
  static const ClipTokenizer t = ClipTokenizer::from_folder(kTokenizerDir);
  return t;
}

json cases() {
  std::ifstream in(kTinySdGolden + "tokenizer_cases.json");
  return json::parse(in);
}

std::vector<int64_t> concat(std::initializer_list<std::vector<int64_t>> parts) {
  std::vector<int64_t> out;
  for (const auto& p : parts) out.insert(out.end(), p.begin(), p.end());
  return out;
}

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

// A folder with the fixture's vocab.json and merges.txt and the given tokenizer_config.json.
std::string copy_of_fixture(const std::string& stem, const std::string& config) {
  const auto dir = temp_dir(stem);
  fs::copy_file(kTokenizerDir + "/vocab.json", dir + "/vocab.json");
  fs::copy_file(kTokenizerDir + "/merges.txt", dir + "/merges.txt");
  if (!config.empty()) write(dir + "/tokenizer_config.json", config);
  return dir;
}

// A tiny hand-made tokenizer: two merges, two special tokens, no byte symbols.
std::string tiny_folder(const std::string& stem, const std::string& vocab,
                        const std::string& merges) {
  const auto dir = temp_dir(stem);
  write(dir + "/vocab.json", vocab);
  write(dir + "/merges.txt", merges);
  return dir;
}
const std::string kTinyVocab =
    R"({"<|startoftext|>": 0, "<|endoftext|>": 1, "a": 2, "b": 3, "a</w>": 4, "b</w>": 5,
        "ab</w>": 6, "ab": 7})";
const std::string kTinyMerges = "#version: 0.2\na b</w>\na b\n";

TEST(ClipTokenizer, LoadsTheFixtureFolder) {
  const auto& t = fixture();
  EXPECT_EQ(t.bos_id(), 49406);
  EXPECT_EQ(t.eos_id(), 49407);
  EXPECT_EQ(t.pad_id(), 49407);
  EXPECT_EQ(t.unk_id(), 49407);
  EXPECT_EQ(t.model_max_length(), 77);
  EXPECT_EQ(t.vocab_size(), 49408);
  // Known ids (tests/golden/sd/README.md).
  EXPECT_EQ(t.bpe_ids("a photo of a cat !"),
            (std::vector<int64_t>{320, 1125, 539, 320, 2368, 256}));
}

TEST(ClipTokenizer, EveryFixtureCaseMatchesHuggingFace) {
  const auto& t = fixture();
  const auto all = cases();
  ASSERT_EQ(all.at("cases").size(), 25u);
  int truncated = 0;
  std::vector<std::string> prompts;
  for (const auto& c : all.at("cases")) {
    const auto prompt = c.at("prompt").get<std::string>();
    SCOPED_TRACE("prompt: " + json(prompt).dump());
    const auto ids = c.at("bpe_ids").get<std::vector<int64_t>>();
    EXPECT_EQ(t.bpe_ids(prompt), ids);
    EXPECT_EQ(t.bpe_tokens(prompt), c.at("bpe_tokens").get<std::vector<std::string>>());
    const auto e = t.encode(prompt);
    EXPECT_EQ(e.input_ids, c.at("input_ids").get<std::vector<int64_t>>());
    EXPECT_EQ(e.truncated, c.at("truncated").get<bool>());
    EXPECT_EQ(e.num_tokens, static_cast<int64_t>(ids.size()));
    truncated += e.truncated;
    prompts.push_back(prompt);
  }
  EXPECT_EQ(truncated, 1);
  // encode_batch stacks the same rows.
  const auto batch = t.encode_batch(prompts);
  ASSERT_EQ(batch.sizes(), (std::vector<int64_t>{25, 77}));
  EXPECT_EQ(batch.scalar_type(), torch::kLong);
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto row = all.at("cases")[i].at("input_ids").get<std::vector<int64_t>>();
    EXPECT_TRUE(torch::equal(batch[static_cast<int64_t>(i)], torch::tensor(row))) << i;
  }
  EXPECT_EQ(t.encode_batch({}).sizes(), (std::vector<int64_t>{0, 77}));
}

TEST(ClipTokenizer, NfcComposesDecomposedText) {
  const auto& t = fixture();
  const std::string composed = "caf\u00e9 au lait", decomposed = "cafe\u0301 au lait";
  EXPECT_NE(composed, decomposed);
  EXPECT_EQ(t.bpe_ids(decomposed), t.bpe_ids(composed));
  EXPECT_EQ(t.bpe_tokens(decomposed)[0], "caf\u00c3\u00a9</w>");  // é's two bytes, GPT-2 mapped
  // Without NFC the combining accent (Mn, not a letter) would end the word "cafe".
  EXPECT_EQ(t.bpe_tokens("e\u0301")[0], t.bpe_tokens("\u00e9")[0]);
  // Compatibility forms are not NFC's business: the Angstrom sign becomes Å, "ﬁ" (a ligature)
  // is split by ftfy's ligature fix, fullwidth letters become ASCII.
  EXPECT_EQ(t.bpe_ids("\u212b"), t.bpe_ids("\u00e5"));
  EXPECT_EQ(t.bpe_ids("\ufb01sh"), t.bpe_ids("fish"));
  EXPECT_EQ(t.bpe_ids("\uff43\uff41\uff54"), t.bpe_ids("cat"));
}

TEST(ClipTokenizer, NonAsciiLettersAndNumbersFollowThePattern) {
  const auto& t = fixture();
  const auto words = [&](const std::string& text) {
    int n = 0;
    for (const auto& tok : t.bpe_tokens(text))
      n += tok.size() >= 4 && tok.substr(tok.size() - 4) == "</w>";
    return n;
  };
  // Runs of letters (Cyrillic, CJK, Greek) are one word each.
  EXPECT_EQ(words("\u043a\u043e\u0442 \u043d\u0430 \u043a\u0440\u044b\u0448\u0435"), 3);
  EXPECT_EQ(words("\u6771\u4eac\u30bf\u30ef\u30fc"), 1);  // 東京タワー: Lo and Lm letters
  EXPECT_EQ(t.bpe_ids("\u6771\u4eac2024"),
            concat({t.bpe_ids("\u6771\u4eac"), t.bpe_ids("2"), t.bpe_ids("0"), t.bpe_ids("2"),
                    t.bpe_ids("4")}));
  // Numbers of any script go one character at a time: Arabic-Indic digits (Nd), superscript two
  // (No), Roman numeral twelve (Nl).
  EXPECT_EQ(words("\u0663\u0664\u0665"), 3);
  EXPECT_EQ(t.bpe_ids("\u0663\u0664\u0665"),
            concat({t.bpe_ids("\u0663"), t.bpe_ids("\u0664"), t.bpe_ids("\u0665")}));
  EXPECT_EQ(t.bpe_ids("x\u00b2"), concat({t.bpe_ids("x"), t.bpe_ids("\u00b2")}));
  EXPECT_EQ(words("\u216b"), 1);
  // Symbols that are neither letters nor numbers run together: "©™" is one word, "a©" two.
  EXPECT_EQ(words("\u00a9\u2122"), 1);
  EXPECT_EQ(words("a\u00a9"), 2);
  // Unicode lower-case, as Python's str.lower(): Cyrillic, Greek final sigma, dotted I.
  EXPECT_EQ(t.bpe_ids("\u041a\u041e\u0422"), t.bpe_ids("\u043a\u043e\u0442"));
  EXPECT_EQ(t.bpe_ids("\u039f\u0394\u039f\u03a3"), t.bpe_ids("\u03bf\u03b4\u03bf\u03c2"));
  EXPECT_EQ(t.bpe_ids("\u03a3"), t.bpe_ids("\u03c3"));
  EXPECT_EQ(t.bpe_ids("\u0130"), t.bpe_ids("i\u0307"));
  EXPECT_EQ(words("\u0130"), 2);  // "i" and the combining dot, a symbol
  // Unicode whitespace separates words like a space does.
  EXPECT_EQ(t.bpe_ids("cat\u3000dog\u00a0bird\u2003fish"), t.bpe_ids("cat dog bird fish"));
  // Ill-formed UTF-8 becomes U+FFFD instead of failing.
  EXPECT_EQ(t.bpe_ids("a\xff"), t.bpe_ids("a\ufffd"));
}

TEST(ClipTokenizer, HtmlEntitiesAndQuotesAreCleanedUpLikeFtfy) {
  const auto& t = fixture();
  EXPECT_EQ(t.bpe_ids("fish &amp; chips"), t.bpe_ids("fish & chips"));
  EXPECT_EQ(t.bpe_ids("&lt;tag&gt;"), t.bpe_ids("<tag>"));
  EXPECT_EQ(t.bpe_ids("&quot;hi&quot; it&#39;s"), t.bpe_ids("\"hi\" it's"));
  EXPECT_EQ(t.bpe_ids("&#65;&#x42;&#X43;"), t.bpe_ids("abc"));
  EXPECT_EQ(t.bpe_ids("caf&eacute; &copy;"), t.bpe_ids("caf\u00e9 \u00a9"));
  EXPECT_EQ(t.bpe_ids("a&nbsp;b"), t.bpe_ids("a b"));
  EXPECT_EQ(t.bpe_ids("&#128;"), t.bpe_ids("\u20ac"));  // Windows-1252, as html.unescape
  EXPECT_EQ(t.bpe_ids("&#0;"), t.bpe_ids("\ufffd"));
  EXPECT_EQ(t.bpe_ids("&amp;amp;"), t.bpe_ids("&"));  // ftfy repeats until stable
  // Unknown names and incomplete references stay as they are.
  EXPECT_EQ(t.bpe_ids("&bogus;"), concat({t.bpe_ids("&"), t.bpe_ids("bogus"), t.bpe_ids(";")}));
  EXPECT_EQ(t.bpe_ids("&amp"), concat({t.bpe_ids("&"), t.bpe_ids("amp")}));
  // A line holding a literal '<' may be HTML: from there on nothing is unescaped (ftfy "auto").
  EXPECT_EQ(t.bpe_ids("<b>&amp;</b>"),
            concat({t.bpe_ids("<"), t.bpe_ids("b"), t.bpe_ids(">&"), t.bpe_ids("amp"),
                    t.bpe_ids(";</"), t.bpe_ids("b"), t.bpe_ids(">")}));
  EXPECT_EQ(t.bpe_ids("&amp;\n<b>\n&amp;"), t.bpe_ids("& <b> &amp;"));
  // Curly quotes are straightened, so the contraction is found.
  EXPECT_EQ(t.bpe_tokens("don\u2019t"), (std::vector<std::string>{"don</w>", "'t</w>"}));
  EXPECT_EQ(t.bpe_ids("\u201chi\u201d"), t.bpe_ids("\"hi\""));
}

TEST(ClipTokenizer, SpecialTokensInTheTextMapToTheirIds) {
  const auto& t = fixture();
  EXPECT_EQ(t.bpe_ids("a <|endoftext|> cat"), (std::vector<int64_t>{320, 49407, 2368}));
  EXPECT_EQ(t.bpe_ids("<|startoftext|>x"), concat({{49406}, t.bpe_ids("x")}));
  // Split before cleanup, as HF's added-token split: a symbol run before one stays apart.
  EXPECT_EQ(t.bpe_ids("!!<|endoftext|>"), concat({t.bpe_ids("!!"), {49407}}));
  // Upper case reaches the pattern lower-cased, which matches the special token too.
  EXPECT_EQ(t.bpe_ids("<|ENDOFTEXT|>"), (std::vector<int64_t>{49407}));
  EXPECT_EQ(t.bpe_tokens("<|endoftext|>"), (std::vector<std::string>{"<|endoftext|>"}));
}

TEST(ClipTokenizer, MergesByRankAndUnknownPieces) {
  const auto dir = tiny_folder("clip_tok_tiny", kTinyVocab, kTinyMerges);
  const auto t = ClipTokenizer::from_folder(dir);
  EXPECT_EQ(t.vocab_size(), 8);
  EXPECT_EQ(t.bpe_tokens("ab"), (std::vector<std::string>{"ab</w>"}));
  // "aab": only (a, b</w>) has a rank; (a, ab</w>) has none.
  EXPECT_EQ(t.bpe_tokens("aab"), (std::vector<std::string>{"a", "ab</w>"}));
  EXPECT_EQ(t.bpe_ids("aab"), (std::vector<int64_t>{2, 6}));
  // Pieces missing from the vocabulary get unk_id (here <|endoftext|>, 1).
  EXPECT_EQ(t.bpe_ids("c ab"), (std::vector<int64_t>{1, 6}));
  EXPECT_EQ(t.bpe_tokens("c"), (std::vector<std::string>{"c</w>"}));
}

TEST(ClipTokenizer, WordCacheGivesIdenticalIdsAcrossCallsAndThreads) {
  const auto t = ClipTokenizer::from_folder(kTokenizerDir);  // its own cache
  std::vector<std::string> prompts;
  std::vector<std::vector<int64_t>> want;
  const auto all = cases();
  for (const auto& c : all.at("cases")) {
    prompts.push_back(c.at("prompt").get<std::string>());
    want.push_back(c.at("input_ids").get<std::vector<int64_t>>());
  }
  prompts.push_back("\u043a\u043e\u0442 caf\u00e9 \u6771\u4eac");
  want.push_back(t.encode(prompts.back()).input_ids);
  ClipTokenizerTestPeer::clear_cache(t);
  ASSERT_EQ(ClipTokenizerTestPeer::cache_size(t), 0u);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(t.encode(prompts[i]).input_ids, want[i]);
  const size_t cached = ClipTokenizerTestPeer::cache_size(t);
  EXPECT_GT(cached, 100u);
  for (size_t i = 0; i < prompts.size(); ++i) EXPECT_EQ(t.encode(prompts[i]).input_ids, want[i]);
  EXPECT_EQ(ClipTokenizerTestPeer::cache_size(t), cached);  // warm: nothing new

  // Four threads on a cold cache, each in its own order, through copies that share it.
  ClipTokenizerTestPeer::clear_cache(t);
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int k = 0; k < 4; ++k) {
    threads.emplace_back([&, k] {
      const ClipTokenizer copy = t;
      for (int round = 0; round < 20; ++round) {
        for (size_t j = 0; j < prompts.size(); ++j) {
          const size_t i = (j * (k + 1) + static_cast<size_t>(round)) % prompts.size();
          mismatches[static_cast<size_t>(k)] += copy.encode(prompts[i]).input_ids != want[i];
        }
      }
    });
  }
  for (auto& th : threads) th.join();
  EXPECT_EQ(mismatches, std::vector<int>(4, 0));
  EXPECT_EQ(ClipTokenizerTestPeer::cache_size(t), cached);
}

TEST(ClipTokenizer, Sd2StylePadTokenPadsWithIdZero) {
  // SD 2.x's tokenizer_config.json: pad_token "!" (a plain string), the others AddedTokens.
  const auto dir = copy_of_fixture("clip_tok_sd2", R"({
    "bos_token": {"__type": "AddedToken", "content": "<|startoftext|>", "lstrip": false},
    "eos_token": {"__type": "AddedToken", "content": "<|endoftext|>"},
    "unk_token": {"__type": "AddedToken", "content": "<|endoftext|>"},
    "pad_token": "!", "model_max_length": 77, "tokenizer_class": "CLIPTokenizer"})");
  const auto t = ClipTokenizer::from_folder(dir);
  EXPECT_EQ(t.pad_id(), 0);
  EXPECT_EQ(t.eos_id(), 49407);
  const auto e = t.encode("a photo of a cat");
  std::vector<int64_t> want = {49406, 320, 1125, 539, 320, 2368, 49407};
  want.resize(77, 0);
  EXPECT_EQ(e.input_ids, want);
  // As in HF (diffusers issue #4153), the pad token's text is split out of prompts too: every
  // "!" is id 0 here, where SD 1.x gives "!</w>" (256) or "!!!</w>".
  EXPECT_EQ(t.bpe_ids("wow!!"), concat({fixture().bpe_ids("wow"), {0, 0}}));
  EXPECT_EQ(fixture().bpe_ids("wow!!"),
            concat({fixture().bpe_ids("wow"), fixture().bpe_ids("!!")}));
  fs::remove_all(dir);
}

TEST(ClipTokenizer, AddedTokensAreSplitOutAndGetTheirIds) {
  const auto dir = copy_of_fixture("clip_tok_added", "");
  write(dir + "/added_tokens.json", R"({"<cat-toy>": 49408})");
  const auto t = ClipTokenizer::from_folder(dir);
  EXPECT_EQ(t.vocab_size(), 49409);
  EXPECT_EQ(t.bpe_ids("a photo of <cat-toy>!"),
            concat({fixture().bpe_ids("a photo of"), {49408}, fixture().bpe_ids("!")}));
  fs::remove_all(dir);
}

TEST(ClipTokenizer, SetModelMaxLengthPadsAndTruncatesToIt) {
  auto t = fixture();  // a copy: the shared fixture keeps 77
  const std::string prompt = "a highly detailed painting of a castle";
  const auto ids = t.bpe_ids(prompt);
  ASSERT_EQ(ids.size(), 7u);
  t.set_model_max_length(6);
  auto e = t.encode(prompt);
  EXPECT_EQ(e.input_ids, concat({{49406}, {ids.begin(), ids.begin() + 4}, {49407}}));
  EXPECT_TRUE(e.truncated);
  EXPECT_EQ(e.num_tokens, 7);
  t.set_model_max_length(9);
  e = t.encode(prompt);
  EXPECT_EQ(e.input_ids, concat({{49406}, ids, {49407}}));
  EXPECT_FALSE(e.truncated);
  t.set_model_max_length(2);
  EXPECT_EQ(t.encode(prompt).input_ids, (std::vector<int64_t>{49406, 49407}));
  EXPECT_EQ(t.encode_batch({prompt, ""}).sizes(), (std::vector<int64_t>{2, 2}));
  EXPECT_EQ(fixture().model_max_length(), 77);
  EXPECT_NE(error_of([&] { t.set_model_max_length(1); }).find("not in [2, 65536]"),
            std::string::npos);
  EXPECT_EQ(t.model_max_length(), 2);
}

// Every loading error: one line, naming the file (and line) and what to do.
void expect_error(const std::string& message, const std::vector<std::string>& parts) {
  EXPECT_EQ(message.find('\n'), std::string::npos) << message;
  for (const auto& p : parts) EXPECT_NE(message.find(p), std::string::npos) << message;
}

TEST(ClipTokenizer, MissingFolderOrFilesAreErrors) {
  expect_error(error_of([] { ClipTokenizer::from_folder("/nonexistent/tokenizer"); }),
               {"CLIP tokenizer folder '/nonexistent/tokenizer' does not exist", "tokenizer/"});
  const auto dir = temp_dir("clip_tok_missing");
  expect_error(error_of([&] { ClipTokenizer::from_folder(dir); }),
               {"cannot open '" + dir + "/vocab.json'", "vocab.json and merges.txt"});
  write(dir + "/vocab.json", kTinyVocab);
  expect_error(error_of([&] { ClipTokenizer::from_folder(dir); }),
               {"cannot open '" + dir + "/merges.txt'"});
  expect_error(error_of([] { ClipTokenizer().bpe_ids("a"); }),
               {"ClipTokenizer is empty", "from_folder"});
  fs::remove_all(dir);
}

TEST(ClipTokenizer, MalformedVocabIsAnError) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> bad = {
      {R"({"a": 0,)", {"vocab.json: not valid JSON", "parse error"}},
      {R"(["a", "b"])", {"vocab.json: expected a JSON object of token -> id, got array"}},
      {R"({"a": 0, "b": "1"})", {"vocab.json: the id of token \"b\" is \"1\"", "integer >= 0"}},
      {R"({"a": 0, "b": -3})", {"the id of token \"b\" is -3"}},
      {R"({"a": 0, "b": 1.5})", {"the id of token \"b\" is 1.5"}},
  };
  for (const auto& [vocab, parts] : bad) {
    const auto dir = tiny_folder("clip_tok_vocab", vocab, kTinyMerges);
    expect_error(error_of([&] { ClipTokenizer::from_folder(dir); }), parts);
    fs::remove_all(dir);
  }
}

TEST(ClipTokenizer, MalformedMergesLineIsAnErrorNamingTheLine) {
  const std::vector<std::pair<std::string, std::vector<std::string>>> bad = {
      {"#version: 0.2\na b</w>\na b c\n",
       {"merges.txt:3: expected two symbols", "\"a b c\"", "(3 symbols)",
        "merges.txt saved with the tokenizer"}},
      {"#version: 0.2\na b</w>\n\nab\n", {"merges.txt:3:", "(0 symbols)"}},
      {"\n\n#version: 0.2\nab\n", {"merges.txt:4:", "\"ab\" (1 symbols)"}},
  };
  for (const auto& [merges, parts] : bad) {
    const auto dir = tiny_folder("clip_tok_merges", kTinyVocab, merges);
    expect_error(error_of([&] { ClipTokenizer::from_folder(dir); }), parts);
    fs::remove_all(dir);
  }
  // HF's limit: only the first 48894 merges are read (file lines 2..48895), so a bad line after
  // them is never seen, and the last one read is.
  std::string many = "#version: 0.2\n";
  for (int i = 0; i < 48893; ++i) many += "a b\n";
  auto dir = tiny_folder("clip_tok_merges", kTinyVocab, many + "a b c\n");
  expect_error(error_of([&] { ClipTokenizer::from_folder(dir); }), {"merges.txt:48895:"});
  fs::remove_all(dir);
  dir = tiny_folder("clip_tok_merges", kTinyVocab, many + "a b\na b c\n");
  EXPECT_NO_THROW(ClipTokenizer::from_folder(dir));
  fs::remove_all(dir);
}

TEST(ClipTokenizer, BadSpecialTokensAndConfigAreErrors) {
  const auto with_config = [](const std::string& config) {
    const auto dir = tiny_folder("clip_tok_config", kTinyVocab, kTinyMerges);
    write(dir + "/tokenizer_config.json", config);
    auto message = error_of([&] { ClipTokenizer::from_folder(dir); });
    fs::remove_all(dir);
    return message;
  };
  expect_error(with_config(R"({"bos_token": {"content": "<|bos|>"}})"),
               {"vocab.json: the bos_token \"<|bos|>\"", "tokenizer_config.json",
                "is not in the vocabulary"});
  expect_error(with_config(R"({"pad_token": "!"})"),
               {"the pad_token \"!\"", "not in the vocabulary"});
  expect_error(with_config(R"({"pad_token": 7})"),
               {"tokenizer_config.json: pad_token is 7", "AddedToken object"});
  expect_error(with_config(R"({"eos_token": {"lstrip": false}})"),
               {"eos_token is {\"lstrip\":false}"});
  expect_error(with_config(R"({"model_max_length": 1})"),
               {"tokenizer_config.json: model_max_length is 1", "at least 2"});
  expect_error(with_config(R"({"model_max_length": "77"})"), {"model_max_length is \"77\""});
  expect_error(with_config(R"([1])"), {"tokenizer_config.json: expected a JSON object, got array"});
  expect_error(with_config(R"({"added_tokens_decoder": {"x": {"content": "a"}}})"),
               {"added_tokens_decoder entry \"x\""});

  // special_tokens_map.json overrides tokenizer_config.json, as in HF.
  const auto dir = tiny_folder("clip_tok_map", kTinyVocab, kTinyMerges);
  write(dir + "/tokenizer_config.json", R"({"pad_token": "<|endoftext|>"})");
  write(dir + "/special_tokens_map.json", R"({"pad_token": {"content": "<|unknown|>"}})");
  expect_error(error_of([&] { ClipTokenizer::from_folder(dir); }),
               {"pad_token \"<|unknown|>\"", "special_tokens_map.json"});
  write(dir + "/special_tokens_map.json", R"({"pad_token": {"content": "a</w>"}})");
  EXPECT_EQ(ClipTokenizer::from_folder(dir).pad_id(), 4);
  fs::remove_all(dir);
}

TEST(ClipTokenizer, HugeModelMaxLengthMustBeOverriddenBeforeEncoding) {
  // Tokenizers saved without a limit carry HF's VERY_LARGE_INTEGER.
  const auto dir = tiny_folder("clip_tok_huge", kTinyVocab, kTinyMerges);
  write(dir + "/tokenizer_config.json", R"({"model_max_length": 1000000000000000019884624838656})");
  auto t = ClipTokenizer::from_folder(dir);
  EXPECT_EQ(t.model_max_length(), INT64_MAX);
  EXPECT_EQ(t.bpe_ids("ab"), (std::vector<int64_t>{6}));  // no padding: fine
  expect_error(error_of([&] { t.encode("ab"); }), {"model_max_length 9223372036854775807",
                                                   "too long to pad to", "set_model_max_length"});
  t.set_model_max_length(4);
  EXPECT_EQ(t.encode("ab").input_ids, (std::vector<int64_t>{0, 6, 1, 1}));
  fs::remove_all(dir);
}

}  // namespace
