#include "difftrain/train/train_config.h"

#include "option_text.h"
#include "other_tools_options.h"

#include "difftrain/accel/sharding.h"
#include "difftrain/core/error.h"
#include "difftrain/diffusion/sampler.h"
#include "difftrain/diffusion/scheduler_config.h"
#include "difftrain/models/kernels/quantized_weight.h"
#include "difftrain/settings/config_merge.h"
#include "difftrain/settings/sharding_config.h"
#include "difftrain/train/text_image_options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <map>
#include <set>
#include <sstream>

namespace difftrain::train {
namespace {

using option_text::bad;
using option_text::is_null;
using option_text::Raw;
using option_text::to_bool;
using option_text::to_double;
using option_text::to_int;
using option_text::to_list;

struct Option {
  std::string name;
  std::string type;  // bool, int, float, string, list; "?" suffix: may be null
  std::function<void(TrainConfig&, const Raw&)> set;
  std::function<nlohmann::json(const TrainConfig&)> get;
};

template <typename T>
Option make(const char* name, T TrainConfig::*member);

template <>
Option make(const char* name, std::string TrainConfig::*m) {
  return {name, "string", [m](TrainConfig& c, const Raw& r) { c.*m = r.text; },
          [m](const TrainConfig& c) { return nlohmann::json(c.*m); }};
}
template <>
Option make(const char* name, int64_t TrainConfig::*m) {
  return {name, "int", [m](TrainConfig& c, const Raw& r) { c.*m = to_int(r); },
          [m](const TrainConfig& c) { return nlohmann::json(c.*m); }};
}
template <>
Option make(const char* name, uint64_t TrainConfig::*m) {
  return {name, "int",
          [m](TrainConfig& c, const Raw& r) {
            const int64_t v = to_int(r);
            if (v < 0) bad(r, "a non-negative integer");
            c.*m = static_cast<uint64_t>(v);
          },
          [m](const TrainConfig& c) { return nlohmann::json(c.*m); }};
}
template <>
Option make(const char* name, double TrainConfig::*m) {
  return {name, "float", [m](TrainConfig& c, const Raw& r) { c.*m = to_double(r); },
          [m](const TrainConfig& c) { return nlohmann::json(c.*m); }};
}
template <>
Option make(const char* name, bool TrainConfig::*m) {
  return {name, "bool", [m](TrainConfig& c, const Raw& r) { c.*m = to_bool(r); },
          [m](const TrainConfig& c) { return nlohmann::json(c.*m); }};
}
template <>
Option make(const char* name, std::optional<int64_t> TrainConfig::*m) {
  return {name, "int?",
          [m](TrainConfig& c, const Raw& r) {
            c.*m = is_null(r) ? std::nullopt : std::optional<int64_t>(to_int(r));
          },
          [m](const TrainConfig& c) { return c.*m ? nlohmann::json(*(c.*m)) : nlohmann::json(); }};
}
template <>
Option make(const char* name, std::optional<double> TrainConfig::*m) {
  return {name, "float?",
          [m](TrainConfig& c, const Raw& r) {
            c.*m = is_null(r) ? std::nullopt : std::optional<double>(to_double(r));
          },
          [m](const TrainConfig& c) { return c.*m ? nlohmann::json(*(c.*m)) : nlohmann::json(); }};
}
template <>
Option make(const char* name, std::vector<std::string> TrainConfig::*m) {
  return {name, "list", [m](TrainConfig& c, const Raw& r) { c.*m = to_list(r); },
          [m](const TrainConfig& c) { return nlohmann::json(c.*m); }};
}

#define DT_OPTION(name) make(#name, &TrainConfig::name)

// --resolution N, or kohya's --resolution W,H (also WxH): a W x H crop, square when W == H.
Option resolution_option() {
  return {"resolution", "int",
          [](TrainConfig& c, const Raw& r) {
            const auto sep = r.text.find_first_of(",xX");
            c.resolution_width = c.resolution_height = 0;
            if (sep == std::string::npos) {
              c.resolution = to_int(r);
              return;
            }
            const int64_t w = to_int(Raw{r.text.substr(0, sep), r.where});
            const int64_t h = to_int(Raw{r.text.substr(sep + 1), r.where});
            if (w < 8 || h < 8) bad(r, "N or W,H (kohya's width,height) with sides >= 8");
            c.resolution = std::max(w, h);
            if (w != h) c.resolution_width = w, c.resolution_height = h;
          },
          [](const TrainConfig& c) {
            if (c.resolution_width > 0) {
              return nlohmann::json(std::to_string(c.resolution_width) + "," +
                                    std::to_string(c.resolution_height));
            }
            return nlohmann::json(c.resolution);
          }};
}

const std::vector<Option>& options() {
  static const std::vector<Option> table = {
      DT_OPTION(model_config_name_or_path),
      DT_OPTION(pretrained_model_name_or_path),
      DT_OPTION(variant),
      DT_OPTION(pretrained_vae_model_name_or_path),
      DT_OPTION(dataset),
      DT_OPTION(train_data_dir),
      resolution_option(),
      DT_OPTION(center_crop),
      DT_OPTION(resolution_buckets),
      DT_OPTION(bucket_step),
      DT_OPTION(bucket_min_side),
      DT_OPTION(bucket_max_side),
      DT_OPTION(random_flip),
      DT_OPTION(max_train_samples),
      DT_OPTION(dataset_repeats),
      DT_OPTION(skip_bad_images),
      DT_OPTION(dataloader_num_workers),
      DT_OPTION(train_batch_size),
      DT_OPTION(num_train_epochs),
      DT_OPTION(max_train_steps),
      DT_OPTION(gradient_accumulation_steps),
      DT_OPTION(gradient_checkpointing),
      DT_OPTION(learning_rate),
      DT_OPTION(scale_lr),
      DT_OPTION(lr_scheduler),
      DT_OPTION(lr_warmup_steps),
      DT_OPTION(lr_num_cycles),
      DT_OPTION(lr_power),
      DT_OPTION(optimizer),
      DT_OPTION(use_8bit_adam),
      DT_OPTION(prodigy_beta3),
      DT_OPTION(prodigy_decouple),
      DT_OPTION(prodigy_use_bias_correction),
      DT_OPTION(prodigy_safeguard_warmup),
      DT_OPTION(adam_beta1),
      DT_OPTION(adam_beta2),
      DT_OPTION(adam_weight_decay),
      DT_OPTION(adam_epsilon),
      DT_OPTION(max_grad_norm),
      DT_OPTION(mixed_precision),
      DT_OPTION(use_ema),
      DT_OPTION(ema_decay),
      DT_OPTION(ema_inv_gamma),
      DT_OPTION(ema_power),
      DT_OPTION(ema_max_decay),
      DT_OPTION(checkpointing_steps),
      DT_OPTION(checkpoints_total_limit),
      DT_OPTION(resume_from_checkpoint),
      DT_OPTION(save_every_n_epochs),
      DT_OPTION(save_last_n_epochs),
      DT_OPTION(validation_steps),
      DT_OPTION(validation_epochs),
      DT_OPTION(num_validation_images),
      DT_OPTION(final_validation),
      DT_OPTION(guidance_scale),
      DT_OPTION(validation_inference_steps),
      DT_OPTION(validation_scheduler),
      DT_OPTION(logging_steps),
      DT_OPTION(seed),
      DT_OPTION(output_dir),
      DT_OPTION(overwrite_output_dir),
      DT_OPTION(logging_dir),
      DT_OPTION(report_to),
      DT_OPTION(lora),
      DT_OPTION(rank),
      DT_OPTION(lora_alpha),
      DT_OPTION(lora_dropout),
      DT_OPTION(lora_target_modules),
      DT_OPTION(lora_format),
      DT_OPTION(lora_layers),
      DT_OPTION(cache_dir),
      DT_OPTION(base_weights_dtype),
      DT_OPTION(sharding_strategy),
      DT_OPTION(fsdp_auto_wrap_policy),
      DT_OPTION(fsdp_transformer_layer_cls_to_wrap),
      DT_OPTION(fsdp_min_num_params),
      DT_OPTION(fsdp_forward_prefetch),
      DT_OPTION(fsdp_backward_prefetch),
      DT_OPTION(sync_each_batch),
      DT_OPTION(offload_optimizer_device),
      DT_OPTION(offload_param_device),
      DT_OPTION(deepspeed_config),
      DT_OPTION(accelerate_config_file),
  };
  return table;
}

#undef DT_OPTION

size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diag = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      const size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] != b[j - 1] ? 1 : 0)});
      diag = up;
    }
  }
  return row[b.size()];
}

