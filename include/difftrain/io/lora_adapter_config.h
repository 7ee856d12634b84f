#pragma once
// The r and alpha of a LoRA kept beside its weights: PEFT's `adapter_config.json` (a LoraConfig
// dict) and Diffusers' (>= 0.33) safetensors metadata entry `lora_adapter_metadata` (the same
// dict as a JSON string, each key prefixed by its pipeline component, "unet.r", "unet.lora_alpha",
// ..., when written by a pipeline's save_lora_weights; unprefixed when written by a model's
// save_lora_adapter). read_lora() applies them; write_lora() writes them. See docs/LORA.md.

#include "difftrain/io/lora_format.h"

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::io {

/// The safetensors `__metadata__` entry Diffusers >= 0.33 stores the LoraConfig in
/// (diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY).
inline constexpr const char* kLoraAdapterMetadataKey = "lora_adapter_metadata";
/// PEFT's config file beside `adapter_model.safetensors` (peft.utils.CONFIG_NAME).
inline constexpr const char* kPeftAdapterConfigName = "adapter_config.json";

/// The fields of PEFT's `LoraConfig` that set each module's rank and scale (defaults as PEFT's).
struct LoraAdapterConfig {
  /// `r`: the rank of every module not in rank_pattern.
  int64_t r = 8;
  /// `lora_alpha`: the alpha of every module not in alpha_pattern.
  double lora_alpha = 8;
  /// `use_rslora`: scale alpha / sqrt(r) instead of alpha / r.
  bool use_rslora = false;
  /// `target_modules` as a list (informative when reading; written as the full module paths).
  std::vector<std::string> target_modules;
  /// `rank_pattern` / `alpha_pattern` in file order: a key matches a module whose dotted path is
  /// the key or matches the regex `.*\.<key>` (PEFT's get_pattern_key); the first match wins.
  std::vector<std::pair<std::string, int64_t>> rank_pattern;
  std::vector<std::pair<std::string, double>> alpha_pattern;

  /// The rank PEFT gives module `module` (rank_pattern, else r).
  int64_t rank_for(const std::string& module) const;
  /// The alpha PEFT gives module `module` (alpha_pattern, else lora_alpha).
  double alpha_for(const std::string& module) const;
  /// The LoraTarget::alpha that makes LoraTarget::scale() equal PEFT's scaling of `module` at
  /// rank rank_for(module): alpha_for(module), times sqrt(r) under use_rslora.
  double target_alpha(const std::string& module) const;
};

/// Parses a LoraConfig JSON object (the text of an adapter_config.json). Unknown fields are
/// ignored. Throws difftrain::Error starting with `where` when the text is not a JSON object, or
/// r / lora_alpha / a pattern value is not a number (r and rank_pattern values integers >= 1,
/// alphas finite).
LoraAdapterConfig parse_lora_adapter_config(const std::string& json_text, const std::string& where);

/// Parses Diffusers' `lora_adapter_metadata` JSON: by component ("unet", "text_encoder", ...) when
/// its keys are prefixed "<component>.", else one config under "" for every component. Errors as
/// parse_lora_adapter_config.
std::map<std::string, LoraAdapterConfig> parse_lora_adapter_metadata(const std::string& json_text,
                                                                     const std::string& where);

/// The config that describes `targets` exactly, as Diffusers' get_peft_kwargs builds it: r and
/// lora_alpha the most common rank and alpha (ties: the smaller), rank_pattern / alpha_pattern
/// keyed by the full module path for the others, target_modules every module path, sorted. A
/// target without alpha (or with alpha 0) has alpha = its rank (scale 1).
LoraAdapterConfig make_lora_adapter_config(const std::vector<LoraTarget>& targets);

/// adapter_config.json text for `config` (peft_type LORA plus PEFT's LoraConfig fields), as
/// PEFT's `save_pretrained` writes it.
std::string lora_adapter_config_json(const LoraAdapterConfig& config);

/// Diffusers' `lora_adapter_metadata` text for per-component configs: keys "<component>.<field>",
/// sorted, indent 2 (Diffusers' json.dumps(..., indent=2, sort_keys=True)).
std::string lora_adapter_metadata_json(const std::map<std::string, LoraAdapterConfig>& configs);

}  // namespace difftrain::io
