// CLIP tokenizer text steps: ftfy-style cleanup, whitespace, Python's lower(), and the
// pre-tokenisation pattern. See clip_text.h.

#include "clip_text.h"

#include <utf8proc.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstdlib>
#include <utility>

namespace difftrain::models::clip_text {

namespace {

constexpr char32_t kReplacement = 0xFFFD;

utf8proc_category_t category(char32_t c) {
  return utf8proc_category(static_cast<utf8proc_int32_t>(c));
}

// \p{L}: Lu, Ll, Lt, Lm, Lo.
bool is_letter(char32_t c) {
  if (c < 0x80) return (c | 0x20) >= 'a' && (c | 0x20) <= 'z';
  const auto cat = category(c);
  return cat >= UTF8PROC_CATEGORY_LU && cat <= UTF8PROC_CATEGORY_LO;
}

// \p{N}: Nd, Nl, No.
bool is_number(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  const auto cat = category(c);
  return cat >= UTF8PROC_CATEGORY_ND && cat <= UTF8PROC_CATEGORY_NO;
}

// \s of the `regex` module HF's tokenizer imports: the Unicode White_Space property. utf8proc has
// no table for it; the property is these 25 code points and has not changed since Unicode 6.
bool is_space(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  return c == 0x85 || c == 0xA0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200A) || c == 0x2028 ||
         c == 0x2029 || c == 0x202F || c == 0x205F || c == 0x3000;
}

// Windows-1252 for bytes 0x80-0x9F; the five it leaves undefined map to themselves (Python's
// html.unescape and ftfy's "sloppy-windows-1252" agree on this table).
constexpr std::array<char16_t, 32> kCp1252 = {
    0x20AC, 0x0081, 0x201A, 0x0192, 0x201E, 0x2026, 0x2020, 0x2021, 0x02C6, 0x2030, 0x0160,
    0x2039, 0x0152, 0x008D, 0x017D, 0x008F, 0x0090, 0x2018, 0x2019, 0x201C, 0x201D, 0x2022,
    0x2013, 0x2014, 0x02DC, 0x2122, 0x0161, 0x203A, 0x0153, 0x009D, 0x017E, 0x0178};

// HTML 4's 252 named character references plus &apos;, sorted by name (case-sensitive).
struct Entity {
  const char* name;
  char32_t code;
};
constexpr Entity kEntities[] = {
    {"AElig", 0xC6},     {"Aacute", 0xC1},   {"Acirc", 0xC2},     {"Agrave", 0xC0},
    {"Alpha", 0x391},    {"Aring", 0xC5},    {"Atilde", 0xC3},    {"Auml", 0xC4},
    {"Beta", 0x392},     {"Ccedil", 0xC7},   {"Chi", 0x3A7},      {"Dagger", 0x2021},
    {"Delta", 0x394},    {"ETH", 0xD0},      {"Eacute", 0xC9},    {"Ecirc", 0xCA},
    {"Egrave", 0xC8},    {"Epsilon", 0x395}, {"Eta", 0x397},      {"Euml", 0xCB},
    {"Gamma", 0x393},    {"Iacute", 0xCD},   {"Icirc", 0xCE},     {"Igrave", 0xCC},
    {"Iota", 0x399},     {"Iuml", 0xCF},     {"Kappa", 0x39A},    {"Lambda", 0x39B},
    {"Mu", 0x39C},       {"Ntilde", 0xD1},   {"Nu", 0x39D},       {"OElig", 0x152},
    {"Oacute", 0xD3},    {"Ocirc", 0xD4},    {"Ograve", 0xD2},    {"Omega", 0x3A9},
    {"Omicron", 0x39F},  {"Oslash", 0xD8},   {"Otilde", 0xD5},    {"Ouml", 0xD6},
    {"Phi", 0x3A6},      {"Pi", 0x3A0},      {"Prime", 0x2033},   {"Psi", 0x3A8},
    {"Rho", 0x3A1},      {"Scaron", 0x160},  {"Sigma", 0x3A3},    {"THORN", 0xDE},
    {"Tau", 0x3A4},      {"Theta", 0x398},   {"Uacute", 0xDA},    {"Ucirc", 0xDB},
    {"Ugrave", 0xD9},    {"Upsilon", 0x3A5}, {"Uuml", 0xDC},      {"Xi", 0x39E},
    {"Yacute", 0xDD},    {"Yuml", 0x178},    {"Zeta", 0x396},     {"aacute", 0xE1},
    {"acirc", 0xE2},     {"acute", 0xB4},    {"aelig", 0xE6},     {"agrave", 0xE0},
    {"alefsym", 0x2135}, {"alpha", 0x3B1},   {"amp", 0x26},       {"and", 0x2227},
    {"ang", 0x2220},     {"apos", 0x27},     {"aring", 0xE5},     {"asymp", 0x2248},
    {"atilde", 0xE3},    {"auml", 0xE4},     {"bdquo", 0x201E},   {"beta", 0x3B2},
    {"brvbar", 0xA6},    {"bull", 0x2022},   {"cap", 0x2229},     {"ccedil", 0xE7},
    {"cedil", 0xB8},     {"cent", 0xA2},     {"chi", 0x3C7},      {"circ", 0x2C6},
    {"clubs", 0x2663},   {"cong", 0x2245},   {"copy", 0xA9},      {"crarr", 0x21B5},
    {"cup", 0x222A},     {"curren", 0xA4},   {"dArr", 0x21D3},    {"dagger", 0x2020},
    {"darr", 0x2193},    {"deg", 0xB0},      {"delta", 0x3B4},    {"diams", 0x2666},
    {"divide", 0xF7},    {"eacute", 0xE9},   {"ecirc", 0xEA},     {"egrave", 0xE8},
    {"empty", 0x2205},   {"emsp", 0x2003},   {"ensp", 0x2002},    {"epsilon", 0x3B5},
    {"equiv", 0x2261},   {"eta", 0x3B7},     {"eth", 0xF0},       {"euml", 0xEB},
    {"euro", 0x20AC},    {"exist", 0x2203},  {"fnof", 0x192},     {"forall", 0x2200},
    {"frac12", 0xBD},    {"frac14", 0xBC},   {"frac34", 0xBE},    {"frasl", 0x2044},
    {"gamma", 0x3B3},    {"ge", 0x2265},     {"gt", 0x3E},        {"hArr", 0x21D4},
    {"harr", 0x2194},    {"hearts", 0x2665}, {"hellip", 0x2026},  {"iacute", 0xED},
    {"icirc", 0xEE},     {"iexcl", 0xA1},    {"igrave", 0xEC},    {"image", 0x2111},
    {"infin", 0x221E},   {"int", 0x222B},    {"iota", 0x3B9},     {"iquest", 0xBF},
    {"isin", 0x2208},    {"iuml", 0xEF},     {"kappa", 0x3BA},    {"lArr", 0x21D0},
    {"lambda", 0x3BB},   {"lang", 0x2329},   {"laquo", 0xAB},     {"larr", 0x2190},
    {"lceil", 0x2308},   {"ldquo", 0x201C},  {"le", 0x2264},      {"lfloor", 0x230A},
    {"lowast", 0x2217},  {"loz", 0x25CA},    {"lrm", 0x200E},     {"lsaquo", 0x2039},
    {"lsquo", 0x2018},   {"lt", 0x3C},       {"macr", 0xAF},      {"mdash", 0x2014},
    {"micro", 0xB5},     {"middot", 0xB7},   {"minus", 0x2212},   {"mu", 0x3BC},
    {"nabla", 0x2207},   {"nbsp", 0xA0},     {"ndash", 0x2013},   {"ne", 0x2260},
    {"ni", 0x220B},      {"not", 0xAC},      {"notin", 0x2209},   {"nsub", 0x2284},
    {"ntilde", 0xF1},    {"nu", 0x3BD},      {"oacute", 0xF3},    {"ocirc", 0xF4},
    {"oelig", 0x153},    {"ograve", 0xF2},   {"oline", 0x203E},   {"omega", 0x3C9},
    {"omicron", 0x3BF},  {"oplus", 0x2295},  {"or", 0x2228},      {"ordf", 0xAA},
    {"ordm", 0xBA},      {"oslash", 0xF8},   {"otilde", 0xF5},    {"otimes", 0x2297},
    {"ouml", 0xF6},      {"para", 0xB6},     {"part", 0x2202},    {"permil", 0x2030},
    {"perp", 0x22A5},    {"phi", 0x3C6},     {"pi", 0x3C0},       {"piv", 0x3D6},
    {"plusmn", 0xB1},    {"pound", 0xA3},    {"prime", 0x2032},   {"prod", 0x220F},
    {"prop", 0x221D},    {"psi", 0x3C8},     {"quot", 0x22},      {"rArr", 0x21D2},
    {"radic", 0x221A},   {"rang", 0x232A},   {"raquo", 0xBB},     {"rarr", 0x2192},
    {"rceil", 0x2309},   {"rdquo", 0x201D},  {"real", 0x211C},    {"reg", 0xAE},
    {"rfloor", 0x230B},  {"rho", 0x3C1},     {"rlm", 0x200F},     {"rsaquo", 0x203A},
    {"rsquo", 0x2019},   {"sbquo", 0x201A},  {"scaron", 0x161},   {"sdot", 0x22C5},
    {"sect", 0xA7},      {"shy", 0xAD},      {"sigma", 0x3C3},    {"sigmaf", 0x3C2},
    {"sim", 0x223C},     {"spades", 0x2660}, {"sub", 0x2282},     {"sube", 0x2286},
    {"sum", 0x2211},     {"sup", 0x2283},    {"sup1", 0xB9},      {"sup2", 0xB2},
    {"sup3", 0xB3},      {"supe", 0x2287},   {"szlig", 0xDF},     {"tau", 0x3C4},
    {"there4", 0x2234},  {"theta", 0x3B8},   {"thetasym", 0x3D1}, {"thinsp", 0x2009},
    {"thorn", 0xFE},     {"tilde", 0x2DC},   {"times", 0xD7},     {"trade", 0x2122},
    {"uArr", 0x21D1},    {"uacute", 0xFA},   {"uarr", 0x2191},    {"ucirc", 0xFB},
    {"ugrave", 0xF9},    {"uml", 0xA8},      {"upsih", 0x3D2},    {"upsilon", 0x3C5},
    {"uuml", 0xFC},      {"weierp", 0x2118}, {"xi", 0x3BE},       {"yacute", 0xFD},
    {"yen", 0xA5},       {"yuml", 0xFF},     {"zeta", 0x3B6},     {"zwj", 0x200D},
    {"zwnj", 0x200C},
};

bool is_alnum_ascii(char32_t c) {
  return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z');
}

// Python's html.unescape of "&#<body>;" (body = digits, or x/X + hex digits); false when the
// body is not a complete number, which leaves the reference as it is.
bool numeric_reference(std::u32string_view body, std::u32string& out) {
  const bool hex = !body.empty() && (body[0] == 'x' || body[0] == 'X');
  const auto digits = hex ? body.substr(1) : body;
  if (digits.empty()) return false;
  uint64_t num = 0;
  for (char32_t c : digits) {
    uint32_t d;
    if (c >= '0' && c <= '9') {
      d = c - '0';
    } else if (hex && (c | 0x20) >= 'a' && (c | 0x20) <= 'f') {
      d = (c | 0x20) - 'a' + 10;
    } else {
      return false;
    }
    num = std::min<uint64_t>(num * (hex ? 16 : 10) + d, 0x110000);  // saturates: > U+10FFFF
  }
  if (num == 0) {
    out.push_back(kReplacement);
  } else if (num == 0x0D) {
    out.push_back(0x0D);
  } else if (num >= 0x80 && num <= 0x9F) {
    out.push_back(kCp1252[num - 0x80]);
  } else if ((num >= 0xD800 && num <= 0xDFFF) || num > 0x10FFFF) {
    out.push_back(kReplacement);
  } else if ((num >= 0x1 && num <= 0x8) || num == 0xB || (num >= 0xE && num <= 0x1F) ||
             num == 0x7F || (num >= 0xFDD0 && num <= 0xFDEF) || (num & 0xFFFE) == 0xFFFE) {
    // Python drops these non-characters and controls.
  } else {
    out.push_back(static_cast<char32_t>(num));
  }
  return true;
}

// One pass of ftfy's HTML_ENTITY_RE (`&#?[0-9A-Za-z]{1,24};`) substitution over `text`.
std::u32string unescape_once(std::u32string_view text) {
  std::u32string out;
  out.reserve(text.size());
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] != '&') {
      out.push_back(text[i++]);
      continue;
    }
    const size_t start = i + 1 + (i + 1 < text.size() && text[i + 1] == '#' ? 1 : 0);
    size_t end = start;
    while (end < text.size() && end - start < 24 && is_alnum_ascii(text[end])) ++end;
    if (end == start || end >= text.size() || text[end] != ';') {
      out.push_back(text[i++]);
      continue;
    }
    const auto body = text.substr(start, end - start);
    bool replaced = false;
    if (start == i + 2) {
      replaced = numeric_reference(body, out);
    } else {
      std::string name(body.begin(), body.end());  // ASCII alphanumerics
      const auto* it = std::lower_bound(
          std::begin(kEntities), std::end(kEntities), name,
          [](const Entity& e, const std::string& n) { return std::string_view(e.name) < n; });
      if (it != std::end(kEntities) && name == it->name) {
        out.push_back(it->code);
        replaced = true;
      }
    }
    if (!replaced) out.append(text.substr(i, end + 1 - i));
    i = end + 1;
  }
  return out;
}

