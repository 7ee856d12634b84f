#include "difftrain/core/forward_hooks.h"

#include <atomic>
#include <mutex>
#include <unordered_map>

namespace difftrain::core {
namespace {

struct Registry {
  std::mutex mutex;
  std::unordered_map<const torch::nn::Module*, std::shared_ptr<ForwardHooks>> hooks;
  std::atomic<size_t> count{0};
};

Registry& registry() {
  static Registry* r = new Registry();  // never destroyed: scopes may run during exit
  return *r;
}

}  // namespace

void set_forward_hooks(const torch::nn::Module& module, std::shared_ptr<ForwardHooks> hooks) {
  auto& r = registry();
  std::lock_guard<std::mutex> lock(r.mutex);
  if (hooks) {
    r.hooks[&module] = std::move(hooks);
  } else {
    r.hooks.erase(&module);
  }
  r.count.store(r.hooks.size());
}

bool is_hookable(const torch::nn::Module& module) {
  return dynamic_cast<const HookableModule*>(&module) != nullptr;
}

ForwardScope::ForwardScope(const torch::nn::Module& module) : module_(module) {
  auto& r = registry();
  if (r.count.load() == 0) return;
  {
    std::lock_guard<std::mutex> lock(r.mutex);
    auto it = r.hooks.find(&module);
    if (it == r.hooks.end()) return;
    hooks_ = it->second;
  }
  hooks_->before_forward(module_);
}

torch::Tensor ForwardScope::output(torch::Tensor out) {
  if (!hooks_) return out;
  std::vector<torch::Tensor> outs{std::move(out)};
  hooks_->after_forward(module_, outs);
  return outs[0];
}

std::vector<torch::Tensor> ForwardScope::outputs(std::vector<torch::Tensor> outs) {
  if (hooks_) hooks_->after_forward(module_, outs);
  return outs;
}

}  // namespace difftrain::core
