// `difftrain tokenize`: the token ids of prompts, one JSON list per line, as a pipeline's
// tokenizer gives them (padding="max_length", truncation=True): CLIP's BPE (models::ClipTokenizer)
// or T5's SentencePiece (models::T5Tokenizer, FLUX.1's tokenizer_2) by the folder's files. This
// file only parses and prints.

#include "commands.h"
#include "difftrain/core/error.h"
#include "difftrain/diffusion/text_encoders.h"
#include "difftrain/io/prompt_file.h"
#include "difftrain/models/clip_tokenizer.h"
#include "difftrain/models/t5_tokenizer.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <iostream>

namespace difftrain::cli {

namespace {

struct TokenizeArgs {
  std::string model;
  std::string subfolder;
  std::vector<std::string> prompts;
  std::string prompt_file;
  int64_t max_length = 0;
  bool no_padding = false;
} g_args;

// The first ~40 characters of a prompt, JSON-quoted so that it stays on one line.
std::string excerpt(const std::string& prompt) {
  size_t cut = prompt.size(), chars = 0;
  for (size_t i = 0; i < prompt.size(); ++i) {
    if ((static_cast<unsigned char>(prompt[i]) & 0xC0) == 0x80) continue;  // UTF-8 continuation
    if (chars++ == 40) {
      cut = i;
      break;
    }
  }
  const auto quoted = nlohmann::json(prompt.substr(0, cut))
                          .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  return cut < prompt.size() ? quoted.substr(0, quoted.size() - 1) + "...\"" : quoted;
}

}  // namespace

CLI::App* add_tokenize_command(CLI::App& app) {
  auto* cmd = app.add_subcommand(
      "tokenize",
      "Print the token ids of prompts, one JSON list per line, as a pipeline's tokenizer gives "
      "them (padded and truncated to model_max_length): CLIP (vocab.json + merges.txt) or T5 "
      "(spiece.model)");
  cmd->add_option("--model", g_args.model,
                  "Stable Diffusion pipeline folder (uses its tokenizer/) or a CLIP tokenizer "
                  "folder (vocab.json, merges.txt, tokenizer_config.json) or a T5 tokenizer folder "
                  "(spiece.model)")
      ->required();
  cmd->add_option("--subfolder", g_args.subfolder,
                  "The tokenizer's folder inside --model, e.g. tokenizer_2 (FLUX.1's T5)");
  cmd->add_option("--prompt", g_args.prompts, "A prompt; repeat the flag for several")
      ->expected(1)
      ->allow_extra_args(false)
      ->multi_option_policy(CLI::MultiOptionPolicy::TakeAll);
  cmd->add_option("--prompt_file,--prompt-file", g_args.prompt_file,
                  "Text file with one prompt per line (every line, empty ones too; a final "
                  "newline does not add an empty prompt)");
  cmd->add_option("--max_length,--max-length", g_args.max_length,
                  "Pad and truncate to N instead of the tokenizer's model_max_length")
      ->check(CLI::Range(int64_t{2}, int64_t{65536}));
  cmd->add_flag("--no_padding,--no-padding", g_args.no_padding,
                "Print [bos] + ids + [eos] without the padding (still truncated)");
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
  if (std::filesystem::is_regular_file(std::filesystem::path(dir) / "spiece.model")) {
    // T5: the pieces, cut to max_length - 1, </s>, then <pad> up to max_length (512 by default).
    const auto t5 = models::T5Tokenizer::load(dir);
    const int64_t length = g_args.max_length > 0 ? g_args.max_length : t5.model_max_length();
    for (size_t i = 0; i < prompts.size(); ++i) {
      bool truncated = false;
      auto ids = t5.encode(prompts[i], length, &truncated);
      if (truncated) {
        std::cerr << "difftrain tokenize: warning: prompt " << i << " (" << excerpt(prompts[i])
                  << ") is longer than " << length - 1 << " T5 pieces; the rest was dropped"
                  << std::endl;
      }
      if (g_args.no_padding) {
        while (ids.size() > 1 && ids.back() == t5.pad_id()) ids.pop_back();
      }
      std::string line = "[";
      for (size_t k = 0; k < ids.size(); ++k) line += (k > 0 ? ", " : "") + std::to_string(ids[k]);
      std::cout << line << "]\n";
    }
    std::cout << std::flush;
    return 0;
  }
  auto tokenizer = models::ClipTokenizer::from_folder(dir);
  if (g_args.max_length > 0) tokenizer.set_model_max_length(g_args.max_length);
  const int64_t kept = tokenizer.model_max_length() - 2;
  for (size_t i = 0; i < prompts.size(); ++i) {
    const auto e = tokenizer.encode(prompts[i]);
    if (e.truncated) {
      // Diffusers logs the same: "The following part of your input was truncated ...".
      std::cerr << "difftrain tokenize: warning: prompt " << i << " (" << excerpt(prompts[i])
                << ") has " << e.num_tokens << " tokens; only the first " << kept
                << " fit in model_max_length " << tokenizer.model_max_length()
                << " with bos and eos, the last " << e.num_tokens - kept << " were dropped"
                << std::endl;
    }
    const size_t length = g_args.no_padding ? static_cast<size_t>(std::min(e.num_tokens, kept) + 2)
                                            : e.input_ids.size();
    std::string line = "[";
    for (size_t k = 0; k < length; ++k) {
      if (k > 0) line += ", ";
      line += std::to_string(e.input_ids[k]);
    }
    std::cout << line << "]\n";
  }
  std::cout << std::flush;
  return 0;
}

}  // namespace difftrain::cli
