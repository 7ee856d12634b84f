#pragma once
// Chat templates: the Jinja text a decoder LLM's tokenizer folder carries (tokenizer_config.json's
// `chat_template`, or chat_template.jinja), rendered as Transformers' `apply_chat_template(...,
// tokenize=False)` renders it. Z-Image, Qwen-Image and FLUX.2 wrap every prompt in one before
// their text encoder reads it.
//
// The engine is the part of Jinja2 that chat templates use, with the environment Transformers
// builds (trim_blocks, lstrip_blocks, the loop-controls extension, its own `tojson`,
// `raise_exception`, `strftime_now`, and `{% generation %}` rendered as its body):
//   - tags: `{{ }}`, `{% %}`, `{# #}`, whitespace control (`-`, `+`), if / elif / else, for (with
//     `else`, an `if` filter, tuple targets, `loop.*`), set (names, `ns.attr`, `{% set x %}` ...
//     `{% endset %}`), break / continue, generation;
//   - expressions: literals (strings with Python escapes, numbers, lists, dicts, true / false /
//     none), names, `.attr`, `[index]`, slices, calls, `|filters`, `is tests`, `not`, `and`, `or`,
//     `in`, comparisons, `+ - * / // % **`, `~`, `a if c else b`;
//   - Python's semantics for truth, equality, `+`, indexing, `str()` of values, string methods
//     (startswith, endswith, split, strip, lstrip, rstrip, upper, lower, replace, ...), dict
//     methods (items, keys, values, get); undefined names and attributes are Jinja's Undefined.
// A construct outside this set (macros, includes, extends, call blocks) is refused in one line
// naming it and the template's line.

#include <nlohmann/json.hpp>

#include <memory>
#include <string>

namespace difftrain::models {

/// A parsed chat template. Copies share the parsed form; rendering is thread-safe.
class ChatTemplate {
 public:
  /// Parses `source`; `origin` (a path) prefixes error messages. Throws difftrain::Error naming
  /// the line for a syntax error or an unsupported construct.
  static ChatTemplate parse(const std::string& source, const std::string& origin);

  /// Renders the template with `variables` as its globals (Transformers passes `messages`,
  /// `tools`, `documents`, `add_generation_prompt`, the special tokens by name and the caller's
  /// extra keyword arguments, e.g. `enable_thinking`). A key absent from `variables` is undefined
  /// (so `enable_thinking is defined` is false). Throws difftrain::Error for an evaluation error
  /// (a type mismatch, an attribute of an undefined value, `raise_exception(...)`), naming the
  /// origin, the line and the cause.
  std::string render(const nlohmann::ordered_json& variables) const;

  /// The template's text as given.
  const std::string& source() const;

  struct Impl;

 private:
  std::shared_ptr<const Impl> impl_;
};

/// Transformers' `tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt,
/// **extra)`: renders `chat_template` with `messages` (a JSON list of {"role", "content", ...}),
/// `add_generation_prompt`, the tokenizer's `special_tokens` (an object such as {"eos_token":
/// "<|im_end|>", "pad_token": "<|endoftext|>"}) and `extra` (an object; its keys win).
std::string apply_chat_template(const ChatTemplate& chat_template,
                                const nlohmann::ordered_json& messages, bool add_generation_prompt,
                                const nlohmann::ordered_json& special_tokens,
                                const nlohmann::ordered_json& extra);

}  // namespace difftrain::models