// What find() looks names up in: the trainer's options and those of the run's family.
struct OptionScope {
  std::vector<Option> all;  // options(), then the family's
  const FamilyOptionLookup* lookup = nullptr;
  std::string family;      // the run's family ("" = none)
  std::string pretrained;  // its --pretrained_model_name_or_path
};

// The family's options as Options that read and write TrainConfig::family.
std::vector<Option> family_options_as_options(const FamilyOptions& family) {
  std::vector<Option> out;
  for (const auto& spec : family.specs) {
    const std::string name = spec.name, type = spec.type;
    out.push_back({name, type,
                   [name, type](TrainConfig& c, const Raw& r) {
                     c.family.values[name] = parse_option_value(type, r.text, r.where);
                   },
                   [name](const TrainConfig& c) {
                     return c.family.values.contains(name) ? c.family.values.at(name)
                                                           : nlohmann::json();
                   }});
  }
  return out;
}

std::string canonical_name(const std::string& name) {
  std::string key = name;
  std::replace(key.begin(), key.end(), '-', '_');
  if (const auto alias = option_aliases().find(key); alias != option_aliases().end()) {
    key = alias->second;
  }
  return key;
}

const Option& find(const std::string& name, const std::string& where, const OptionScope& scope) {
  const std::string key = canonical_name(name);
  std::string hint;
  if (const auto other = foreign_options().find(key); other != foreign_options().end()) {
    hint = other->second;
  } else if (scope.lookup != nullptr && scope.lookup->other_tools_hint) {
    hint = scope.lookup->other_tools_hint(scope.family, key);
  }
  if (!hint.empty()) {
    // A leading '!' marks a sentence of its own; else the text names difftrain's option.
    throw Error(where + ": \"" + name + "\" is another tool's option (kohya sd-scripts, " +
                "SimpleTuner); " +
                (hint.rfind('!', 0) == 0 ? hint.substr(1) : "difftrain's is " + hint) +
                " (difftrain train --help lists them)");
  }
  const Option* best = nullptr;
  size_t best_d = 1000;
  for (const auto& o : scope.all) {
    if (o.name == key) return o;
    const size_t d = edit_distance(key, o.name);
    if (d < best_d) best_d = d, best = &o;
  }
  if (scope.lookup != nullptr && scope.lookup->owner_of) {
    const std::vector<std::string> owners = scope.lookup->owner_of(key);
    if (!owners.empty()) {
      std::string instead;
      if (scope.lookup->instead_of) instead = scope.lookup->instead_of(scope.family, key);
      throw Error(fmt::format(
          "{}: \"{}\" is an option of the {} famil{}; this run trains {} ({}), which does not "
          "take it{} (difftrain train --help --family {} lists that family's options)",
          where, name, fmt::join(owners, ", "), owners.size() > 1 ? "ies" : "y",
          scope.family.empty() ? std::string("a model") : "the " + scope.family + " family",
          scope.pretrained.empty() ? std::string("no --pretrained_model_name_or_path")
                                   : scope.pretrained,
          instead.empty() ? std::string() : "; " + instead, owners.front()));
    }
  }
  const std::string mean =
      best != nullptr && best_d <= 4 ? "; did you mean " + best->name + "?" : "";
  throw Error(where + ": unknown option \"" + name + "\"" + mean +
              " (difftrain train --help lists them)");
}

