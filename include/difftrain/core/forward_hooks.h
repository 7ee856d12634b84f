#pragma once
// Hooks around the forward of selected modules: what Python's register_forward_pre_hook /
// register_forward_hook give FSDP, which LibTorch's C++ modules do not have. A module that
// supports them derives from HookableModule and opens a ForwardScope in its forward:
//
//     torch::Tensor ResnetBlock2DImpl::forward(const torch::Tensor& x, const torch::Tensor& t) {
//       core::ForwardScope scope(*this);  // before_forward: e.g. gather the sharded parameters
//       ...
//       return scope.output(out);         // after_forward: e.g. free them, hook the backward
//     }
//
// With no hooks installed a scope costs one atomic load.

#include <torch/nn/module.h>

#include <memory>
#include <string>
#include <vector>

namespace difftrain::core {

/// A module whose forward opens a ForwardScope, so hooks installed on it run.
class HookableModule {
 public:
  virtual ~HookableModule() = default;
  /// The class name users know it by (Diffusers', e.g. "ResnetBlock2D", "CrossAttnDownBlock2D").
  virtual std::string hook_class_name() const = 0;
};

/// What runs around a hooked module's forward.
class ForwardHooks {
 public:
  virtual ~ForwardHooks() = default;
  /// Runs at the start of the module's forward.
  virtual void before_forward(const torch::nn::Module& module) = 0;
  /// Runs with the forward's outputs just before it returns (tensors may be replaced).
  virtual void after_forward(const torch::nn::Module& module,
                             std::vector<torch::Tensor>& outputs) = 0;
};

/// Installs `hooks` on `module` (replacing any); nullptr removes them. The registry holds no
/// reference to the module: remove the hooks before the module is destroyed.
void set_forward_hooks(const torch::nn::Module& module, std::shared_ptr<ForwardHooks> hooks);
/// Whether `module` is a HookableModule (its forward opens a ForwardScope).
bool is_hookable(const torch::nn::Module& module);

/// RAII: before_forward at construction; output()/outputs() run after_forward. A scope left
/// without output() (an exception) runs nothing more.
class ForwardScope {
 public:
  explicit ForwardScope(const torch::nn::Module& module);
  ForwardScope(const ForwardScope&) = delete;
  ForwardScope& operator=(const ForwardScope&) = delete;
  /// The forward's single output, after after_forward.
  torch::Tensor output(torch::Tensor out);
  /// Several outputs (e.g. a block's feature map and its residuals), after after_forward.
  std::vector<torch::Tensor> outputs(std::vector<torch::Tensor> outs);

 private:
  const torch::nn::Module& module_;
  std::shared_ptr<ForwardHooks> hooks_;
};

}  // namespace difftrain::core
