#pragma once
// Prompt files: one prompt per line, the format `difftrain sample --prompt_file` and
// `difftrain tokenize --prompt_file` read (and Diffusers' example scripts' `--prompt_file`).

#include <string>
#include <vector>

namespace difftrain::io {

/// The prompts of the text file at `path`, one per line, with these rules:
///   - lines end at '\n'; a '\r' ending a line is dropped (files written on Windows);
///   - every line is a prompt, an empty line too (the empty prompt "", which Diffusers also
///     accepts), and nothing is trimmed or skipped;
///   - a final newline ends the last line rather than starting an empty one, so "a\nb\n" and
///     "a\nb" are both {"a", "b"}, "\n" alone is {""} and an empty file has no prompts ({}):
///     a caller that needs a prompt checks for that.
/// A missing or unreadable path, or a folder, throws difftrain::Error
/// "cannot read --prompt_file 'PATH': ...".
std::vector<std::string> read_prompt_file(const std::string& path);

}  // namespace difftrain::io
