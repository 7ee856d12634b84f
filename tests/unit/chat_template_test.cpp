// Chat templates: every rendering of tests/golden/z_image/chat_template/expected.json
// (python3-jinja2 in Transformers' environment, make_chat_template.py): Qwen3's template on
// ZImagePipeline's prompts and on system, multi-turn, reasoning, tool and content-list
// conversations, a Qwen2-VL-style template, and two templates made to reach the engine's corners
// (expressions, filters, tests, methods, loops, scopes, whitespace control); the errors Jinja
// raises; the tokenizer folder's template applied and tokenized as the pipeline does it.
#include "difftrain/models/tokenizers/chat_template.h"
#include "difftrain/models/tokenizers/qwen2_tokenizer.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace {

using difftrain::models::ChatTemplate;
using difftrain::models::Qwen2Tokenizer;
using difftrain::test::error_of;
using difftrain::test::kGoldenDir;
using difftrain::test::temp_dir;
using difftrain::test::write_text;
using Json = nlohmann::ordered_json;
namespace fs = std::filesystem;

const std::string kChatTemplateDir = kGoldenDir + "z_image/chat_template";
const std::string kChatTokenizerDir = kGoldenDir + "z_image/tokenizer";

Json chat_template_expected() {
  std::ifstream in(kChatTemplateDir + "/expected.json");
  return Json::parse(in);
}

TEST(ChatTemplate, EveryRenderingMatchesJinja2InTransformersEnvironment) {
  const Json e = chat_template_expected();
  std::map<std::string, ChatTemplate> templates;
  for (const auto& [name, source] : e.at("templates").items()) {
    templates.emplace(name, ChatTemplate::parse(source.get<std::string>(), name));
  }
  ASSERT_GE(e.at("cases").size(), 18u);
  for (const auto& c : e.at("cases")) {
    const auto name = c.at("template").get<std::string>();
    const auto want = c.at("rendered").get<std::string>();
    std::string got;
    try {
      got = templates.at(name).render(c.at("variables"));
    } catch (const std::exception& ex) {
      ADD_FAILURE() << name << " " << c.at("variables").dump() << ": " << ex.what();
      continue;
    }
    EXPECT_EQ(got, want) << name << " " << c.at("variables").dump()
                         << "\n got: " << Json(got).dump() << "\nwant: " << Json(want).dump();
  }
}

TEST(ChatTemplate, ErrorsThatJinjaRaisesAreOneLineErrorsNamingTheLine) {
  const Json all = chat_template_expected();
  for (const auto& c : all.at("errors")) {
    const auto source = c.at("template").get<std::string>();
    const auto t = ChatTemplate::parse(source, "t.jinja");
    const auto message = error_of([&] { t.render(c.at("variables")); });
    EXPECT_NE(message.find("t.jinja: chat template line 1: "), std::string::npos) << message;
    EXPECT_EQ(message.find('\n'), std::string::npos) << message;
    // Jinja's own wording where ours follows it.
    const auto python = c.at("python").get<std::string>();
    if (c.at("name") == "raise" || c.at("name") == "undefined attribute" ||
        c.at("name") == "not iterable") {
      EXPECT_NE(message.find(python), std::string::npos) << message << " vs " << python;
    }
  }
  // Syntax errors and unsupported tags are refused when the template is parsed.
  const auto unclosed = error_of([] { ChatTemplate::parse("a\n{% if x %}b", "u.jinja"); });
  EXPECT_NE(unclosed.find("u.jinja: chat template line 2: "), std::string::npos) << unclosed;
  EXPECT_NE(unclosed.find("endif"), std::string::npos) << unclosed;
  const auto macro = error_of([] { ChatTemplate::parse("{% macro f() %}{% endmacro %}", "m"); });
  EXPECT_NE(macro.find("`{% macro %}` is not supported"), std::string::npos) << macro;
  const auto string = error_of([] { ChatTemplate::parse("{{ 'abc }}", "s"); });
  EXPECT_NE(string.find("never closed"), std::string::npos) << string;
  const auto filter =
      error_of([] { ChatTemplate::parse("{{ 1|nosuch }}", "f").render(Json::object()); });
  EXPECT_NE(filter.find("no filter named 'nosuch'"), std::string::npos) << filter;
}

TEST(ChatTemplate, TheTokenizerFoldersTemplateAppliedAndTokenizedAsZImagePipelineDoes) {
  const auto tok = Qwen2Tokenizer::from_folder(kChatTokenizerDir);
  ASSERT_NE(tok.chat_template(), nullptr);
  const auto prompts = chat_template_expected().at("pipeline_prompts");
  ASSERT_GE(prompts.size(), 6u);
  for (const auto& p : prompts) {
    const Json messages = Json::array({{{"role", "user"}, {"content", p.at("prompt")}}});
    const auto text = tok.apply_chat_template(messages, true, {{"enable_thinking", true}});
    EXPECT_EQ(text, p.at("text").get<std::string>());
    EXPECT_EQ(tok.encode(text), p.at("ids").get<std::vector<int64_t>>()) << Json(text).dump();
  }
}

TEST(ChatTemplate, ChatTemplateJinjaWinsOverTheConfigsAndAFolderWithoutOneIsRefused) {
  const auto dir = temp_dir("chat_template_jinja");
  for (const auto& entry : fs::directory_iterator(kChatTokenizerDir)) {
    fs::copy_file(entry.path(), fs::path(dir) / entry.path().filename(),
                  fs::copy_options::overwrite_existing);
  }
  write_text(dir + "/chat_template.jinja",
             "{% for m in messages %}[{{ m.role }}] {{ m.content }}{% endfor %}{{ eos_token }}");
  const auto tok = Qwen2Tokenizer::from_folder(dir);
  const Json messages = Json::array({{{"role", "user"}, {"content", "hi"}}});
  EXPECT_EQ(tok.apply_chat_template(messages, true), "[user] hi<|im_end|>");

  // Without either, a clear refusal naming the folder.
  fs::remove(dir + "/chat_template.jinja");
  Json config;
  {
    std::ifstream in(dir + "/tokenizer_config.json");
    config = Json::parse(in);
  }
  config.erase("chat_template");
  write_text(dir + "/tokenizer_config.json", config.dump(2));
  const auto plain = Qwen2Tokenizer::from_folder(dir);
  EXPECT_EQ(plain.chat_template(), nullptr);
  const auto message = error_of([&] { plain.apply_chat_template(messages, true); });
  EXPECT_NE(message.find(dir), std::string::npos) << message;
  EXPECT_NE(message.find("has no chat template"), std::string::npos) << message;

  // A list of named templates: the "default" one.
  config["chat_template"] =
      Json::array({{{"name", "tool_use"}, {"template", "T"}},
                   {{"name", "default"}, {"template", "D{{ messages|length }}"}}});
  write_text(dir + "/tokenizer_config.json", config.dump(2));
  EXPECT_EQ(Qwen2Tokenizer::from_folder(dir).apply_chat_template(messages, false), "D1");
}

}  // namespace