std::string scalar_text(const YAML::Node& node, const std::string& where) {
  if (node.IsNull()) return "null";
  if (node.IsScalar()) return node.Scalar();
  if (node.IsSequence()) {
    std::string out;
    for (const auto& item : node) {
      if (!item.IsScalar()) throw Error(where + " must be a list of plain values");
      out += (out.empty() ? "" : ",") + item.Scalar();
    }
    return out;
  }
  throw Error(where + " must be a single value or a list, not a mapping");
}

void apply_yaml(TrainConfig& config, const std::string& path, std::set<std::string>& given,
                const OptionScope& scope) {
  if (!std::filesystem::is_regular_file(path)) {
    throw Error("--config " + path + ": no such file; pass a YAML file of train options");
  }
  YAML::Node root;
  try {
    root = YAML::LoadFile(path);
  } catch (const YAML::Exception& e) {
    throw Error(path + ": not valid YAML (" + e.what() + ")");
  }
  if (root.IsNull()) return;
  if (!root.IsMap()) throw Error(path + ": expected a mapping of option names to values");
  for (const auto& item : root) {
    if (!item.first.IsScalar()) {
      throw Error(path + ": line " + std::to_string(item.first.Mark().line + 1) +
                  ": a key must be an option name such as learning_rate, not a list or mapping");
    }
    const std::string name = item.first.Scalar();
    if (name == "config") throw Error(path + ": \"config\" cannot be nested in a config file");
    const std::string where = path + ": " + name;
    const Option& option = find(name, path, scope);
    option.set(config, Raw{scalar_text(item.second, where), where});
    given.insert(option.name);
  }
}

