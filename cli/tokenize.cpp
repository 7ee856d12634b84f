// `difftrain tokenize`: the token ids of prompts, one JSON list per line, as a pipeline's
// tokenizer gives them (padding="max_length", truncation=True): CLIP's BPE (models::ClipTokenizer),
// T5's SentencePiece (models::T5Tokenizer, FLUX.1's tokenizer_2) or Qwen2's byte-level BPE
// (models::Qwen2Tokenizer, with its chat template on --chat_template) by the folder's files
// (diffusion::tokenize_prompts). This file only parses and prints.

#include "commands.h"
#include "difftrain/core/error.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/io/prompt_file.h"

#include <filesystem>
#include <iostream>

namespace difftrain::cli {

namespace {

struct TokenizeArgs {
  std::string model;
  std::string subfolder;
  std::vector<std::string> prompts;
  std::string prompt_file;
  diffusion::TokenizeOptions options;
} g_args;

}  // namespace

CLI::App* add_tokenize_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "tokenize",
      "Print the token ids of prompts, one JSON list per line, as a pipeline's tokenizer gives "
      "them (padded and truncated to model_max_length): CLIP (vocab.json + merges.txt), T5 "
      "(spiece.model) or Qwen2 (tokenizer.json or vocab.json + merges.txt, tokenizer_class "
      "Qwen2Tokenizer; not padded unless --max_length is given)");
  cmd->add_option("--model", g_args.model,
                  "Pipeline folder (uses its tokenizer/) or a CLIP tokenizer folder (vocab.json, "
                  "merges.txt, tokenizer_config.json) or a T5 tokenizer folder (spiece.model)")
      ->required();
  cmd->add_option("--subfolder", g_args.subfolder,
                  "The tokenizer's folder inside --model, e.g. tokenizer_2 (a second "
                  "tokenizer, such as a T5's)");
  cmd->add_option("--prompt", g_args.prompts, "A prompt; repeat the flag for several")
      ->expected(1)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--prompt_file,--prompt-file", g_args.prompt_file,
                  "Text file with one prompt per line (every line, empty ones too; a final "
                  "newline does not add an empty prompt)");
  cmd->add_option("--max_length,--max-length", g_args.options.max_length,
                  "Pad and truncate to N instead of the tokenizer's model_max_length (for Qwen2: "
                  "the pipeline's max_sequence_length)")
      ->check(CLI::Range(int64_t{2}, int64_t{65536}));
  cmd->add_flag("--no_padding,--no-padding", g_args.options.no_padding,
                "Print [bos] + ids + [eos] without the padding (still truncated)");
  cmd->add_flag("--chat_template,--chat-template", g_args.options.chat_template,
                "Qwen2 folders: wrap each prompt in the folder's chat template as a pipeline with "
                "an LLM text encoder does (apply_chat_template([{role: user, content: prompt}], "
                "add_generation_prompt=True, **template_kwargs)) and print the ids unpadded");
  cmd->add_option("--template_kwargs,--template-kwargs", g_args.options.template_kwargs,
                  "The chat template's keyword arguments, a JSON object")
      ->default_str(g_args.options.template_kwargs);
  return cmd;
}

int run_tokenize() {
  const bool has_prompts = !g_args.prompts.empty();
  if (has_prompts == !g_args.prompt_file.empty()) {
    throw Error(
        std::string(has_prompts ? "both --prompt and --prompt_file given" : "no prompt given") +
        ": pass --prompt TEXT (repeatable) or --prompt_file FILE, not both");
  }
  const auto prompts = has_prompts ? g_args.prompts : io::read_prompt_file(g_args.prompt_file);
  const std::string dir = g_args.subfolder.empty()
                              ? diffusion::resolve_tokenizer_dir(g_args.model)
                              : (std::filesystem::path(g_args.model) / g_args.subfolder).string();
  for (const auto& p : diffusion::tokenize_prompts(dir, prompts, g_args.options)) {
    if (!p.warning.empty()) std::cerr << "difftrain tokenize: warning: " << p.warning << std::endl;
    std::string line = "[";
    for (size_t k = 0; k < p.ids.size(); ++k)
      line += (k > 0 ? ", " : "") + std::to_string(p.ids[k]);
    std::cout << line << "]\n";
  }
  std::cout << std::flush;
  return 0;
}

}  // namespace difftrain::cli
