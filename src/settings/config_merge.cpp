#include "difftrain/settings/config_merge.h"

#include "config_reader_util.h"
#include "difftrain/settings/sharding_config.h"
#include "difftrain/settings/sharding_options.h"

#include <algorithm>
#include <numeric>
#include <sstream>

namespace difftrain::settings {

void SettingLayer::set(const std::string& name, nlohmann::json value, bool stated) {
  auto it = std::find_if(values.begin(), values.end(),
                         [&](const auto& entry) { return entry.first == name; });
  if (it == values.end()) {
    values.emplace_back(name, std::move(value));
  } else {
    it->second = std::move(value);
  }
  implied.erase(std::remove(implied.begin(), implied.end(), name), implied.end());
  if (!stated) implied.push_back(name);
}

const nlohmann::json* SettingLayer::find(const std::string& name) const {
  for (const auto& [n, v] : values) {
    if (n == name) return &v;
  }
  return nullptr;
}

const MergedSetting* MergedSettings::find(const std::string& name) const {
  for (const auto& s : settings) {
    if (s.name == name) return &s;
  }
  return nullptr;
}

MergedSettings merge_settings(const std::vector<SettingLayer>& layers) {
  std::vector<size_t> order(layers.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return layers[a].source < layers[b].source; });
  MergedSettings out;
  for (const size_t i : order) {
    for (const auto& [name, value] : layers[i].values) {
      MergedSetting* s = nullptr;
      for (auto& existing : out.settings) {
        if (existing.name == name) s = &existing;
      }
      if (s == nullptr) s = &out.settings.emplace_back(MergedSetting{name, {}, 0, {}});
      s->value = value;
      s->layer = i;
      s->source = layers[i].source;
    }
  }
  // A stated value replaced from a higher source; defaults are never "stated".
  for (size_t i = 0; i < layers.size(); ++i) {
    const SettingLayer& layer = layers[i];
    if (layer.source == SettingSource::kDefault) continue;
    for (const auto& [name, value] : layer.values) {
      if (std::count(layer.implied.begin(), layer.implied.end(), name)) continue;
      const MergedSetting* winner = out.find(name);
      if (winner->source > layer.source && winner->value != value) {
        out.overrides.push_back(SettingOverride{name, winner->value, value, i, winner->source});
      }
    }
  }
  return out;
}

SettingLayer external_config_layer(const ExternalTrainingConfig& ext, const std::string& origin) {
  SettingLayer layer;
  layer.source = SettingSource::kConfigFile;
  layer.origin = origin;
  if (ext.sharding_set) {
    const ShardingOptions& s = ext.sharding;
    const ShardingOptions d;
    layer.set("sharding_strategy", to_string(s.strategy));
    layer.set("fsdp_auto_wrap_policy", s.auto_wrap.policy,
              s.auto_wrap.policy != d.auto_wrap.policy);
    layer.set("fsdp_transformer_layer_cls_to_wrap", detail::join(s.auto_wrap.classes),
              !s.auto_wrap.classes.empty());
    layer.set("fsdp_min_num_params", s.auto_wrap.min_num_params,
              s.auto_wrap.min_num_params != d.auto_wrap.min_num_params);
    layer.set("fsdp_forward_prefetch", s.forward_prefetch,
              s.forward_prefetch != d.forward_prefetch);
    layer.set("fsdp_backward_prefetch", s.backward_prefetch,
              s.backward_prefetch != d.backward_prefetch);
    layer.set("offload_optimizer_device", std::string(s.offload_optimizer ? "cpu" : "none"),
              s.offload_optimizer);
    layer.set("offload_param_device", std::string(s.offload_params ? "cpu" : "none"),
              s.offload_params);
  }
  if (ext.mixed_precision) layer.set("mixed_precision", *ext.mixed_precision);
  if (ext.gradient_accumulation_steps) {
    layer.set("gradient_accumulation_steps", *ext.gradient_accumulation_steps);
  }
  if (ext.gradient_clipping) layer.set("max_grad_norm", *ext.gradient_clipping);
  if (ext.train_micro_batch_size_per_gpu) {
    layer.set("train_batch_size", *ext.train_micro_batch_size_per_gpu);
  }
  return layer;
}

ShardingOptions merged_sharding_options(const MergedSettings& merged, ShardingOptions base) {
  if (const auto* s = merged.find("sharding_strategy")) {
    base.strategy = parse_sharding_strategy(s->value.get<std::string>(), "sharding_strategy");
  }
  if (const auto* s = merged.find("fsdp_auto_wrap_policy")) {
    base.auto_wrap.policy = s->value.get<std::string>();
  }
  if (const auto* s = merged.find("fsdp_transformer_layer_cls_to_wrap")) {
    base.auto_wrap.classes.clear();
    std::stringstream in(s->value.get<std::string>());
    std::string c;
    while (std::getline(in, c, ',')) {
      if (!c.empty()) base.auto_wrap.classes.push_back(c);
    }
  }
  if (const auto* s = merged.find("fsdp_min_num_params")) {
    base.auto_wrap.min_num_params = s->value.get<int64_t>();
  }
  if (const auto* s = merged.find("fsdp_forward_prefetch")) {
    base.forward_prefetch = s->value.get<bool>();
  }
  if (const auto* s = merged.find("fsdp_backward_prefetch")) {
    base.backward_prefetch = s->value.get<bool>();
  }
  if (const auto* s = merged.find("sync_each_batch")) base.sync_each_batch = s->value.get<bool>();
  if (const auto* s = merged.find("offload_optimizer_device")) {
    base.offload_optimizer =
        parse_offload_device(s->value.get<std::string>(), "offload_optimizer_device");
  }
  if (const auto* s = merged.find("offload_param_device")) {
    base.offload_params = parse_offload_device(s->value.get<std::string>(), "offload_param_device");
  }
  return base;
}

}  // namespace difftrain::settings