// An option a DeepSpeed / Accelerate file may fill, under settings::external_config_layer()'s name.
struct ExternalField {
  const char* name;
  std::function<nlohmann::json(const TrainConfig&)> get;
  std::function<void(TrainConfig&, const nlohmann::json&)> set;
};

template <typename T>
ExternalField external_field(const char* name, T TrainConfig::*m) {
  return {name, [m](const TrainConfig& c) { return nlohmann::json(c.*m); },
          [m](TrainConfig& c, const nlohmann::json& v) { c.*m = v.get<T>(); }};
}

const std::vector<ExternalField>& external_fields() {
  static const std::vector<ExternalField> fields = {
      external_field("sharding_strategy", &TrainConfig::sharding_strategy),
      external_field("fsdp_auto_wrap_policy", &TrainConfig::fsdp_auto_wrap_policy),
      external_field("fsdp_transformer_layer_cls_to_wrap",
                     &TrainConfig::fsdp_transformer_layer_cls_to_wrap),
      external_field("fsdp_min_num_params", &TrainConfig::fsdp_min_num_params),
      external_field("fsdp_forward_prefetch", &TrainConfig::fsdp_forward_prefetch),
      external_field("fsdp_backward_prefetch", &TrainConfig::fsdp_backward_prefetch),
      external_field("offload_optimizer_device", &TrainConfig::offload_optimizer_device),
      external_field("offload_param_device", &TrainConfig::offload_param_device),
      external_field("mixed_precision", &TrainConfig::mixed_precision),
      external_field("gradient_accumulation_steps", &TrainConfig::gradient_accumulation_steps),
      external_field("max_grad_norm", &TrainConfig::max_grad_norm),
      external_field("train_batch_size", &TrainConfig::train_batch_size),
  };
  return fields;
}