// ftfy's fix_character_width: fullwidth/halfwidth forms U+FF01-U+FFEF -> their NFKC, U+3000 ->
// space. Built once from utf8proc's compatibility decompositions.
const std::array<std::u32string, 0xFFF0 - 0xFF01>& width_map() {
  static const auto table = [] {
    std::array<std::u32string, 0xFFF0 - 0xFF01> t;
    for (char32_t c = 0xFF01; c < 0xFFF0; ++c) {
      const std::u32string one(1, c);
      const auto utf8 = encode_utf8(one);
      utf8proc_uint8_t* mapped = nullptr;
      const auto n = utf8proc_map(
          reinterpret_cast<const utf8proc_uint8_t*>(utf8.data()),
          static_cast<utf8proc_ssize_t>(utf8.size()), &mapped,
          static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE | UTF8PROC_COMPAT));
      if (n > 0) {
        auto decoded = decode_utf8(
            std::string_view(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n)));
        if (decoded != one) t[c - 0xFF01] = std::move(decoded);
      }
      std::free(mapped);
    }
    return t;
  }();
  return table;
}

// ftfy's control characters to remove (remove_control_chars).
bool is_removed_control(char32_t c) {
  return c <= 0x08 || c == 0x0B || (c >= 0x0E && c <= 0x1F) || c == 0x7F ||
         (c >= 0x206A && c <= 0x206F) || c == 0xFEFF || (c >= 0xFFF9 && c <= 0xFFFC) ||
         (c >= 0x1D173 && c <= 0x1D17A) || (c >= 0xE0000 && c <= 0xE007F);
}

