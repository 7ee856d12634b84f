// Family options (train/option_spec.h) and the reading of a value as written
// (option_text.h), which the trainer's options share.
#include "difftrain/train/option_spec.h"

#include "option_text.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace difftrain::train {
namespace option_text {
namespace {

std::string lower(std::string s) {
  std::transform(s.begin(), s.end(), s.begin(), [](unsigned char c) { return std::tolower(c); });
  return s;
}

}  // namespace

void bad(const Raw& raw, const std::string& expected) {
  throw Error(raw.where + " is \"" + raw.text + "\": expected " + expected);
}

bool is_null(const Raw& raw) {
  const auto t = lower(raw.text);
  return t == "null" || t == "none" || t == "~" || t.empty();
}

bool to_bool(const Raw& raw) {
  const auto t = lower(raw.text);
  if (t == "true" || t == "1" || t == "yes" || t == "on") return true;
  if (t == "false" || t == "0" || t == "no" || t == "off") return false;
  bad(raw, "true or false");
}

int64_t to_int(const Raw& raw) {
  errno = 0;
  char* end = nullptr;
  const long long v = std::strtoll(raw.text.c_str(), &end, 10);
  if (raw.text.empty() || *end != '\0' || errno != 0) bad(raw, "an integer");
  return v;
}

double to_double(const Raw& raw) {
  errno = 0;
  char* end = nullptr;
  const double v = std::strtod(raw.text.c_str(), &end);
  if (raw.text.empty() || *end != '\0' || errno != 0 || !std::isfinite(v)) bad(raw, "a number");
  return v;
}

std::vector<std::string> to_list(const Raw& raw) {
  std::vector<std::string> out;
  std::stringstream in(raw.text);
  std::string item;
  while (std::getline(in, item, ',')) {
    item.erase(0, item.find_first_not_of(" \t"));
    item.erase(item.find_last_not_of(" \t") + 1);
    if (!item.empty()) out.push_back(item);
  }
  if (out.empty()) bad(raw, "a comma-separated list");
  return out;
}

}  // namespace option_text

nlohmann::json parse_option_value(const std::string& type, const std::string& text,
                                  const std::string& where) {
  using namespace option_text;
  const Raw raw{text, where};
  std::string base = type;
  if (!base.empty() && base.back() == '?') {
    if (is_null(raw)) return nullptr;
    base.pop_back();
  }
  if (base == "bool") return to_bool(raw);
  if (base == "int") return to_int(raw);
  if (base == "float") return to_double(raw);
  if (base == "list") return to_list(raw);
  if (base == "string") return text;
  throw Error(fmt::format("{}: the option's type \"{}\" is not bool, int, float, string or list",
                          where, type));
}

nlohmann::json parse_option_values(const OptionSpec& spec, const std::vector<std::string>& texts,
                                   const std::string& where) {
  nlohmann::json value;
  if (spec.values == 1) {
    if (texts.size() != 1) {
      throw Error(fmt::format("{} takes one value, got {}", where, texts.size()));
    }
    value = parse_option_value(spec.type, texts[0], where);
  } else {
    if (spec.values > 1 && static_cast<int64_t>(texts.size()) != spec.values) {
      throw Error(fmt::format("{} takes {} values, got {}", where, spec.values, texts.size()));
    }
    if (texts.empty()) throw Error(where + " needs a value");
    value = nlohmann::json::array();
    for (const auto& t : texts) value.push_back(parse_option_value(spec.type, t, where));
  }
  if (spec.check) spec.check(value, where);
  return value;
}

std::function<void(const nlohmann::json&, const std::string&)> range_check(double lo, double hi) {
  return [lo, hi](const nlohmann::json& value, const std::string& where) {
    const auto one = [&](const nlohmann::json& v) {
      if (!v.is_number()) return;
      const double x = v.get<double>();
      if (x < lo || x > hi) {
        throw Error(fmt::format("{} is {}: expected a value in [{}, {}]", where, v.dump(), lo, hi));
      }
    };
    if (value.is_array()) {
      for (const auto& v : value) one(v);
    } else {
      one(value);
    }
  };
}

std::function<void(const nlohmann::json&, const std::string&)> one_of_check(
    std::vector<std::string> allowed) {
  return [allowed = std::move(allowed)](const nlohmann::json& value, const std::string& where) {
    const std::string v = value.is_string() ? value.get<std::string>() : value.dump();
    if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return;
    throw Error(
        fmt::format("{} is \"{}\": expected one of {}", where, v, fmt::join(allowed, ", ")));
  };
}

const OptionSpec* FamilyOptions::find(const std::string& name) const {
  for (const auto& s : specs) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

const nlohmann::json& FamilyOptions::at(const std::string& name) const {
  if (find(name) == nullptr || !values.contains(name)) {
    throw Error(fmt::format("the {} family declares no option \"{}\"",
                            family.empty() ? "run's" : family, name));
  }
  return values.at(name);
}

void FamilyOptions::complete_and_check() {
  for (const auto& s : specs) {
    if (!values.contains(s.name)) values[s.name] = s.default_value;
    if (s.check && !values[s.name].is_null()) s.check(values[s.name], "--" + s.name);
  }
}

}  // namespace difftrain::train
