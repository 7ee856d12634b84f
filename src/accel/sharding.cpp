#include "difftrain/accel/sharding.h"

#include "difftrain/core/error.h"
#include "difftrain/core/forward_hooks.h"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <map>
#include <set>

namespace difftrain::accel {
namespace {

std::string upper(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
  return s;
}

std::optional<std::string> env(const char* name) {
  const char* v = std::getenv(name);
  if (v == nullptr || *v == '\0') return std::nullopt;
  return std::string(v);
}

bool parse_bool(const std::string& text, const char* name) {
  const std::string u = upper(text);
  if (u == "1" || u == "TRUE" || u == "YES") return true;
  if (u == "0" || u == "FALSE" || u == "NO") return false;
  // FSDP's backward_prefetch values: BACKWARD_PRE / BACKWARD_POST prefetch, NO_PREFETCH does not.
  if (u == "BACKWARD_PRE" || u == "BACKWARD_POST") return true;
  if (u == "NO_PREFETCH") return false;
  throw Error(fmt::format("{}='{}' is not a boolean (true/false)", name, text));
}

std::vector<std::string> split_list(const std::string& text) {
  std::vector<std::string> out;
  std::string item;
  for (char c : text + ",") {
    if (c == ',' || c == ' ') {
      if (!item.empty()) out.push_back(item);
      item.clear();
    } else {
      item += c;
    }
  }
  return out;
}

}  // namespace

const char* to_string(ShardingStrategy strategy) {
  switch (strategy) {
    case ShardingStrategy::kNoShard: return "NO_SHARD";
    case ShardingStrategy::kShardOptimizer: return "SHARD_OPTIMIZER";
    case ShardingStrategy::kShardGradOp: return "SHARD_GRAD_OP";
    case ShardingStrategy::kFullShard: return "FULL_SHARD";
  }
  return "?";
}

ShardingStrategy parse_sharding_strategy(const std::string& text, const std::string& origin) {
  const std::string u = upper(text);
  if (u == "NO_SHARD" || u == "3" || u == "ZERO0" || u == "DDP") return ShardingStrategy::kNoShard;
  if (u == "SHARD_OPTIMIZER" || u == "ZERO1") return ShardingStrategy::kShardOptimizer;
  if (u == "SHARD_GRAD_OP" || u == "2" || u == "ZERO2") return ShardingStrategy::kShardGradOp;
  if (u == "FULL_SHARD" || u == "1" || u == "ZERO3") return ShardingStrategy::kFullShard;
  throw Error(fmt::format(
      "{}: '{}' is not a sharding strategy; use NO_SHARD, SHARD_OPTIMIZER, SHARD_GRAD_OP or "
      "FULL_SHARD (or ZeRO stages zero0..zero3)",
      origin, text));
}

ShardingOptions ShardingOptions::from_env() { return from_env(ShardingOptions{}); }

ShardingOptions ShardingOptions::from_env(const ShardingOptions& base) {
  ShardingOptions o = base;
  if (auto v = env("DIFFTRAIN_SHARDING_STRATEGY"))
    o.strategy = parse_sharding_strategy(*v, "DIFFTRAIN_SHARDING_STRATEGY");
  if (auto v = env("DIFFTRAIN_FSDP_AUTO_WRAP_POLICY")) o.auto_wrap.policy = upper(*v);
  if (auto v = env("DIFFTRAIN_FSDP_TRANSFORMER_CLS_TO_WRAP")) o.auto_wrap.classes = split_list(*v);
  if (auto v = env("DIFFTRAIN_FSDP_MIN_NUM_PARAMS")) {
    char* end = nullptr;
    const long long n = std::strtoll(v->c_str(), &end, 10);
    if (end == v->c_str() || *end != '\0' || n < 1) {
      throw Error(fmt::format(
          "DIFFTRAIN_FSDP_MIN_NUM_PARAMS='{}' is not a positive number of parameters", *v));
    }
    o.auto_wrap.min_num_params = n;
  }
  if (auto v = env("DIFFTRAIN_FSDP_FORWARD_PREFETCH"))
    o.forward_prefetch = parse_bool(*v, "DIFFTRAIN_FSDP_FORWARD_PREFETCH");
  if (auto v = env("DIFFTRAIN_FSDP_BACKWARD_PREFETCH"))
    o.backward_prefetch = parse_bool(*v, "DIFFTRAIN_FSDP_BACKWARD_PREFETCH");
  if (auto v = env("DIFFTRAIN_SYNC_EACH_BATCH"))
    o.sync_each_batch = parse_bool(*v, "DIFFTRAIN_SYNC_EACH_BATCH");
  return o;
}

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
    planner.classes = {"ResnetBlock2D", "Transformer2DModel", "Attention"};
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
