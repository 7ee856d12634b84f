// json.dumps and repr(float) for chat-template values (chat_template_values.h): Transformers'
// `tojson` filter is Python's json.dumps, whose spacing, escapes and float digits templates print.

#include "chat_template_values.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>

namespace difftrain::models::jinja::values {

namespace {

using detail::chars;

void json_string(std::string& out, const std::string& s, bool ensure_ascii) {
  out += '"';
  for (const auto& c : chars(s)) {
    const auto b = static_cast<unsigned char>(c[0]);
    if (c == "\"") {
      out += "\\\"";
    } else if (c == "\\") {
      out += "\\\\";
    } else if (c == "\n") {
      out += "\\n";
    } else if (c == "\r") {
      out += "\\r";
    } else if (c == "\t") {
      out += "\\t";
    } else if (c == "\b") {
      out += "\\b";
    } else if (c == "\f") {
      out += "\\f";
    } else if (b < 0x20 || (ensure_ascii && b >= 0x80)) {
      uint32_t cp = b;
      if (c.size() == 2) cp = ((b & 0x1Fu) << 6) | (static_cast<unsigned char>(c[1]) & 0x3Fu);
      if (c.size() == 3) {
        cp = ((b & 0x0Fu) << 12) | ((static_cast<unsigned char>(c[1]) & 0x3Fu) << 6) |
             (static_cast<unsigned char>(c[2]) & 0x3Fu);
      }
      if (c.size() == 4) {
        cp = ((b & 0x07u) << 18) | ((static_cast<unsigned char>(c[1]) & 0x3Fu) << 12) |
             ((static_cast<unsigned char>(c[2]) & 0x3Fu) << 6) |
             (static_cast<unsigned char>(c[3]) & 0x3Fu);
      }
      char buf[16];
      if (cp >= 0x10000) {
        cp -= 0x10000;
        std::snprintf(buf, sizeof buf, "\\u%04x\\u%04x", 0xD800 + (cp >> 10),
                      0xDC00 + (cp & 0x3FF));
      } else {
        std::snprintf(buf, sizeof buf, "\\u%04x", cp);
      }
      out += buf;
    } else {
      out += c;
    }
  }
  out += '"';
}

void dump(std::string& out, const Json& j, bool ascii, int indent, int level,
          const std::string& item_sep, const std::string& key_sep, bool sort_keys) {
  auto newline = [&](int l) {
    if (indent >= 0) out += "\n" + std::string(static_cast<size_t>(indent * l), ' ');
  };
  if (j.is_object()) {
    if (j.empty()) {
      out += "{}";
      return;
    }
    std::vector<std::string> keys;
    for (const auto& [key, value] : j.items()) keys.push_back(key);
    if (sort_keys) std::sort(keys.begin(), keys.end());
    out += "{";
    for (size_t k = 0; k < keys.size(); ++k) {
      if (k > 0) out += item_sep;
      newline(level + 1);
      json_string(out, keys[k], ascii);
      out += key_sep;
      dump(out, j.at(keys[k]), ascii, indent, level + 1, item_sep, key_sep, sort_keys);
    }
    newline(level);
    out += "}";
  } else if (j.is_array()) {
    if (j.empty()) {
      out += "[]";
      return;
    }
    out += "[";
    for (size_t k = 0; k < j.size(); ++k) {
      if (k > 0) out += item_sep;
      newline(level + 1);
      dump(out, j[k], ascii, indent, level + 1, item_sep, key_sep, sort_keys);
    }
    newline(level);
    out += "]";
  } else if (j.is_string()) {
    json_string(out, j.get_ref<const std::string&>(), ascii);
  } else if (j.is_null()) {
    out += "null";
  } else if (j.is_boolean()) {
    out += j.get<bool>() ? "true" : "false";
  } else if (j.is_number_float()) {
    const double x = j.get<double>();
    out += std::isnan(x)   ? "NaN"
           : std::isinf(x) ? (x > 0 ? "Infinity" : "-Infinity")
                           : float_repr(x);
  } else {
    out += j.dump();
  }
}

}  // namespace

std::string float_repr(double x) {
  if (std::isnan(x)) return "nan";
  if (std::isinf(x)) return x > 0 ? "inf" : "-inf";
  // The shortest digits that read back as x, placed as Python's repr places them.
  char buf[40];
  int precision = 1;
  for (; precision <= 17; ++precision) {
    std::snprintf(buf, sizeof buf, "%.*e", precision - 1, x);
    if (std::strtod(buf, nullptr) == x) break;
  }
  std::string s = buf;
  const size_t e = s.find('e');
  const int exponent = std::atoi(s.c_str() + e + 1);
  std::string digits;
  for (size_t k = 0; k < e; ++k) {
    if (std::isdigit(static_cast<unsigned char>(s[k]))) digits += s[k];
  }
  while (digits.size() > 1 && digits.back() == '0') digits.pop_back();
  const std::string sign = x < 0 ? "-" : "";
  if (exponent < -4 || exponent >= 16) {
    std::string mantissa = digits.substr(0, 1);
    if (digits.size() > 1) mantissa += "." + digits.substr(1);
    char ebuf[16];
    std::snprintf(ebuf, sizeof ebuf, "e%c%02d", exponent < 0 ? '-' : '+', std::abs(exponent));
    return sign + mantissa + ebuf;
  }
  if (exponent < 0)
    return sign + "0." + std::string(static_cast<size_t>(-exponent - 1), '0') + digits;
  const auto point = static_cast<size_t>(exponent) + 1;
  if (digits.size() <= point) return sign + digits + std::string(point - digits.size(), '0') + ".0";
  return sign + digits.substr(0, point) + "." + digits.substr(point);
}

std::string json_dumps(const Json& j, bool ensure_ascii, int indent, const std::string& item_sep,
                       const std::string& key_sep, bool sort_keys) {
  std::string out;
  dump(out, j, ensure_ascii, indent, 0, item_sep, key_sep, sort_keys);
  return out;
}

}  // namespace difftrain::models::jinja::values
