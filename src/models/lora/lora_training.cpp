#include "difftrain/models/lora/lora_training.h"

#include "difftrain/core/error.h"

#include <algorithm>

namespace difftrain::models {

bool lora_target_matches(const std::string& name, const std::vector<std::string>& targets) {
  for (const auto& t : targets) {
    if (name == t) return true;
    if (name.size() > t.size() && name.compare(name.size() - t.size(), t.size(), t) == 0 &&
        name[name.size() - t.size() - 1] == '.') {
      return true;
    }
  }
  return false;
}

namespace {

std::string join_first(const std::vector<std::string>& items, size_t limit) {
  std::string out;
  for (size_t i = 0; i < items.size() && i < limit; ++i) out += (i ? ", " : "") + items[i];
  if (items.size() > limit) out += ", ...";
  return out;
}

std::string slashed(std::string name) {
  std::replace(name.begin(), name.end(), '.', '/');
  return name;
}

}  // namespace

LoraLayersImpl::LoraLayersImpl(torch::nn::Module& model, const LoraConfig& config)
    : config_(config) {
  if (config.target_modules.empty()) {
    throw Error(
        "lora_target_modules is empty: name at least one layer, e.g. to_q,to_k,to_v,to_out.0");
  }
  const auto options =
      LoraAdapterOptions().rank(config.rank).alpha(config.alpha).dropout(config.dropout);
  std::vector<std::string> all_layers;
  std::vector<bool> used(config.target_modules.size(), false);
  for (const auto& item : model.named_modules("", /*include_self=*/false)) {
    const std::string& name = item.key();
    auto* linear = dynamic_cast<LinearImpl*>(item.value().get());
    auto* conv = dynamic_cast<Conv2dImpl*>(item.value().get());
    if (linear != nullptr || conv != nullptr) all_layers.push_back(name);
    bool match = false;
    for (size_t i = 0; i < config.target_modules.size(); ++i) {
      if (lora_target_matches(name, {config.target_modules[i]})) used[i] = match = true;
    }
    for (const auto& prefix : config.exclude_prefixes) {
      if (name == prefix || name.rfind(prefix + ".", 0) == 0) match = false;
    }
    if (!match) continue;
    LoraAdapter adapter{nullptr};
    if (linear != nullptr) {
      adapter = LoraAdapter(linear->options, options);
      adapter->to(linear->weight.defined() ? linear->weight.device()
                                           : linear->quantized_weight().q.device());
      linear->set_lora(adapter);
    } else if (conv != nullptr) {
      adapter = LoraAdapter(conv->options, options);
      adapter->to(conv->weight.defined() ? conv->weight.device()
                                         : conv->quantized_weight().q.device());
      conv->set_lora(adapter);
    } else {
      // A container whose name matches (e.g. "to_out"): PEFT would refuse it too.
      throw Error("lora_target_modules entry matches \"" + name +
                  "\", which is not a Linear or Conv2d layer; name the layer itself (e.g. " + name +
                  ".0)");
    }
    register_module(slashed(name), adapter);
    names_.push_back(name);
    layers_.push_back(item.value());
  }
  for (size_t i = 0; i < used.size(); ++i) {
    if (!used[i]) {
      throw Error(
          "lora_target_modules entry \"" + config.target_modules[i] +
          "\" matches no layer of the model; its layers include: " + join_first(all_layers, 6));
    }
  }
}

LoraAdapter LoraLayersImpl::adapter(const std::string& name) const {
  const std::string key = slashed(name);
  for (const auto& child : named_children()) {
    if (child.key() == key)
      return LoraAdapter(std::dynamic_pointer_cast<LoraAdapterImpl>(child.value()));
  }
  throw Error("no LoRA adapter on layer \"" + name + "\"");
}

io::LoraWeights LoraLayersImpl::to_lora_weights(const std::string& component) const {
  io::LoraWeights out;
  out.format = io::LoraFormat::kPeft;
  auto& targets = out.components[component];
  for (const auto& name : names_) {
    auto a = adapter(name);
    io::LoraTarget t;
    t.module = name;
    t.key = name;
    t.down = a->down_weight().detach().to(torch::kCPU, torch::kFloat32).clone();
    t.up = a->up_weight().detach().to(torch::kCPU, torch::kFloat32).clone();
    t.alpha = a->options().alpha();
    targets.push_back(std::move(t));
  }
  return out;
}

void LoraLayersImpl::detach() {
  for (auto& layer : layers_) {
    if (auto* linear = dynamic_cast<LinearImpl*>(layer.get())) linear->set_lora(nullptr);
    if (auto* conv = dynamic_cast<Conv2dImpl*>(layer.get())) conv->set_lora(nullptr);
  }
}

}  // namespace difftrain::models
