#pragma once
// How the Accelerator groups a model's trainable parameters into wrapped units (FSDP's
// auto-wrap) under a sharding strategy (DeepSpeed ZeRO stages 1-3, PyTorch FSDP); the strategy
// and policy settings are difftrain/settings/sharding_options.h.

#include "difftrain/settings/sharding_options.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::accel {

// The settings themselves live below the Accelerator (difftrain/settings/sharding_options.h, read
// by the launcher too); these names keep them at home in accel::.
using settings::AutoWrapPolicy;
using settings::parse_sharding_strategy;
using settings::ShardingOptions;
using settings::ShardingStrategy;
using settings::to_string;

/// One wrapped unit of a model: a module (or the root) and the trainable parameters it owns.
struct UnitPlan {
  std::string name;                 ///< module path, "" for the root unit
  std::string module_class;         ///< the class name the policy matched ("root" for the root)
  std::vector<std::string> params;  ///< parameter names (full paths), in registration order
  int64_t numel = 0;                ///< elements of those parameters
};

/// The class name auto-wrap matches for `module`: the Diffusers name for difftrain's modules
/// (e.g. "ResnetBlock2D", "CrossAttnDownBlock2D"), else the C++ class without namespace and
/// "Impl" suffix.
std::string wrap_class_name(const torch::nn::Module& module);

/// The units `policy` makes of `module`'s trainable parameters: wrapped modules in registration
/// order (a wrapped module inside another wrapped module is its own unit, and its parameters
/// are not the outer one's), then the root unit (empty units are dropped). Throws
/// difftrain::Error when a class in `policy.classes` matches no module, or the policy name is
/// unknown.
std::vector<UnitPlan> plan_units(const torch::nn::Module& module, const AutoWrapPolicy& policy);

}  // namespace difftrain::accel
