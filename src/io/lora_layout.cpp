// The registered LoRA key layouts and pipeline components (io/lora_layout.h).
#include "difftrain/io/lora_layout.h"

#include <algorithm>
#include <mutex>

namespace difftrain::io {
namespace {

struct Registered {
  std::mutex mutex;
  std::vector<LoraKeyLayout> layouts;
  std::vector<std::string> components;
  std::string bare_component;
};

Registered& registered() {
  static Registered r;
  return r;
}

}  // namespace

void register_lora_key_layout(LoraKeyLayout layout) {
  auto& r = registered();
  std::lock_guard<std::mutex> lock(r.mutex);
  r.layouts.push_back(std::move(layout));
}

std::vector<LoraKeyLayout> lora_key_layouts() {
  auto& r = registered();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.layouts;
}

std::map<std::string, torch::Tensor> normalize_lora_keys(
    const std::map<std::string, torch::Tensor>& tensors) {
  for (const auto& layout : lora_key_layouts()) {
    if (layout.matches && layout.matches(tensors)) return layout.normalize(tensors);
  }
  return tensors;
}

void register_lora_component(const std::string& component) {
  auto& r = registered();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (std::find(r.components.begin(), r.components.end(), component) == r.components.end()) {
    r.components.push_back(component);
  }
}

std::vector<std::string> lora_components() {
  auto& r = registered();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.components;
}

void register_lora_bare_component(const std::string& component) {
  auto& r = registered();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (r.bare_component.empty()) r.bare_component = component;
}

std::string lora_bare_component() {
  auto& r = registered();
  std::lock_guard<std::mutex> lock(r.mutex);
  return r.bare_component;
}

bool is_lora_component(const std::string& component) {
  const auto all = lora_components();
  return std::find(all.begin(), all.end(), component) != all.end();
}

}  // namespace difftrain::io
