#pragma once
// Text steps of CLIP's tokenizer before BPE (private to src/models): the cleanup HF's
// `CLIPTokenizer._tokenize` does with ftfy installed (`whitespace_clean(ftfy.fix_text(text))
// .lower()`) and the split with CLIP's pre-tokenisation pattern. Unicode categories, case
// mappings and NFC come from utf8proc's tables.

#include <string>
#include <string_view>
#include <vector>

namespace difftrain::models::clip_text {

/// The code points of UTF-8 `text`. Each byte of an ill-formed sequence becomes U+FFFD (Python's
/// `errors="replace"` gives one U+FFFD per maximal bad subpart; for valid UTF-8 they agree).
std::u32string decode_utf8(std::string_view text);

/// UTF-8 of `text` (code points above U+10FFFF or surrogates become U+FFFD).
std::string encode_utf8(std::u32string_view text);

/// Canonical composition (NFC), as ftfy's final `unicodedata.normalize("NFC", ...)`.
std::u32string nfc(std::u32string_view text);

/// The whole cleanup of one piece of text, as `whitespace_clean(ftfy.fix_text(text)).lower()`:
/// 1. ftfy's fixes with its default settings, line by line, each line repeated until stable:
///    `unescape_html` ("auto": `&name;` for HTML 4 names and `&apos;`, `&#DDD;`, `&#xHH;`,
///    decoded as Python's html.unescape does; from the first line holding a literal `<` on,
///    nothing is unescaped), C1 controls read as Windows-1252, Latin ligatures split, fullwidth
///    and halfwidth forms to their NFKC, curly quotes straightened (U+2018-U+201B -> ',
///    U+201C-U+201F -> "), control characters removed, then NFC. ftfy's mojibake repair
///    (fix_encoding and its helpers) and terminal-escape removal are not done.
/// 2. Every run of Unicode White_Space -> one space; strip.
/// 3. Python's `str.lower()`: simple mappings, U+0130 -> "i\u0307", and final sigma.
std::u32string clean(std::string_view text);

/// Splits cleaned text with CLIP's pattern
/// `<\|startoftext\|>|<\|endoftext\|>|'s|'t|'re|'ve|'m|'ll|'d|[\p{L}]+|[\p{N}]|[^\s\p{L}\p{N}]+`
/// (case-insensitive; the first alternative that matches at a position wins, as in `regex`).
/// Returns the UTF-8 pieces; whitespace matches nothing and is dropped.
std::vector<std::string> pre_tokenize(std::u32string_view cleaned);

}  // namespace difftrain::models::clip_text
