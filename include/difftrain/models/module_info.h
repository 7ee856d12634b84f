#pragma once
// Where a module's weights are and in what type (the first parameter's; a module without
// parameters counts as float32 on the CPU), for code that feeds a model its inputs.

#include <torch/nn/module.h>
#include <torch/types.h>

namespace difftrain::models {

inline torch::Device module_device(const torch::nn::Module& module) {
  const auto params = module.parameters();
  return params.empty() ? torch::Device(torch::kCPU) : params[0].device();
}

inline torch::Dtype module_dtype(const torch::nn::Module& module) {
  const auto params = module.parameters();
  return params.empty() ? torch::kFloat32 : params[0].scalar_type();
}

}  // namespace difftrain::models