// ftfy's fixes after unescaping, in its order: C1 controls as Windows-1252, Latin ligatures,
// character width, curly quotes, control characters; then NFC.
std::u32string fix_characters(std::u32string_view text) {
  std::u32string out;
  out.reserve(text.size());
  for (char32_t c : text) {
    if (c < 0x80) {
      if (!is_removed_control(c)) out.push_back(c);
      continue;
    }
    if (c <= 0x9F) {
      out.push_back(kCp1252[c - 0x80]);
    } else if (c == 0x132 || c == 0x133) {  // IJ ij
      out += c == 0x132 ? U"IJ" : U"ij";
    } else if (c >= 0xFB00 && c <= 0xFB06) {  // ff fi fl ffi ffl long-s-t st
      static const char32_t* const kLigatures[] = {U"ff",  U"fi",      U"fl", U"ffi",
                                                   U"ffl", U"\u017Ft", U"st"};
      out += kLigatures[c - 0xFB00];
    } else if (c == 0x3000) {
      out.push_back(' ');
    } else if (c >= 0xFF01 && c < 0xFFF0 && !width_map()[c - 0xFF01].empty()) {
      out += width_map()[c - 0xFF01];
    } else if (c >= 0x2018 && c <= 0x201B) {
      out.push_back('\'');
    } else if (c >= 0x201C && c <= 0x201F) {
      out.push_back('"');
    } else if (!is_removed_control(c)) {
      out.push_back(c);
    }
  }
  return nfc(out);
}

