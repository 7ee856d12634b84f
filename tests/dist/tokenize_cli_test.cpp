// `difftrain tokenize` end to end on the tiny SD fixture: prompts (repeated --prompt, or a
// --prompt_file with every line kept) print the fixture's input_ids, one JSON list per line; a
// truncated prompt warns on stderr; --max_length and --no_padding; bad input exits 1 with one
// line naming the problem.

#include "program_paths.h"
#include "source_dir.h"
#include "subprocess.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <fstream>
#include <sstream>

namespace difftrain::testing {
namespace {

const std::string kDifftrain = difftrain_test::difftrain_bin();
const std::string kPipeline =
    std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd";

struct Case {
  std::string prompt;
  std::vector<int64_t> input_ids;
  int64_t num_tokens;
};

std::vector<Case> fixture_cases() {
  std::ifstream in(kPipeline + "/tokenizer_cases.json");
  const auto j = nlohmann::json::parse(in);
  std::vector<Case> out;
  for (const auto& c : j.at("cases")) {
    out.push_back({c.at("prompt").get<std::string>(), c.at("input_ids").get<std::vector<int64_t>>(),
                   static_cast<int64_t>(c.at("bpe_ids").size())});
  }
  return out;
}

// The case whose prompt starts with `prefix` ("": the empty prompt).
const Case& find_case(const std::vector<Case>& cases, const std::string& prefix) {
  for (const auto& c : cases) {
    if (prefix.empty() ? c.prompt.empty() : c.prompt.rfind(prefix, 0) == 0) return c;
  }
  throw std::runtime_error("no fixture case starts with " + prefix);
}

std::vector<std::string> lines_of(const std::string& text) {
  std::vector<std::string> out;
  std::istringstream in(text);
  for (std::string line; std::getline(in, line);) out.push_back(line);
  return out;
}

// The ids as the command prints them: Python's json.dumps spacing.
std::string json_line(const std::vector<int64_t>& ids) {
  std::string s = "[";
  for (size_t i = 0; i < ids.size(); ++i) s += (i ? ", " : "") + std::to_string(ids[i]);
  return s + "]";
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t pos = text.find(what); pos != std::string::npos; pos = text.find(what, pos + 1)) ++n;
  return n;
}

void write(const std::string& path, const std::string& text) {
  std::ofstream out(path, std::ios::binary);
  out << text;
}

TEST(TokenizeCli, PromptsPrintTheFixtureIdsAndWarnWhenTruncated) {
  const auto cases = fixture_cases();
  const auto cat = find_case(cases, "a photo of a cat");
  const auto empty = find_case(cases, "");
  const auto longest = find_case(cases, "a highly detailed digital painting");
  const auto apostrophes = find_case(cases, "it's a dog's life");
  ASSERT_GT(longest.num_tokens, 75);
  const auto r =
      run({kDifftrain, "tokenize", "--model", kPipeline, "--prompt", cat.prompt, "--prompt",
           empty.prompt, "--prompt", longest.prompt, "--prompt", apostrophes.prompt},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(lines_of(r.out), (std::vector<std::string>{
                                 json_line(cat.input_ids), json_line(empty.input_ids),
                                 json_line(longest.input_ids), json_line(apostrophes.input_ids)}))
      << r.log();
  // One warning, for prompt 2: its start, its token count, and how many were dropped.
  EXPECT_EQ(count(r.err, "warning"), 1u) << r.log();
  EXPECT_NE(r.err.find("difftrain tokenize: warning: prompt 2 (\"" + longest.prompt.substr(0, 40) +
                       "...\") has " + std::to_string(longest.num_tokens) + " tokens"),
            std::string::npos)
      << r.log();
  EXPECT_NE(r.err.find("the last " + std::to_string(longest.num_tokens - 75) + " were dropped"),
            std::string::npos)
      << r.log();
}

TEST(TokenizeCli, T5SubfolderOfAFluxFolderPrintsTheFixtureIds) {
  // FLUX.1's tokenizer_2 (SentencePiece): every case of the fixture, from a prompt file, at
  // --max_length 32 as the fixture's ids are.
  const std::string flux =
      std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";
  std::ifstream in(flux + "/tokenizer_cases.json");
  const auto j = nlohmann::json::parse(in);
  std::string file;
  std::vector<std::string> want;
  for (const char* group : {"cases", "t5_only_cases"}) {
    for (const auto& c : j.at(group)) {
      const std::string prompt = c.at("prompt");
      if (prompt.find('\n') != std::string::npos) continue;  // a prompt file line has none
      file += prompt + "\n";
      want.push_back(json_line(c.at("t5_input_ids").get<std::vector<int64_t>>()));
    }
  }
  const std::string path = ::testing::TempDir() + "t5_prompts.txt";
  write(path, file);
  const auto r = run({kDifftrain, "tokenize", "--model", flux, "--subfolder", "tokenizer_2",
                      "--max_length", "32", "--prompt_file", path},
                     {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(lines_of(r.out), want) << r.log();
  EXPECT_GE(count(r.err, "warning"), 1u) << r.log();  // the long prompts are cut
}

TEST(TokenizeCli, PromptFileKeepsEveryLineAndTakesATokenizerFolder) {
  const auto dir = make_temp_dir("tokenize_cli_file");
  const auto cases = fixture_cases();
  std::string text;
  std::vector<std::string> want;
  for (const auto& c : cases) {
    if (c.prompt.find('\n') != std::string::npos) continue;  // cannot be one line of a file
    text += c.prompt + "\n";
    want.push_back(json_line(c.input_ids));
  }
  ASSERT_GE(want.size(), 20u);
  // An empty line in the middle is an empty prompt; a final newline adds none.
  const auto empty = find_case(cases, "");
  text = "a photo of a cat\r\n\n" + text;
  want.insert(want.begin(), {json_line(find_case(cases, "a photo of a cat").input_ids),
                             json_line(empty.input_ids)});
  write(dir + "/prompts.txt", text);
  auto r = run({kDifftrain, "tokenize", "--model", kPipeline + "/tokenizer", "--prompt_file",
                dir + "/prompts.txt"},
               {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(lines_of(r.out), want) << r.log();
  EXPECT_EQ(count(r.err, "warning"), 1u) << r.log();  // the 92-token case

  // Without the final newline the last line still counts; "\n" alone is one empty prompt.
  write(dir + "/two.txt", "a photo of a cat\nthe quick brown fox jumps over the lazy dog");
  r = run({kDifftrain, "tokenize", "--model", kPipeline, "--prompt-file", dir + "/two.txt"}, {},
          60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(lines_of(r.out).size(), 2u) << r.log();
  EXPECT_EQ(lines_of(r.out)[1], json_line(find_case(cases, "the quick brown fox").input_ids));
  write(dir + "/one.txt", "\n");
  r = run({kDifftrain, "tokenize", "--model", kPipeline, "--prompt_file", dir + "/one.txt"}, {},
          60);
  EXPECT_EQ(lines_of(r.out), (std::vector<std::string>{json_line(empty.input_ids)})) << r.log();
  write(dir + "/none.txt", "");
  r = run({kDifftrain, "tokenize", "--model", kPipeline, "--prompt_file", dir + "/none.txt"}, {},
          60);
  EXPECT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(r.out, "") << r.log();
}

TEST(TokenizeCli, MaxLengthAndNoPadding) {
  const auto cases = fixture_cases();
  const auto cat = find_case(cases, "a photo of a cat");  // 5 tokens
  auto r =
      run({kDifftrain, "tokenize", "--model", kPipeline, "--prompt", cat.prompt, "--no_padding"},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(r.out, json_line({cat.input_ids.begin(), cat.input_ids.begin() + 7}) + "\n");
  r = run(
      {kDifftrain, "tokenize", "--model", kPipeline, "--prompt", cat.prompt, "--max_length", "5"},
      {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(r.out, "[49406, 320, 1125, 539, 49407]\n") << r.log();
  EXPECT_NE(r.err.find("has 5 tokens; only the first 3 fit in model_max_length 5"),
            std::string::npos)
      << r.log();
  r = run({kDifftrain, "tokenize", "--model", kPipeline, "--prompt", "a cat", "--max-length", "6"},
          {}, 60);
  EXPECT_EQ(r.out, "[49406, 320, 2368, 49407, 49407, 49407]\n") << r.log();
}

TEST(TokenizeCli, QwenFolderPrintsTheReferenceIdsWithAndWithoutTheChatTemplate) {
  // Z-Image's tokenizer (tests/golden/z_image): the hard cases as plain ids; ZImagePipeline's
  // prompts with --chat_template (template applied, no padding); --max_length pads on the right
  // with <|endoftext|> and cuts with a warning.
  const std::string golden = std::string(difftrain_test::source_dir()) + "/tests/golden/z_image/";
  const std::string tok = golden + "tokenizer";
  std::ifstream in(golden + "chat_template/expected.json");
  const auto j = nlohmann::json::parse(in);
  std::vector<std::string> args = {kDifftrain, "tokenize", "--model", tok, "--chat_template"};
  std::vector<std::string> want;
  for (const auto& p : j.at("pipeline_prompts")) {
    args.insert(args.end(), {"--prompt", p.at("prompt").get<std::string>()});
    want.push_back(json_line(p.at("ids").get<std::vector<int64_t>>()));
  }
  auto r = run(args, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(lines_of(r.out), want) << r.log();

  std::ifstream hard_in(tok + "/expected.json");
  const auto hard = nlohmann::json::parse(hard_in);
  args = {kDifftrain, "tokenize", "--model", tok};
  want.clear();
  for (const auto& c : hard.at("cases")) {
    args.insert(args.end(), {"--prompt", c.at("text").get<std::string>()});
    want.push_back(json_line(c.at("ids").get<std::vector<int64_t>>()));
  }
  r = run(args, {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(lines_of(r.out), want) << r.log();

  const auto cat = j.at("pipeline_prompts").at(0).at("ids").get<std::vector<int64_t>>();
  ASSERT_GT(cat.size(), 8u);
  auto padded = cat;
  padded.resize(cat.size() + 3, 656);  // <|endoftext|>, the folder's pad_token
  r = run(
      {kDifftrain, "tokenize", "--model", tok, "--prompt",
       j.at("pipeline_prompts").at(0).at("text"), "--max_length", std::to_string(cat.size() + 3)},
      {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(r.out, json_line(padded) + "\n") << r.log();
  r = run({kDifftrain, "tokenize", "--model", tok, "--prompt", "a cat", "--chat_template",
           "--max_length", "8"},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_EQ(r.out, json_line(std::vector<int64_t>(cat.begin(), cat.begin() + 8)) + "\n") << r.log();
  EXPECT_NE(r.err.find("warning: prompt 0 (\"a cat\") has " + std::to_string(cat.size()) +
                       " tokens; only the first 8 fit"),
            std::string::npos)
      << r.log();
  // enable_thinking false adds the empty think block; a bad --template_kwargs, or
  // --chat_template on a CLIP folder, is one line.
  r = run({kDifftrain, "tokenize", "--model", tok, "--prompt", "a cat", "--chat_template",
           "--template_kwargs", R"({"enable_thinking": false})"},
          {}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.log();
  EXPECT_GT(lines_of(r.out).at(0).size(), json_line(cat).size()) << r.log();
  r = run({kDifftrain, "tokenize", "--model", tok, "--prompt", "a", "--chat_template",
           "--template_kwargs", "[1]"},
          {}, 60);
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_EQ(r.err.rfind("difftrain: error: --template_kwargs '[1]' is not a JSON object", 0), 0u)
      << r.log();
  r = run({kDifftrain, "tokenize", "--model", kPipeline, "--prompt", "a", "--chat_template"}, {},
          60);
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_NE(r.err.find("is not a Qwen2 tokenizer"), std::string::npos) << r.log();
  EXPECT_EQ(count(r.err, "\n"), 1u) << r.log();
}

TEST(TokenizeCli, BadInputExitsWithOneLineError) {
  const auto dir = make_temp_dir("tokenize_cli_bad");
  write(dir + "/prompts.txt", "a cat\n");
  struct Bad {
    std::vector<std::string> args;
    std::string message;
  };
  const std::vector<Bad> bad = {
      {{"--model", dir + "/missing", "--prompt", "a"},
       "difftrain: error: --model '" + dir + "/missing' does not exist"},
      {{"--model", dir, "--prompt", "a"},
       "difftrain: error: --model '" + dir + "' has neither vocab.json nor a tokenizer/ folder"},
      {{"--model", kPipeline}, "difftrain: error: no prompt given: pass --prompt TEXT"},
      {{"--model", kPipeline, "--prompt", "a", "--prompt_file", dir + "/prompts.txt"},
       "difftrain: error: both --prompt and --prompt_file given"},
      {{"--model", kPipeline, "--prompt_file", dir + "/nope.txt"},
       "difftrain: error: cannot read --prompt_file '" + dir + "/nope.txt'"},
      {{"--model", kPipeline, "--prompt_file", dir},
       "difftrain: error: cannot read --prompt_file '" + dir + "'"},
  };
  for (const auto& b : bad) {
    std::vector<std::string> argv = {kDifftrain, "tokenize"};
    argv.insert(argv.end(), b.args.begin(), b.args.end());
    const auto r = run(argv, {}, 60);
    EXPECT_EQ(r.exit_code, 1) << r.log();
    EXPECT_EQ(r.out, "") << r.log();
    EXPECT_EQ(r.err.rfind(b.message, 0), 0u) << r.log();
    EXPECT_EQ(count(r.err, "\n"), 1u) << r.log();
  }
  // A broken tokenizer folder: the library's message, naming the file and line.
  const auto tok = dir + "/tokenizer";
  std::filesystem::create_directories(tok);
  write(tok + "/vocab.json", R"({"<|startoftext|>": 0, "<|endoftext|>": 1})");
  write(tok + "/merges.txt", "#version: 0.2\na b c\n");
  auto r = run({kDifftrain, "tokenize", "--model", dir, "--prompt", "a"}, {}, 60);
  EXPECT_EQ(r.exit_code, 1) << r.log();
  EXPECT_EQ(r.err.rfind("difftrain: error: " + tok + "/merges.txt:2: expected two symbols", 0), 0u)
      << r.log();
  // CLI11 checks the flags first.
  r = run({kDifftrain, "tokenize", "--model", kPipeline, "--prompt", "a", "--max_length", "1"}, {},
          60);
  EXPECT_EQ(r.exit_code, 105) << r.log();
  r = run({kDifftrain, "tokenize", "--model", kPipeline, "--prompt", "a", "b"}, {}, 60);
  EXPECT_NE(r.exit_code, 0) << r.log();
  EXPECT_NE(r.err.find("not expected: b"), std::string::npos) << r.log();
}

}  // namespace
}  // namespace difftrain::testing
