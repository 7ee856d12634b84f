#include "difftrain/io/lora_adapter_config.h"

#include "difftrain/io/lora_layout.h"

#include "difftrain/core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <regex>

namespace difftrain::io {
namespace {

using Json = nlohmann::ordered_json;  // keeps the file's order: the first matching pattern wins

[[noreturn]] void fail(const std::string& where, const std::string& what) {
  throw Error(where + ": " + what);
}

// PEFT's get_pattern_key: `key` matches `module` when re.match(rf".*\.{key}$", module), or, as
// PEFT's fallback, when it is the module's own name.
bool pattern_matches(const std::string& key, const std::string& module) {
  if (key == module) return true;
  try {
    return std::regex_match(module, std::regex(".*\\." + key));
  } catch (const std::regex_error&) {
    // Not a valid (ECMAScript) regex: compare it literally as a dotted suffix.
    return module.size() > key.size() &&
           module.compare(module.size() - key.size(), key.size(), key) == 0 &&
           module[module.size() - key.size() - 1] == '.';
  }
}

int64_t rank_value(const Json& v, const std::string& where, const std::string& field) {
  if (!v.is_number() || !std::isfinite(v.get<double>()) || v.get<double>() < 1 ||
      v.get<double>() != std::floor(v.get<double>())) {
    fail(where, "'" + field + "' is " + v.dump() + ": a LoRA rank must be an integer >= 1");
  }
  return static_cast<int64_t>(v.get<double>());
}

double alpha_value(const Json& v, const std::string& where, const std::string& field) {
  if (!v.is_number() || !std::isfinite(v.get<double>())) {
    fail(where, "'" + field + "' is " + v.dump() + ": lora_alpha must be a finite number");
  }
  return v.get<double>();
}

LoraAdapterConfig from_object(const Json& j, const std::string& where) {
  LoraAdapterConfig c;
  if (j.contains("r") && !j["r"].is_null()) c.r = rank_value(j["r"], where, "r");
  if (j.contains("lora_alpha") && !j["lora_alpha"].is_null()) {
    c.lora_alpha = alpha_value(j["lora_alpha"], where, "lora_alpha");
  }
  if (j.contains("use_rslora") && j["use_rslora"].is_boolean()) c.use_rslora = j["use_rslora"];
  if (j.contains("target_modules")) {
    const Json& t = j["target_modules"];
    if (t.is_string()) c.target_modules.push_back(t.get<std::string>());
    if (t.is_array()) {
      for (const auto& m : t)
        if (m.is_string()) c.target_modules.push_back(m.get<std::string>());
    }
  }
  for (const char* field : {"rank_pattern", "alpha_pattern"}) {
    if (!j.contains(field) || j[field].is_null()) continue;
    if (!j[field].is_object()) {
      fail(where, std::string("'") + field + "' is " + j[field].dump() +
                      ": it must be an object of module pattern -> number");
    }
    for (const auto& [key, value] : j[field].items()) {
      const std::string name = std::string(field) + "." + key;
      if (std::string(field) == "rank_pattern") {
        c.rank_pattern.emplace_back(key, rank_value(value, where, name));
      } else {
        c.alpha_pattern.emplace_back(key, alpha_value(value, where, name));
      }
    }
  }
  return c;
}

Json parse_object(const std::string& text, const std::string& where) {
  Json j;
  try {
    j = Json::parse(text);
  } catch (const Json::exception& e) {
    fail(where, std::string("is not valid JSON (") + e.what() +
                    "); expected a LoraConfig object such as {\"r\": 4, \"lora_alpha\": 8}");
  }
  if (!j.is_object()) {
    fail(where, "is " + std::string(j.type_name()) +
                    ", not a JSON object; expected a LoraConfig object such as {\"r\": 4, "
                    "\"lora_alpha\": 8}");
  }
  return j;
}

// The config as PEFT's LoraConfig.to_dict() names its fields (the subset difftrain sets).
Json to_object(const LoraAdapterConfig& c) {
  nlohmann::json rank = nlohmann::json::object(), alpha = nlohmann::json::object();
  for (const auto& [k, v] : c.rank_pattern) rank[k] = v;
  for (const auto& [k, v] : c.alpha_pattern) alpha[k] = v;
  Json j;
  j["alpha_pattern"] = alpha;
  j["lora_alpha"] = c.lora_alpha;
  j["r"] = c.r;
  j["rank_pattern"] = rank;
  j["target_modules"] = c.target_modules;
  j["use_rslora"] = c.use_rslora;
  return j;
}

}  // namespace

int64_t LoraAdapterConfig::rank_for(const std::string& module) const {
  for (const auto& [key, value] : rank_pattern)
    if (pattern_matches(key, module)) return value;
  return r;
}

double LoraAdapterConfig::alpha_for(const std::string& module) const {
  for (const auto& [key, value] : alpha_pattern)
    if (pattern_matches(key, module)) return value;
  return lora_alpha;
}

double LoraAdapterConfig::target_alpha(const std::string& module) const {
  const double alpha = alpha_for(module);
  return use_rslora ? alpha * std::sqrt(static_cast<double>(rank_for(module))) : alpha;
}

LoraAdapterConfig parse_lora_adapter_config(const std::string& json_text,
                                            const std::string& where) {
  return from_object(parse_object(json_text, where), where);
}

std::map<std::string, LoraAdapterConfig> parse_lora_adapter_metadata(const std::string& json_text,
                                                                     const std::string& where) {
  const Json j = parse_object(json_text, where);
  std::map<std::string, Json> split;
  for (const auto& [key, value] : j.items()) {
    for (const auto& c : lora_components()) {
      const std::string head = c + ".";
      if (key.size() > head.size() && key.compare(0, head.size(), head) == 0) {
        split[c][key.substr(head.size())] = value;
      }
    }
  }
  std::map<std::string, LoraAdapterConfig> out;
  if (split.empty()) {
    out[""] = from_object(j, where);
    return out;
  }
  for (const auto& [component, object] : split) {
    out[component] = from_object(object, where + " (" + component + ")");
  }
  return out;
}

LoraAdapterConfig make_lora_adapter_config(const std::vector<LoraTarget>& targets) {
  auto alpha_of = [](const LoraTarget& t) {
    return t.alpha && *t.alpha != 0.0 ? *t.alpha : static_cast<double>(t.rank());
  };
  std::map<int64_t, int> ranks;
  std::map<double, int> alphas;
  for (const auto& t : targets) {
    ++ranks[t.rank()];
    ++alphas[alpha_of(t)];
  }
  LoraAdapterConfig c;
  // Most common; std::map order makes ties go to the smaller value.
  auto most = [](const auto& counts, auto fallback) {
    auto best = fallback;
    int n = 0;
    for (const auto& [value, count] : counts) {
      if (count > n) best = value, n = count;
    }
    return best;
  };
  c.r = most(ranks, c.r);
  c.lora_alpha = most(alphas, c.lora_alpha);
  for (const auto& t : targets) {
    c.target_modules.push_back(t.module);
    if (t.rank() != c.r) c.rank_pattern.emplace_back(t.module, t.rank());
    if (alpha_of(t) != c.lora_alpha) c.alpha_pattern.emplace_back(t.module, alpha_of(t));
  }
  std::sort(c.target_modules.begin(), c.target_modules.end());
  c.target_modules.erase(std::unique(c.target_modules.begin(), c.target_modules.end()),
                         c.target_modules.end());
  return c;
}

std::string lora_adapter_config_json(const LoraAdapterConfig& config) {
  Json j = to_object(config);
  // The fields PEFT needs to rebuild the adapter (PeftConfig.from_pretrained reads peft_type).
  Json out;
  out["alpha_pattern"] = j["alpha_pattern"];
  out["base_model_name_or_path"] = nullptr;
  out["bias"] = "none";
  out["inference_mode"] = true;
  out["init_lora_weights"] = true;
  out["lora_alpha"] = j["lora_alpha"];
  out["lora_dropout"] = 0.0;
  out["peft_type"] = "LORA";
  out["r"] = j["r"];
  out["rank_pattern"] = j["rank_pattern"];
  out["target_modules"] = j["target_modules"];
  out["task_type"] = nullptr;
  out["use_dora"] = false;
  out["use_rslora"] = j["use_rslora"];
  return out.dump(2) + "\n";
}

std::string lora_adapter_metadata_json(const std::map<std::string, LoraAdapterConfig>& configs) {
  nlohmann::json out = nlohmann::json::object();  // sorted keys, as sort_keys=True
  for (const auto& [component, config] : configs) {
    const Json object = to_object(config);
    for (const auto& [field, value] : object.items()) {
      out[component.empty() ? field : component + "." + field] = value;
    }
  }
  return out.dump(2);
}

}  // namespace difftrain::io