// ftfy's fix_and_explain on one segment: the fixes, repeated until the text is stable.
std::u32string fix_segment(std::u32string text, bool unescape) {
  for (int pass = 0; pass < 16; ++pass) {  // each pass that changes something shortens or
    auto fixed = unescape ? unescape_once(text) : text;  // canonicalises; 16 is ample
    fixed = fix_characters(fixed);
    if (fixed == text) break;
    text = std::move(fixed);
  }
  return text;
}

bool needs_fixing(std::u32string_view text) {
  for (char32_t c : text) {
    if (c >= 0x80 || c == '&' || is_removed_control(c)) return true;
  }
  return false;
}

// Python's unicodedata-based approximations of Unicode's Cased and Case_Ignorable properties,
// for the final-sigma rule of str.lower().
bool is_cased(char32_t c) {
  const auto cat = category(c);
  if (cat == UTF8PROC_CATEGORY_LU || cat == UTF8PROC_CATEGORY_LL || cat == UTF8PROC_CATEGORY_LT)
    return true;
  const auto i = static_cast<utf8proc_int32_t>(c);
  return utf8proc_tolower(i) != i || utf8proc_toupper(i) != i;
}

bool is_case_ignorable(char32_t c) {
  switch (c) {
    case '\'':
    case '.':
    case ':':
    case '^':
    case '`':
    case 0xB7:
    case 0x387:
    case 0x55F:
    case 0x5F4:
    case 0x2018:
    case 0x2019:
    case 0x2024:
    case 0x2027:
    case 0xFE13:
    case 0xFE52:
    case 0xFE55:
    case 0xFF07:
    case 0xFF0E:
    case 0xFF1A: return true;
    default: break;
  }
  const auto cat = category(c);
  return cat == UTF8PROC_CATEGORY_MN || cat == UTF8PROC_CATEGORY_ME ||
         cat == UTF8PROC_CATEGORY_CF || cat == UTF8PROC_CATEGORY_LM || cat == UTF8PROC_CATEGORY_SK;
}