// The configs users already have, an Accelerate file then a DeepSpeed file (more specific, so
// it wins), under the options set explicitly (`given`: the YAML and the flags), by the one merge
// (settings::merge_settings(): config files <- flags): a file fills what was not given; an explicit
// option that differs from a value the file states wins, with a warning. The environment the
// launcher sets (DIFFTRAIN_MIXED_PRECISION, DIFFTRAIN_SHARDING_STRATEGY, ...) is read later by the
// Accelerator, for what this leaves unset.
void apply_external(TrainConfig& c, const std::set<std::string>& given) {
  std::vector<std::pair<std::string, settings::ExternalTrainingConfig>> files;
  auto add = [&](const std::string& path, settings::ExternalTrainingConfig ext) {
    if (ext.sharding_set && given.count("sharding_strategy")) {
      // Compare canonical names, so "zero3" and FULL_SHARD agree.
      c.sharding_strategy = accel::to_string(
          accel::parse_sharding_strategy(c.sharding_strategy, "--sharding_strategy"));
    }
    files.emplace_back(path, std::move(ext));
  };
  if (!c.accelerate_config_file.empty()) {
    add(c.accelerate_config_file, settings::read_accelerate_config(c.accelerate_config_file));
  }
  if (!c.deepspeed_config.empty()) {
    add(c.deepspeed_config, settings::read_deepspeed_config(c.deepspeed_config));
  }
  if (files.empty()) return;
  std::vector<settings::SettingLayer> layers;
  for (const auto& [path, ext] : files)
    layers.push_back(settings::external_config_layer(ext, path));
  settings::SettingLayer explicit_options;
  explicit_options.source = settings::SettingSource::kFlag;
  explicit_options.origin = "flags";
  for (const auto& f : external_fields()) {
    if (given.count(f.name)) explicit_options.set(f.name, f.get(c));
  }
  layers.push_back(std::move(explicit_options));
  const settings::MergedSettings merged = settings::merge_settings(layers);
  for (size_t i = 0; i < files.size(); ++i) {
    const auto& [path, ext] = files[i];
    c.warnings.insert(c.warnings.end(), ext.warnings.begin(), ext.warnings.end());
    for (const auto& o : merged.overrides) {
      if (o.layer != i) continue;
      c.warnings.push_back(fmt::format("--{}={} (set explicitly) wins over {} from {}", o.name,
                                       o.value.dump(), o.overridden.dump(), path));
    }
  }
  for (const auto& f : external_fields()) {
    const settings::MergedSetting* s = merged.find(f.name);
    if (s != nullptr && s->source == settings::SettingSource::kConfigFile) {
      f.set(c, s->value);
      c.given.insert(f.name);
    }
  }
}

// --pretrained_model_name_or_path as the YAML files and then the flags give it (the last wins).
std::string pretrained_model_of(const std::vector<std::string>& args,
                                const std::vector<std::string>& yaml_files) {
  const std::string key = "pretrained_model_name_or_path";
  std::string found;
  for (const auto& path : yaml_files) {
    try {
      const YAML::Node root = YAML::LoadFile(path);
      if (!root.IsMap()) continue;
      for (const auto& item : root) {
        if (item.first.IsScalar() && canonical_name(item.first.Scalar()) == key &&
            item.second.IsScalar()) {
          found = item.second.Scalar();
        }
      }
    } catch (const std::exception&) {
      // apply_yaml() reports a missing or malformed file in its own words.
    }
  }
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i].rfind("--", 0) != 0) continue;
    std::string name = args[i].substr(2);
    const auto eq = name.find('=');
    const std::string value = eq != std::string::npos ? name.substr(eq + 1)
                              : i + 1 < args.size()   ? args[i + 1]
                                                      : std::string();
    if (eq != std::string::npos) name = name.substr(0, eq);
    if (canonical_name(name) == key) found = value;
  }
  return found;
}

}  // namespace

nlohmann::json TrainConfig::to_json() const {
  nlohmann::json out = nlohmann::json::object();
  for (const auto& o : options()) out[o.name] = o.get(*this);
  for (const auto& [name, value] : family.values.items()) out[name] = value;
  return out;
}

nlohmann::json TrainConfig::shown_json() const {
  nlohmann::json out = to_json();
  for (const auto& name : not_applicable) out.erase(name);
  return out;
}

std::vector<std::vector<std::string>> train_option_table() {
  std::vector<std::vector<std::string>> rows;
  const TrainConfig defaults;
  for (const auto& o : options()) rows.push_back({o.name, o.type, o.get(defaults).dump()});
  return rows;
}

std::vector<std::vector<std::string>> family_option_table(const std::vector<OptionSpec>& specs) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& s : specs) rows.push_back({s.name, s.type, s.default_value.dump(), s.help});
  return rows;
}

