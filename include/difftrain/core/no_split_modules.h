#pragma once
// A model that names its own blocks, the units a sharded run (FSDP / ZeRO-3) wraps by default:
// Diffusers' and transformers' `_no_split_modules`. The Accelerator knows no model's blocks; it
// asks the model (accel::plan_units), so each model family says what its blocks are.

#include <string>
#include <vector>

namespace difftrain::core {

/// Implemented by a model (a torch::nn::Module) whose blocks should be wrapped units when the
/// user names none (TRANSFORMER_BASED_WRAP without fsdp_transformer_layer_cls_to_wrap).
class NoSplitModules {
 public:
  virtual ~NoSplitModules() = default;
  /// Class names as accel::wrap_class_name() gives them (e.g. "ResnetBlock2D"). The classes
  /// named here never nest: a match inside another match stays in the outer unit.
  virtual std::vector<std::string> no_split_modules() const = 0;
};

}  // namespace difftrain::core