bool final_sigma(std::u32string_view s, size_t i) {
  size_t j = i;
  while (j > 0 && is_case_ignorable(s[j - 1])) --j;
  if (j == 0 || !is_cased(s[j - 1])) return false;
  j = i + 1;
  while (j < s.size() && is_case_ignorable(s[j])) ++j;
  return j == s.size() || !is_cased(s[j]);
}

// Python's str.lower(): simple lower-case mappings plus the unconditional special casing of
// U+0130 and the final-sigma rule.
std::u32string lower(std::u32string_view s) {
  std::u32string out;
  out.reserve(s.size());
  for (size_t i = 0; i < s.size(); ++i) {
    const char32_t c = s[i];
    if (c < 0x80) {
      out.push_back(c >= 'A' && c <= 'Z' ? c + 32 : c);
    } else if (c == 0x130) {
      out += U"i\u0307";
    } else if (c == 0x3A3) {
      out.push_back(final_sigma(s, i) ? 0x3C2 : 0x3C3);
    } else {
      out.push_back(static_cast<char32_t>(utf8proc_tolower(static_cast<utf8proc_int32_t>(c))));
    }
  }
  return out;
}

bool starts_with(std::u32string_view s, size_t i, std::u32string_view prefix) {
  return s.size() - i >= prefix.size() && s.substr(i, prefix.size()) == prefix;
}

// Case-insensitive match of one lower-case ASCII letter of a contraction: with IGNORECASE,
// `regex` also matches U+017F LATIN SMALL LETTER LONG S for 's'.
bool contraction_char(char32_t c, char want) {
  return c == static_cast<char32_t>(want) || (want == 's' && c == 0x17F);
}

// Length of the contraction at `i` ('s 't 're 've 'm 'll 'd, in that order), or 0.
size_t contraction(std::u32string_view s, size_t i) {
  if (s[i] != '\'' || i + 1 >= s.size()) return 0;
  static const char* const kTails[] = {"s", "t", "re", "ve", "m", "ll", "d"};
  for (const char* tail : kTails) {
    const std::string_view t(tail);
    if (s.size() - i - 1 < t.size()) continue;
    bool ok = true;
    for (size_t k = 0; k < t.size() && ok; ++k) ok = contraction_char(s[i + 1 + k], t[k]);
    if (ok) return 1 + t.size();
  }
  return 0;
}

}  // namespace

