#pragma once
// Internal to src/models: typed reads of a config.json object with one-line difftrain::Error
// messages that name the file and the field (the UNet, CLIP text encoder and VAE configs).

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::models::detail {

/// Parses `text` read from `source` (a path, for messages); `what` names the expected file in the
/// error ("a Diffusers AutoencoderKL config.json").
inline nlohmann::json parse_json_text(const std::string& text, const std::string& source,
                                      const std::string& what) {
  try {
    return nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {  // parse_error, or out_of_range for 1e999
    throw Error(source + ": not valid JSON (" + std::string(e.what()) + "); expected " + what);
  }
}

/// parse_json_text() of the file at `path`.
inline nlohmann::json parse_json_file(const std::string& path, const std::string& what) {
  return parse_json_text(io::read_file(path), path, what);
}

/// Typed field access on one JSON object; a missing or null field takes the fallback.
class JsonFields {
 public:
  JsonFields(const nlohmann::json& j, std::string source) : j_(j), source_(std::move(source)) {}

  [[noreturn]] void fail(const std::string& key, const std::string& what) const {
    throw Error(source_ + ": field \"" + key + "\" " + what);
  }
  bool has(const std::string& key) const { return j_.contains(key) && !j_.at(key).is_null(); }

  const nlohmann::json& at(const std::string& key) const { return j_.at(key); }

  int64_t integer(const std::string& key, int64_t fallback) const {
    if (!has(key)) return fallback;
    return as_int(key, j_.at(key));
  }
  /// Absent: fallback; null: nullopt.
  std::optional<int64_t> opt_integer(const std::string& key,
                                     std::optional<int64_t> fallback) const {
    if (!j_.contains(key)) return fallback;
    if (j_.at(key).is_null()) return std::nullopt;
    return as_int(key, j_.at(key));
  }
  std::optional<std::string> opt_string(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    return string(key, "");
  }
  /// An int or a list of n ints (Diffusers' "Union[int, Tuple[int]]").
  std::vector<int64_t> per_block(const std::string& key, int64_t fallback, size_t n) const {
    if (!has(key)) return std::vector<int64_t>(n, fallback);
    const nlohmann::json& v = j_.at(key);
    if (v.is_number()) return std::vector<int64_t>(n, as_int(key, v));
    if (!v.is_array() || v.size() != n) {
      fail(key, "must be an integer or a list of " + std::to_string(n) +
                    " integers (one per down block), got " + v.dump());
    }
    std::vector<int64_t> out;
    for (const auto& e : v) out.push_back(as_int(key, e));
    return out;
  }
  /// An integer that must be >= `min`.
  int64_t integer_at_least(const std::string& key, int64_t fallback, int64_t min) const {
    const int64_t v = integer(key, fallback);
    if (v < min) fail(key, "must be >= " + std::to_string(min) + ", got " + std::to_string(v));
    return v;
  }
  double number(const std::string& key, double fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_number()) fail(key, "must be a number, got " + j_.at(key).dump());
    return j_.at(key).get<double>();
  }
  std::optional<double> opt_number(const std::string& key) const {
    if (!has(key)) return std::nullopt;
    return number(key, 0);
  }
  bool boolean(const std::string& key, bool fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_boolean()) fail(key, "must be true or false, got " + j_.at(key).dump());
    return j_.at(key).get<bool>();
  }
  std::string string(const std::string& key, const std::string& fallback) const {
    if (!has(key)) return fallback;
    if (!j_.at(key).is_string()) fail(key, "must be a string, got " + j_.at(key).dump());
    return j_.at(key).get<std::string>();
  }
  std::string choice(const std::string& key, const std::string& fallback,
                     const std::vector<std::string>& allowed) const {
    std::string value = string(key, fallback);
    if (std::find(allowed.begin(), allowed.end(), value) == allowed.end()) {
      fail(key, "is \"" + value + "\"; supported: " + join(allowed));
    }
    return value;
  }
  std::vector<std::string> strings(const std::string& key,
                                   const std::vector<std::string>& fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j_.at(key);
    if (!v.is_array()) fail(key, "must be a list of strings, got " + v.dump());
    std::vector<std::string> out;
    for (const auto& e : v) {
      if (!e.is_string()) fail(key, "must be a list of strings, got " + v.dump());
      out.push_back(e.get<std::string>());
    }
    return out;
  }
  std::vector<int64_t> integers(const std::string& key,
                                const std::vector<int64_t>& fallback) const {
    if (!has(key)) return fallback;
    const nlohmann::json& v = j_.at(key);
    if (!v.is_array()) fail(key, "must be a list of integers, got " + v.dump());
    std::vector<int64_t> out;
    for (const auto& e : v) out.push_back(as_int(key, e));
    return out;
  }
  int64_t as_int(const std::string& key, const nlohmann::json& v) const {
    if (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t{INT64_MAX}) {
      fail(key, "must be an integer below 2^63, got " + v.dump());
    }
    if (v.is_number_integer()) return v.get<int64_t>();
    if (v.is_number_float()) {
      // 4.0 is read as 4; the range check comes first because converting a double outside
      // int64's range (1e300, NaN) is undefined behaviour.
      const double d = v.get<double>();
      if (d >= -0x1p63 && d < 0x1p63 && d == std::trunc(d)) return static_cast<int64_t>(d);
    }
    fail(key, "must be an integer, got " + v.dump());
  }

  static std::string join(const std::vector<std::string>& names) {
    std::string out;
    for (const auto& n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
  }

 private:
  const nlohmann::json& j_;
  std::string source_;
};

}  // namespace difftrain::models::detail
