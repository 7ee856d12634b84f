#pragma once
// Exponential moving average of model weights, as Diffusers' `diffusers.training_utils.EMAModel`
// (0.31): the same decay schedule (plain, or warmup with inv_gamma / power), the same update
// arithmetic, and a resumable state.

#include "difftrain/io/safetensors.h"

#include <torch/nn/module.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::diffusion {

/// EMAModel's constructor arguments, with Diffusers' defaults.
struct EMAOptions {
  double decay = 0.9999;          ///< upper bound of the decay (`decay`)
  double min_decay = 0.0;         ///< lower bound (`min_decay`)
  int64_t update_after_step = 0;  ///< steps before the average starts moving (`update_after_step`)
  bool use_ema_warmup = false;    ///< decay 1 - (1 + step / inv_gamma)^-power (`use_ema_warmup`)
  double inv_gamma = 1.0;         ///< warmup speed (`inv_gamma`)
  double power = 2.0 / 3.0;       ///< warmup exponent (`power`; 3/4 suits short runs)
};

/// Shadow copies of named parameters, moved toward the live parameters by step(). Diffusers:
/// `EMAModel(unet.parameters(), ...)` with `ema.step(unet.parameters())`, `ema.copy_to(...)`,
/// `ema.store(...)` / `ema.restore(...)` and `state_dict()` / `load_state_dict()`.
class EMAModel {
 public:
  /// Starts the shadow as a detached copy of each parameter (same dtype and device).
  EMAModel(const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
           EMAOptions options = {});
  /// The shadow of every parameter of `module` (its named_parameters()).
  EMAModel(const torch::nn::Module& module, EMAOptions options = {});

  /// The decay used by the update numbered `optimization_step` (from 1): 0 while step =
  /// optimization_step - update_after_step - 1 <= 0, else 1 - (1 + step / inv_gamma)^-power with
  /// warmup or (1 + step) / (10 + step) without, clamped to [min_decay, decay].
  double get_decay(int64_t optimization_step) const;

  /// One update: shadow -= (1 - decay) * (shadow - param) for parameters that require grad;
  /// frozen ones are copied. `params` must be in construction order with the same shapes.
  void step(const std::vector<torch::Tensor>& params);
  /// step() over `module`'s parameters.
  void step(const torch::nn::Module& module);

  /// Copies the averages into `module`'s parameters (Diffusers: `ema.copy_to(unet.parameters())`).
  void copy_to(torch::nn::Module& module) const;
  /// Keeps a copy of `module`'s parameters, to put back with restore() after evaluating the EMA
  /// weights (Diffusers: `store` / `restore`).
  void store(const torch::nn::Module& module);
  void restore(torch::nn::Module& module);

  int64_t optimization_step() const { return optimization_step_; }
  /// The decay of the last step() (`cur_decay_value`); 0 before any.
  double cur_decay_value() const { return cur_decay_value_; }
  const std::vector<std::pair<std::string, torch::Tensor>>& shadow() const { return shadow_; }
  const EMAOptions& options() const { return options_; }

  /// The state Diffusers' `state_dict()` holds: the options and step count as JSON, and the
  /// shadow tensors by parameter name.
  nlohmann::json state_meta() const;
  io::TensorMap state_tensors() const;
  /// Restores a state written by state_meta()/state_tensors(); names and shapes must match (a
  /// difftrain::Error names the first that does not), and a refused load changes nothing.
  void load_state(const nlohmann::json& meta, const io::TensorMap& tensors,
                  const std::string& source);

 private:
  EMAOptions options_;
  int64_t optimization_step_ = 0;
  double cur_decay_value_ = 0.0;
  std::vector<std::pair<std::string, torch::Tensor>> shadow_;
  std::vector<torch::Tensor> stored_;
};

}  // namespace difftrain::diffusion