std::u32string decode_utf8(std::string_view text) {
  std::u32string out;
  out.reserve(text.size());
  const auto* p = reinterpret_cast<const utf8proc_uint8_t*>(text.data());
  size_t i = 0;
  while (i < text.size()) {
    if (p[i] < 0x80) {
      out.push_back(p[i++]);
      continue;
    }
    utf8proc_int32_t c = 0;
    const auto n = utf8proc_iterate(p + i, static_cast<utf8proc_ssize_t>(text.size() - i), &c);
    if (n <= 0) {
      out.push_back(kReplacement);
      ++i;
    } else {
      out.push_back(static_cast<char32_t>(c));
      i += static_cast<size_t>(n);
    }
  }
  return out;
}

std::string encode_utf8(std::u32string_view text) {
  std::string out;
  out.reserve(text.size());
  utf8proc_uint8_t buf[4];
  for (char32_t c : text) {
    if (c < 0x80) {
      out.push_back(static_cast<char>(c));
      continue;
    }
    if (c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) c = kReplacement;
    const auto n = utf8proc_encode_char(static_cast<utf8proc_int32_t>(c), buf);
    out.append(reinterpret_cast<const char*>(buf), static_cast<size_t>(n));
  }
  return out;
}

std::u32string nfc(std::u32string_view text) {
  // Code points below U+0300 never change under NFC (nothing composes with them yet).
  if (std::all_of(text.begin(), text.end(), [](char32_t c) { return c < 0x300; })) {
    return std::u32string(text);
  }
  const auto utf8 = encode_utf8(text);
  utf8proc_uint8_t* mapped = nullptr;
  const auto n = utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(utf8.data()),
                              static_cast<utf8proc_ssize_t>(utf8.size()), &mapped,
                              static_cast<utf8proc_option_t>(UTF8PROC_STABLE | UTF8PROC_COMPOSE));
  std::u32string out;
  if (n >= 0) {
    out = decode_utf8(
        std::string_view(reinterpret_cast<const char*>(mapped), static_cast<size_t>(n)));
  } else {
    out = std::u32string(text);  // cannot happen: encode_utf8 writes valid UTF-8
  }
  std::free(mapped);
  return out;
}

std::u32string clean(std::string_view text) {
  const auto decoded = decode_utf8(text);
  std::u32string fixed;
  if (needs_fixing(decoded)) {
    // ftfy's fix_text: line by line; from the first line holding a '<' on, no HTML unescaping.
    bool unescape = true;
    size_t pos = 0;
    while (pos < decoded.size()) {
      size_t end = decoded.find(U'\n', pos);
      end = end == std::u32string::npos ? decoded.size() : end + 1;
      const std::u32string segment = decoded.substr(pos, end - pos);
      if (segment.find(U'<') != std::u32string::npos) unescape = false;
      fixed += fix_segment(segment, unescape);
      pos = end;
    }
  } else {
    fixed = decoded;
  }
  // whitespace_clean: every whitespace run -> one space, then strip.
  std::u32string spaced;
  spaced.reserve(fixed.size());
  for (char32_t c : fixed) {
    if (is_space(c)) {
      if (!spaced.empty() && spaced.back() != ' ') spaced.push_back(' ');
    } else {
      spaced.push_back(c);
    }
  }
  if (!spaced.empty() && spaced.back() == ' ') spaced.pop_back();
  return lower(spaced);
}

std::vector<std::string> pre_tokenize(std::u32string_view s) {
  static constexpr std::u32string_view kStart = U"<|startoftext|>", kEnd = U"<|endoftext|>";
  std::vector<std::string> pieces;
  size_t i = 0;
  while (i < s.size()) {
    const char32_t c = s[i];
    size_t len = 0;
    if (is_space(c)) {
      ++i;
      continue;
    }
    if (c == '<' && starts_with(s, i, kStart)) {
      len = kStart.size();
    } else if (c == '<' && starts_with(s, i, kEnd)) {
      len = kEnd.size();
    } else if (c == '\'' && contraction(s, i) > 0) {
      len = contraction(s, i);
    } else if (is_letter(c)) {
      len = 1;
      while (i + len < s.size() && is_letter(s[i + len])) ++len;
    } else if (is_number(c)) {
      len = 1;
    } else {
      len = 1;
      while (i + len < s.size() && !is_space(s[i + len]) && !is_letter(s[i + len]) &&
             !is_number(s[i + len]))
        ++len;
    }
    pieces.push_back(encode_utf8(s.substr(i, len)));
    i += len;
  }
  return pieces;
}

}  // namespace difftrain::models::clip_text
