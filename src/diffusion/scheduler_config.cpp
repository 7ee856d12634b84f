#include "difftrain/diffusion/scheduler_config.h"

#include "config_json.h"
#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <cmath>
#include <cstddef>
#include <limits>
#include <optional>
#include <set>
#include <string>
#include <utility>

namespace difftrain::diffusion {

namespace detail {

std::string where_of(const std::string& source) {
  return source.empty() ? "scheduler config" : "scheduler config " + source;
}

std::string shown(const nlohmann::json& value) {
  std::string text = value.dump();
  if (text.size() > 60) text = text.substr(0, 57) + "...";
  return text + " (" + value.type_name() + ")";
}

std::optional<double> python_float_token(const nlohmann::json& value) {
  if (!value.is_string()) return std::nullopt;
  const std::string t = value.get<std::string>();
  if (t == "-Infinity") return -std::numeric_limits<double>::infinity();
  if (t == "Infinity") return std::numeric_limits<double>::infinity();
  if (t == "NaN") return std::numeric_limits<double>::quiet_NaN();
  return std::nullopt;
}

const std::set<std::string>& noise_scheduler_keys() {
  static const std::set<std::string> keys = {"num_train_timesteps",
                                             "beta_start",
                                             "beta_end",
                                             "beta_schedule",
                                             "trained_betas",
                                             "variance_type",
                                             "clip_sample",
                                             "clip_sample_range",
                                             "prediction_type",
                                             "thresholding",
                                             "dynamic_thresholding_ratio",
                                             "sample_max_value",
                                             "timestep_spacing",
                                             "steps_offset",
                                             "set_alpha_to_one",
                                             "rescale_betas_zero_snr"};
  return keys;
}

std::string read_config_text(const std::string& path) {
  try {
    return io::read_file(path);
  } catch (const Error& e) {
    throw Error(std::string("scheduler config: ") + e.what() +
                "; give the path of a scheduler_config.json (a model's scheduler/ folder)");
  }
}

}  // namespace detail

namespace {

using detail::python_float_token;
using detail::shown;
using detail::where_of;
using nlohmann::json;

// ------------------------------------------------------------------ enum names

template <typename E>
struct Named {
  E value;
  const char* name;
};

constexpr Named<BetaSchedule> kBetaSchedules[] = {
    {BetaSchedule::kLinear, "linear"},
    {BetaSchedule::kScaledLinear, "scaled_linear"},
    {BetaSchedule::kSquaredcosCapV2, "squaredcos_cap_v2"},
    {BetaSchedule::kSigmoid, "sigmoid"},
};
constexpr Named<PredictionType> kPredictionTypes[] = {
    {PredictionType::kEpsilon, "epsilon"},
    {PredictionType::kVPrediction, "v_prediction"},
    {PredictionType::kSample, "sample"},
};
constexpr Named<VarianceType> kVarianceTypes[] = {
    {VarianceType::kFixedSmall, "fixed_small"}, {VarianceType::kFixedSmallLog, "fixed_small_log"},
    {VarianceType::kFixedLarge, "fixed_large"}, {VarianceType::kFixedLargeLog, "fixed_large_log"},
    {VarianceType::kLearned, "learned"},        {VarianceType::kLearnedRange, "learned_range"},
};
constexpr Named<TimestepSpacing> kTimestepSpacings[] = {
    {TimestepSpacing::kLeading, "leading"},
    {TimestepSpacing::kTrailing, "trailing"},
    {TimestepSpacing::kLinspace, "linspace"},
};

template <typename E, size_t N>
std::string name_of(const Named<E> (&table)[N], E value) {
  for (const auto& entry : table) {
    if (entry.value == value) return entry.name;
  }
  throw Error("invalid enum value " + std::to_string(static_cast<int>(value)));
}

template <typename E, size_t N>
E parse_name(const Named<E> (&table)[N], const char* field, const std::string& name) {
  for (const auto& entry : table) {
    if (name == entry.name) return entry.value;
  }
  std::string supported;
  for (const auto& entry : table) {
    if (!supported.empty()) supported += ", ";
    supported += entry.name;
  }
  throw Error(std::string("unknown ") + field + " '" + name + "'; supported: " + supported);
}

// ------------------------------------------------------------------ JSON fields

[[noreturn]] void bad_type(const std::string& source, const std::string& key, const char* expected,
                           const json& value) {
  throw Error(where_of(source) + ": " + key + " must be " + expected + ", got " + shown(value) +
              "; fix the file");
}

int64_t read_int(const json& j, const std::string& key, const std::string& source) {
  const json& v = j.at(key);
  if (v.is_number_unsigned()) {
    if (v.get<uint64_t>() > static_cast<uint64_t>(std::numeric_limits<int64_t>::max())) {
      bad_type(source, key, "an integer that fits 64 bits", v);
    }
    return static_cast<int64_t>(v.get<uint64_t>());
  }
  if (!v.is_number_integer()) bad_type(source, key, "an integer", v);
  return v.get<int64_t>();
}

double read_double(const json& j, const std::string& key, const std::string& source) {
  const json& v = j.at(key);
  if (const auto token = python_float_token(v)) return *token;
  if (!v.is_number()) bad_type(source, key, "a number", v);
  return v.get<double>();
}

bool read_bool(const json& j, const std::string& key, const std::string& source) {
  const json& v = j.at(key);
  if (!v.is_boolean()) bad_type(source, key, "true or false", v);
  return v.get<bool>();
}

template <typename E, size_t N>
E read_enum(const json& j, const std::string& key, const std::string& source,
            const Named<E> (&table)[N]) {
  const json& v = j.at(key);
  if (!v.is_string()) bad_type(source, key, "a string", v);
  try {
    return parse_name(table, key.c_str(), v.get<std::string>());
  } catch (const Error& e) {
    throw Error(where_of(source) + ": " + e.what());
  }
}

std::string format_number(double value) {
  if (std::isnan(value)) return "NaN";
  if (std::isinf(value)) return value > 0 ? "Infinity" : "-Infinity";
  json j = value;
  return j.dump();
}

}  // namespace

// ------------------------------------------------------------------ Python's JSON

namespace {
constexpr const char* kPythonTokens[] = {"-Infinity", "Infinity", "NaN"};
}  // namespace

nlohmann::json parse_python_json(const std::string& text) {
  std::string out;
  out.reserve(text.size() + 16);
  bool in_string = false;
  for (size_t i = 0; i < text.size(); ++i) {
    const char c = text[i];
    if (in_string) {
      out += c;
      if (c == '\\' && i + 1 < text.size()) {
        out += text[++i];
      } else if (c == '"') {
        in_string = false;
      }
      continue;
    }
    if (c == '"') {
      in_string = true;
      out += c;
      continue;
    }
    bool replaced = false;
    for (const char* token : kPythonTokens) {
      const size_t n = std::char_traits<char>::length(token);
      if (text.compare(i, n, token) == 0) {
        out += '"';
        out += token;
        out += '"';
        i += n - 1;
        replaced = true;
        break;
      }
    }
    if (!replaced) out += c;
  }
  return json::parse(out);
}

std::string dump_python_json(const nlohmann::json& j, int indent) {
  std::string text = j.dump(indent);
  for (const char* token : kPythonTokens) {
    const std::string quoted = std::string("\"") + token + "\"";
    // Only values: a quoted token right after ": " (objects) or as a list element.
    for (const std::string& lead : {std::string(": "), std::string(":")}) {
      size_t at = 0;
      while ((at = text.find(lead + quoted, at)) != std::string::npos) {
        text.replace(at + lead.size(), quoted.size(), token);
        at += lead.size() + std::char_traits<char>::length(token);
      }
    }
  }
  return text;
}

// ------------------------------------------------------------------ names

std::string to_string(BetaSchedule value) { return name_of(kBetaSchedules, value); }
std::string to_string(PredictionType value) { return name_of(kPredictionTypes, value); }
std::string to_string(VarianceType value) { return name_of(kVarianceTypes, value); }
std::string to_string(TimestepSpacing value) { return name_of(kTimestepSpacings, value); }

BetaSchedule parse_beta_schedule(const std::string& name) {
  return parse_name(kBetaSchedules, "beta_schedule", name);
}
PredictionType parse_prediction_type(const std::string& name) {
  return parse_name(kPredictionTypes, "prediction_type", name);
}
VarianceType parse_variance_type(const std::string& name) {
  return parse_name(kVarianceTypes, "variance_type", name);
}
TimestepSpacing parse_timestep_spacing(const std::string& name) {
  return parse_name(kTimestepSpacings, "timestep_spacing", name);
}

// ------------------------------------------------------------------ SchedulerConfig

SchedulerConfig SchedulerConfig::from_json(const json& j, const std::string& source) {
  if (!j.is_object()) {
    throw Error(where_of(source) +
                ": expected a JSON object like {\"_class_name\": \"DDPMScheduler\", " +
                "\"num_train_timesteps\": 1000, ...}, got " + shown(j));
  }
  SchedulerConfig c;
  c.class_name.clear();
  if (j.contains("_class_name")) {
    const json& v = j.at("_class_name");
    if (!v.is_string()) bad_type(source, "_class_name", "a string", v);
    c.class_name = v.get<std::string>();
  }
  const auto has = [&](const char* key) { return j.contains(key); };
  if (has("num_train_timesteps")) {
    c.num_train_timesteps = read_int(j, "num_train_timesteps", source);
  }
  if (has("beta_start")) c.beta_start = read_double(j, "beta_start", source);
  if (has("beta_end")) c.beta_end = read_double(j, "beta_end", source);
  if (has("beta_schedule")) {
    c.beta_schedule = read_enum(j, "beta_schedule", source, kBetaSchedules);
  }
  if (has("trained_betas") && !j.at("trained_betas").is_null()) {
    const json& v = j.at("trained_betas");
    if (!v.is_array()) bad_type(source, "trained_betas", "a list of numbers or null", v);
    std::vector<double> betas;
    betas.reserve(v.size());
    for (size_t i = 0; i < v.size(); ++i) {
      if (!v[i].is_number()) {
        bad_type(source, "trained_betas[" + std::to_string(i) + "]", "a number", v[i]);
      }
      betas.push_back(v[i].get<double>());
    }
    c.trained_betas = std::move(betas);
  }
  if (has("variance_type")) {
    c.variance_type = read_enum(j, "variance_type", source, kVarianceTypes);
  }
  if (has("clip_sample")) c.clip_sample = read_bool(j, "clip_sample", source);
  if (has("clip_sample_range")) {
    c.clip_sample_range = read_double(j, "clip_sample_range", source);
  }
  if (has("prediction_type")) {
    c.prediction_type = read_enum(j, "prediction_type", source, kPredictionTypes);
  }
  if (has("thresholding")) c.thresholding = read_bool(j, "thresholding", source);
  if (has("dynamic_thresholding_ratio")) {
    c.dynamic_thresholding_ratio = read_double(j, "dynamic_thresholding_ratio", source);
  }
  if (has("sample_max_value")) c.sample_max_value = read_double(j, "sample_max_value", source);
  if (has("timestep_spacing")) {
    c.timestep_spacing = read_enum(j, "timestep_spacing", source, kTimestepSpacings);
  }
  if (has("steps_offset")) c.steps_offset = read_int(j, "steps_offset", source);
  if (has("set_alpha_to_one")) c.set_alpha_to_one = read_bool(j, "set_alpha_to_one", source);
  if (has("rescale_betas_zero_snr")) {
    c.rescale_betas_zero_snr = read_bool(j, "rescale_betas_zero_snr", source);
  }
  for (const auto& [key, value] : j.items()) {
    // Diffusers treats '_'-prefixed keys (_diffusers_version, _use_default_values, ...) as its own
    // bookkeeping, not as settings.
    if (key.empty() || key[0] == '_' || detail::noise_scheduler_keys().count(key) != 0) continue;
    c.extra[key] = value;
  }
  c.validate(source);
  return c;
}

SchedulerConfig SchedulerConfig::load(const std::string& path) {
  return parse(detail::read_config_text(path), path);
}

SchedulerConfig SchedulerConfig::parse(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = parse_python_json(json_text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    throw Error(where_of(source) + ": invalid JSON (" + e.what() +
                "); fix the file or re-create it");
  }
  return from_json(j, source);
}

json SchedulerConfig::to_json() const {
  json j = json::object();
  j["_class_name"] = class_name;
  j["_diffusers_version"] = "0.31.0";
  j["num_train_timesteps"] = num_train_timesteps;
  j["beta_start"] = beta_start;
  j["beta_end"] = beta_end;
  j["beta_schedule"] = to_string(beta_schedule);
  j["trained_betas"] = trained_betas ? json(*trained_betas) : json(nullptr);
  if (class_name != "DDIMScheduler") j["variance_type"] = to_string(variance_type);
  j["clip_sample"] = clip_sample;
  j["clip_sample_range"] = clip_sample_range;
  j["prediction_type"] = to_string(prediction_type);
  j["thresholding"] = thresholding;
  j["dynamic_thresholding_ratio"] = dynamic_thresholding_ratio;
  j["sample_max_value"] = sample_max_value;
  j["timestep_spacing"] = to_string(timestep_spacing);
  j["steps_offset"] = steps_offset;
  if (class_name != "DDPMScheduler") j["set_alpha_to_one"] = set_alpha_to_one;
  j["rescale_betas_zero_snr"] = rescale_betas_zero_snr;
  if (extra.is_object()) {
    for (const auto& [key, value] : extra.items()) {
      if (!j.contains(key)) j[key] = value;
    }
  }
  return j;
}

void SchedulerConfig::save(const std::string& path) const {
  io::write_file_atomic(path, dump_python_json(to_json(), 2) + "\n");
}

void SchedulerConfig::validate(const std::string& source) const {
  const std::string at = where_of(source) + ": ";
  if (num_train_timesteps < 1) {
    throw Error(at + "num_train_timesteps is " + std::to_string(num_train_timesteps) +
                "; it must be at least 1");
  }
  const auto check_beta = [&](const char* name, double beta) {
    if (!(beta >= 0 && beta < 1)) {
      throw Error(at + name + " is " + format_number(beta) + "; a beta must be in [0, 1)");
    }
  };
  if (trained_betas) {
    if (static_cast<int64_t>(trained_betas->size()) != num_train_timesteps) {
      throw Error(at + "trained_betas has " + std::to_string(trained_betas->size()) +
                  " values but num_train_timesteps is " + std::to_string(num_train_timesteps) +
                  "; give one beta per training timestep");
    }
    for (size_t i = 0; i < trained_betas->size(); ++i) {
      check_beta(("trained_betas[" + std::to_string(i) + "]").c_str(), (*trained_betas)[i]);
    }
  } else {
    check_beta("beta_start", beta_start);
    check_beta("beta_end", beta_end);
  }
  if (!(clip_sample_range > 0) || !std::isfinite(clip_sample_range)) {
    throw Error(at + "clip_sample_range is " + format_number(clip_sample_range) +
                "; it must be a finite number > 0");
  }
  if (!(dynamic_thresholding_ratio > 0 && dynamic_thresholding_ratio <= 1)) {
    throw Error(at + "dynamic_thresholding_ratio is " + format_number(dynamic_thresholding_ratio) +
                "; it is a quantile and must be in (0, 1] (Diffusers' default 0.995)");
  }
  if (!(sample_max_value > 0) || !std::isfinite(sample_max_value)) {
    throw Error(at + "sample_max_value is " + format_number(sample_max_value) +
                "; it must be a finite number > 0");
  }
  if (steps_offset < 0) {
    throw Error(at + "steps_offset is " + std::to_string(steps_offset) + "; it must be >= 0");
  }
}

bool SchedulerConfig::operator==(const SchedulerConfig& o) const {
  return class_name == o.class_name && num_train_timesteps == o.num_train_timesteps &&
         beta_start == o.beta_start && beta_end == o.beta_end && beta_schedule == o.beta_schedule &&
         trained_betas == o.trained_betas && variance_type == o.variance_type &&
         clip_sample == o.clip_sample && clip_sample_range == o.clip_sample_range &&
         prediction_type == o.prediction_type && thresholding == o.thresholding &&
         dynamic_thresholding_ratio == o.dynamic_thresholding_ratio &&
         sample_max_value == o.sample_max_value && timestep_spacing == o.timestep_spacing &&
         steps_offset == o.steps_offset && set_alpha_to_one == o.set_alpha_to_one &&
         rescale_betas_zero_snr == o.rescale_betas_zero_snr && extra == o.extra;
}

}  // namespace difftrain::diffusion
