#include "difftrain/accel/sharding.h"

#include "difftrain/core/error.h"
#include "difftrain/core/forward_hooks.h"
#include "difftrain/core/no_split_modules.h"

#include <fmt/format.h>

#include <algorithm>
#include <map>
#include <set>

namespace difftrain::accel {

std::string wrap_class_name(const torch::nn::Module& module) {
  if (const auto* h = dynamic_cast<const core::HookableModule*>(&module)) {
    return h->hook_class_name();
  }
  std::string name = module.name();
  const auto colon = name.rfind("::");
  if (colon != std::string::npos) name = name.substr(colon + 2);
  if (name.size() > 4 && name.compare(name.size() - 4, 4, "Impl") == 0) {
    name.resize(name.size() - 4);
  }
  return name;
}

namespace {

// The union of core::NoSplitModules::no_split_modules() over `m` and its descendants.
void collect_no_split_modules(const torch::nn::Module& m, std::set<std::string>& out) {
  if (const auto* named = dynamic_cast<const core::NoSplitModules*>(&m)) {
    for (const auto& c : named->no_split_modules()) out.insert(c);
  }
  for (const auto& child : m.children()) collect_no_split_modules(*child, out);
}

struct Planner {
  const AutoWrapPolicy& policy;
  std::set<std::string> classes;
  std::set<std::string> matched;
  bool defaults = false;  // the default classes never nest (Attention inside Transformer2DModel)
  std::vector<UnitPlan> units;
  UnitPlan root;

  int64_t trainable_numel(const torch::nn::Module& m) const {
    int64_t n = 0;
    for (const auto& p : m.parameters(true)) n += p.requires_grad() ? p.numel() : 0;
    return n;
  }

  bool wraps(const torch::nn::Module& m, bool is_root, bool inside) {
    if (is_root || (defaults && inside)) return false;
    if (policy.policy == "TRANSFORMER_BASED_WRAP") {
      const std::string cls = wrap_class_name(m);
      if (classes.count(cls)) {
        matched.insert(cls);
        return true;
      }
      return false;
    }
    if (policy.policy == "SIZE_BASED_WRAP") {
      // Bottom-up as FSDP's size_based_auto_wrap_policy: a module wraps when what is left of it
      // (after its own wrapped children) reaches the threshold. Computed in visit().
      return false;
    }
    return false;
  }

  // Returns the trainable elements of `m` that are not in a unit yet (SIZE_BASED_WRAP), adding
  // units for wrapped descendants.
  void visit(const torch::nn::Module& m, const std::string& prefix, bool is_root, UnitPlan& owner,
             bool inside = false) {
    const bool wrap_here = wraps(m, is_root, inside);
    UnitPlan self;
    UnitPlan& target = wrap_here ? self : owner;
    if (wrap_here) {
      self.name = prefix;
      self.module_class = wrap_class_name(m);
    }
    const size_t first_unit = units.size();
    // With SIZE_BASED_WRAP, children are planned into a scratch unit first; if what remains
    // reaches the threshold, this module becomes a unit.
    UnitPlan scratch;
    const bool size_based = policy.policy == "SIZE_BASED_WRAP" && !is_root;
    UnitPlan& collect = size_based ? scratch : target;
    for (const auto& item : m.named_parameters(false)) {
      if (!item.value().requires_grad()) continue;
      collect.params.push_back(prefix.empty() ? item.key() : prefix + "." + item.key());
      collect.numel += item.value().numel();
    }
    for (const auto& child : m.named_children()) {
      visit(*child.value(), prefix.empty() ? child.key() : prefix + "." + child.key(), false,
            collect, inside || wrap_here);
    }
    if (size_based) {
      if (scratch.numel >= policy.min_num_params) {
        scratch.name = prefix;
        scratch.module_class = wrap_class_name(m);
        units.push_back(std::move(scratch));
      } else {
        owner.params.insert(owner.params.end(), scratch.params.begin(), scratch.params.end());
        owner.numel += scratch.numel;
      }
      return;
    }
    if (wrap_here) {
      // A wrapped module comes before the units nested in it (forward order of its start).
      units.insert(units.begin() + static_cast<std::ptrdiff_t>(first_unit), std::move(self));
    }
  }
};

}  // namespace

std::vector<UnitPlan> plan_units(const torch::nn::Module& module, const AutoWrapPolicy& policy) {
  if (policy.policy != "TRANSFORMER_BASED_WRAP" && policy.policy != "SIZE_BASED_WRAP" &&
      policy.policy != "NO_WRAP") {
    throw Error(fmt::format(
        "auto-wrap policy '{}' is not one of TRANSFORMER_BASED_WRAP, SIZE_BASED_WRAP, NO_WRAP",
        policy.policy));
  }
  if (policy.policy == "SIZE_BASED_WRAP" && policy.min_num_params < 1) {
    throw Error(fmt::format("fsdp_min_num_params must be >= 1, got {}", policy.min_num_params));
  }
  Planner planner{policy, {}, {}, false, {}, {}};
  const bool defaults = policy.classes.empty();
  planner.defaults = defaults;
  if (defaults) {
    // The blocks the model names itself (its family's; none: one root unit).
    collect_no_split_modules(module, planner.classes);
  } else {
    planner.classes.insert(policy.classes.begin(), policy.classes.end());
  }
  planner.root.module_class = "root";
  planner.visit(module, "", true, planner.root);
  if (policy.policy == "TRANSFORMER_BASED_WRAP" && !defaults) {
    for (const auto& cls : planner.classes) {
      if (!planner.matched.count(cls)) {
        throw Error(fmt::format(
            "fsdp_transformer_layer_cls_to_wrap: class '{}' matches no module of the model; "
            "check the spelling (Diffusers names such as ResnetBlock2D, Transformer2DModel, "
            "CrossAttnDownBlock2D)",
            cls));
      }
    }
  }
  std::vector<UnitPlan> out;
  for (auto& u : planner.units) {
    if (u.numel > 0) out.push_back(std::move(u));
  }
  if (planner.root.numel > 0) out.push_back(std::move(planner.root));
  return out;
}

}  // namespace difftrain::accel