void TrainConfig::validate() const {
  auto require = [](bool ok, const std::string& message) {
    if (!ok) throw Error(message);
  };
  auto one_of = [](const std::string& name, const std::string& value,
                   std::vector<std::string> allowed) {
    one_of_check(std::move(allowed))(value, "--" + name);  // the family options' check too
  };
  one_of("dataset", dataset, {"fashion_mnist", "mnist", "imagefolder"});
  if (!mixed_precision.empty()) one_of("mixed_precision", mixed_precision, {"no", "bf16", "fp16"});
  one_of("lora_format", lora_format, {"diffusers", "peft", "kohya", "comfyui"});
  accel::parse_sharding_strategy(sharding_strategy, "--sharding_strategy");
  settings::parse_offload_device(offload_optimizer_device, "--offload_optimizer_device");
  settings::parse_offload_device(offload_param_device, "--offload_param_device");
  one_of("fsdp_auto_wrap_policy", fsdp_auto_wrap_policy,
         {"TRANSFORMER_BASED_WRAP", "SIZE_BASED_WRAP", "NO_WRAP"});
  require(fsdp_min_num_params >= 1, "--fsdp_min_num_params must be at least 1");
  require(resolution >= 8, "--resolution must be at least 8");
  require(train_batch_size >= 1, "--train_batch_size must be at least 1 (it is per process), got " +
                                     std::to_string(train_batch_size));
  require(num_train_epochs >= 1, "--num_train_epochs must be at least 1");
  require(max_train_steps >= 0, "--max_train_steps must be >= 0 (0: num_train_epochs decides)");
  require(gradient_accumulation_steps >= 1,
          "--gradient_accumulation_steps must be at least 1, got " +
              std::to_string(gradient_accumulation_steps));
  require(learning_rate > 0, "--learning_rate must be positive");
  require(lr_warmup_steps >= 0, "--lr_warmup_steps must be >= 0");
  require(adam_beta1 >= 0 && adam_beta1 < 1 && adam_beta2 >= 0 && adam_beta2 < 1,
          "--adam_beta1 and --adam_beta2 must be in [0, 1)");
  require(adam_epsilon > 0, "--adam_epsilon must be positive");
  {
    std::string opt = optimizer;
    for (auto& ch : opt) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
    require(opt == "adamw" || opt == "prodigy",
            "--optimizer " + optimizer +
                ": unknown; use adamw (with --use_8bit_adam for 8-bit) or "
                "prodigy");
    require(!(opt == "prodigy" && use_8bit_adam),
            "--use_8bit_adam applies to AdamW; Prodigy has no 8-bit form (drop one of them)");
  }
  require(!prodigy_beta3 || (*prodigy_beta3 >= 0 && *prodigy_beta3 < 1),
          "--prodigy_beta3 must be in [0, 1)");
  require(adam_weight_decay >= 0, "--adam_weight_decay must be >= 0");
  require(max_grad_norm >= 0, "--max_grad_norm must be >= 0 (0 disables clipping)");
  require(ema_max_decay > 0 && ema_max_decay < 1, "--ema_max_decay must be in (0, 1)");
  require(!ema_decay || (*ema_decay > 0 && *ema_decay < 1), "--ema_decay must be in (0, 1)");
  require(ema_inv_gamma > 0 && ema_power > 0, "--ema_inv_gamma and --ema_power must be positive");
  require(checkpointing_steps >= 0, "--checkpointing_steps must be >= 0 (0: only at the end)");
  require(!checkpoints_total_limit || *checkpoints_total_limit >= 1,
          "--checkpoints_total_limit must be at least 1");
  require(validation_steps >= 0, "--validation_steps must be >= 0 (0: only at the end)");
  for (const auto& [name, value] : {std::pair{"save_every_n_epochs", save_every_n_epochs},
                                    std::pair{"save_last_n_epochs", save_last_n_epochs},
                                    std::pair{"validation_epochs", validation_epochs}}) {
    require(!value || *value >= 1, fmt::format("--{} must be at least 1, got {} (leave it out, or "
                                               "null, for none)",
                                               name, value.value_or(0)));
  }
  require(!save_last_n_epochs || save_every_n_epochs,
          "--save_last_n_epochs keeps the newest epoch saves, and this run makes none: add "
          "--save_every_n_epochs N (or use --checkpoints_total_limit for checkpoint-<step> "
          "folders)");
  require(!overwrite_output_dir || resume_from_checkpoint.empty(),
          "--overwrite_output_dir clears the folder that --resume_from_checkpoint would continue; "
          "pass one of them");
  require(num_validation_images >= 0, "--num_validation_images must be >= 0");
  require(final_validation == "auto" || final_validation == "always" || final_validation == "never",
          "--final_validation must be auto, always or never, got '" + final_validation + "'");
  require(validation_inference_steps >= 1, "--validation_inference_steps must be at least 1");
  if (!validation_scheduler.empty()) {
    // Built once from a default config, so a typo fails before training, not at the first
    // validation.
    try {
      (void)diffusion::make_sampler(diffusion::SchedulerConfig{}.to_json(), validation_scheduler,
                                    "--validation_scheduler");
    } catch (const Error& e) {
      throw Error(std::string("--validation_scheduler: ") + e.what());
    }
  }
  require(!guidance_scale || *guidance_scale >= 1, "--guidance_scale must be >= 1");
  one_of("base_weights_dtype", base_weights_dtype, {"none", "int8", "fp8_e4m3"});
  (void)models::parse_weight_storage(base_weights_dtype, "--base_weights_dtype");
  require(base_weights_dtype == "none" || lora,
          "--base_weights_dtype stores a LoRA run's frozen base in 8 bits; add --lora (full "
          "fine-tuning trains those weights)");
  require(logging_steps >= 1, "--logging_steps must be at least 1");
  require(dataloader_num_workers >= 0, "--dataloader_num_workers must be >= 0");
  require(max_train_samples >= 0, "--max_train_samples must be >= 0 (0: all)");
  require(dataset_repeats >= 1,
          "--dataset_repeats must be at least 1 (each image used that many times per epoch), "
          "got " +
              std::to_string(dataset_repeats));
  require(report_to == "all" || report_to == "none" || report_to == "tensorboard" ||
              report_to == "jsonl" || report_to == "tensorboard,jsonl" ||
              report_to == "jsonl,tensorboard",
          "--report_to is \"" + report_to + "\": expected tensorboard, jsonl, all or none");
  require(!(model_config_name_or_path.size() && pretrained_model_name_or_path.size()),
          "give --model_config_name_or_path (a fresh model) or --pretrained_model_name_or_path "
          "(start from weights), not both");
  if (lora) {
    require(!pretrained_model_name_or_path.empty(),
            "--lora fine-tunes a pretrained model: pass --pretrained_model_name_or_path DIR");
    require(rank >= 1, "--rank must be at least 1");
    require(!lora_alpha || *lora_alpha > 0, "--lora_alpha must be positive");
    require(lora_dropout >= 0 && lora_dropout < 1, "--lora_dropout must be in [0, 1)");
  }
  require(bucket_step >= 1, "--bucket_step must be >= 1, got " + std::to_string(bucket_step));
  require(bucket_min_side >= 0 && bucket_max_side >= 0,
          "--bucket_min_side and --bucket_max_side must be >= 0 (0 = resolution / 2 and 2 x "
          "resolution)");
  check_text_image_options(*this);  // the text-to-image families' group, where declared
  require(dataset != "imagefolder" || !train_data_dir.empty(),
          "--dataset imagefolder needs --train_data_dir (a folder of images)");
}

accel::ShardingOptions TrainConfig::sharding_options() const {
  accel::ShardingOptions o;
  o.strategy = accel::parse_sharding_strategy(sharding_strategy, "--sharding_strategy");
  o.auto_wrap.policy = fsdp_auto_wrap_policy;
  if (!fsdp_transformer_layer_cls_to_wrap.empty()) {
    o.auto_wrap.classes =
        to_list(Raw{fsdp_transformer_layer_cls_to_wrap, "--fsdp_transformer_layer_cls_to_wrap"});
  }
  o.auto_wrap.min_num_params = fsdp_min_num_params;
  o.forward_prefetch = fsdp_forward_prefetch;
  o.backward_prefetch = fsdp_backward_prefetch;
  o.sync_each_batch = sync_each_batch;
  o.offload_optimizer =
      settings::parse_offload_device(offload_optimizer_device, "--offload_optimizer_device");
  o.offload_params = settings::parse_offload_device(offload_param_device, "--offload_param_device");
  return o;
}

TrainConfig parse_train_config(const std::vector<std::string>& args,
                               const FamilyOptionLookup& lookup) {
  TrainConfig config;
  std::set<std::string> given;  // options set by the YAML or a flag
  std::vector<std::string> yaml_files;
  for (size_t i = 0; i < args.size(); ++i) {
    if (args[i] == "--config") {
      if (i + 1 >= args.size()) throw Error("--config needs a YAML file");
      yaml_files.push_back(args[i + 1]);
    } else if (args[i].rfind("--config=", 0) == 0) {
      yaml_files.push_back(args[i].substr(9));
    }
  }
  // The family's options need the model first: its folder from the YAML files and the flags (the
  // last one given wins, as below), before any other option is read.
  OptionScope scope;
  scope.all = options();
  scope.lookup = &lookup;
  if (lookup.options_for) {
    scope.pretrained = pretrained_model_of(args, yaml_files);
    config.family = lookup.options_for(scope.pretrained);
    scope.family = config.family.family;
    const auto extra = family_options_as_options(config.family);
    scope.all.insert(scope.all.end(), extra.begin(), extra.end());
  }
  // The YAML file first, wherever --config appears, so flags always win.
  for (const auto& path : yaml_files) apply_yaml(config, path, given, scope);
  for (size_t i = 0; i < args.size(); ++i) {
    const std::string& arg = args[i];
    if (arg.rfind("--", 0) != 0 || arg.size() == 2) {
      throw Error("unexpected argument \"" + arg + "\": options are --name value (see --help)");
    }
    std::string name = arg.substr(2);
    std::optional<std::string> value;
    if (const auto eq = name.find('='); eq != std::string::npos) {
      value = name.substr(eq + 1);
      name = name.substr(0, eq);
    }
    if (name == "config") {
      if (!value) ++i;
      continue;
    }
    const Option option = find(name, "--" + name, scope);
    if (!value) {
      const bool next_is_value = i + 1 < args.size() && args[i + 1].rfind("--", 0) != 0;
      if (option.type.rfind("bool", 0) == 0 && !next_is_value) {
        value = "true";  // store_true style
      } else if (!next_is_value) {
        throw Error("--" + name + " needs a value (" + option.type + ")");
      } else {
        value = args[++i];
      }
    }
    option.set(config, Raw{*value, "--" + option.name});
    given.insert(option.name);
  }
  // The resolved configuration is logged and saved as JSON, which must be UTF-8: a value that is
  // not is refused here, naming the option, instead of failing later inside the JSON writer.
  for (const auto& o : scope.all) {
    try {
      (void)o.get(config).dump();
    } catch (const nlohmann::json::type_error&) {
      throw Error("--" + o.name + ": the value is not valid UTF-8; write the config file and the " +
                  "flags as UTF-8");
    }
  }
  // Configs users already have: an Accelerate file, then a DeepSpeed file (more specific).
  config.given = given;  // apply_external() adds what the files set
  apply_external(config, given);
  config.sharding_strategy = accel::to_string(
      accel::parse_sharding_strategy(config.sharding_strategy, "--sharding_strategy"));
  std::transform(config.fsdp_auto_wrap_policy.begin(), config.fsdp_auto_wrap_policy.end(),
                 config.fsdp_auto_wrap_policy.begin(),
                 [](unsigned char ch) { return static_cast<char>(std::toupper(ch)); });
  if (config.ema_decay) config.ema_max_decay = *config.ema_decay;
  // kohya: --resolution W,H with buckets is the buckets' area, W x H pixels.
  if (config.resolution_width > 0 && config.resolution_buckets) {
    config.resolution = static_cast<int64_t>(
        std::llround(std::sqrt(static_cast<double>(config.resolution_width) *
                               static_cast<double>(config.resolution_height))));
    config.resolution_width = config.resolution_height = 0;
  }
  // As Diffusers' scripts: the epochs decide the length unless --max_train_steps is given. The
  // default 1200 updates stand only when neither is given (the built-in default job).
  if (given.count("num_train_epochs") && !given.count("max_train_steps")) {
    config.max_train_steps = 0;
  }
  // An epoch cadence given alone replaces the step cadence's default (kohya's and Diffusers'
  // scripts have one or the other); given both, both apply.
  if (config.save_every_n_epochs && !config.given.count("checkpointing_steps")) {
    config.checkpointing_steps = 0;
  }
  if (config.validation_epochs && !config.given.count("validation_steps")) {
    config.validation_steps = 0;
  }
  config.family.complete_and_check();
  config.validate();
  return config;
}

}  // namespace difftrain::train
