#include "difftrain/diffusion/ema.h"

#include "difftrain/core/error.h"

#include <algorithm>
#include <cmath>

namespace difftrain::diffusion {

namespace {

std::vector<std::pair<std::string, torch::Tensor>> named(const torch::nn::Module& module) {
  std::vector<std::pair<std::string, torch::Tensor>> out;
  for (const auto& p : module.named_parameters(/*recurse=*/true))
    out.emplace_back(p.key(), p.value());
  return out;
}

std::vector<torch::Tensor> values(const torch::nn::Module& module) {
  return module.parameters(/*recurse=*/true);
}

}  // namespace

EMAModel::EMAModel(const std::vector<std::pair<std::string, torch::Tensor>>& named_parameters,
                   EMAOptions options)
    : options_(options) {
  if (!(options.decay >= 0 && options.decay <= 1) || !(options.min_decay >= 0) ||
      options.min_decay > options.decay || !(options.inv_gamma > 0) || !(options.power > 0) ||
      options.update_after_step < 0) {
    throw Error(
        "EMA options: need 0 <= min_decay <= decay <= 1, inv_gamma > 0, power > 0 and "
        "update_after_step >= 0");
  }
  torch::NoGradGuard no_grad;
  for (const auto& [name, p] : named_parameters) shadow_.emplace_back(name, p.detach().clone());
}

EMAModel::EMAModel(const torch::nn::Module& module, EMAOptions options)
    : EMAModel(named(module), options) {}

double EMAModel::get_decay(int64_t optimization_step) const {
  const int64_t step = std::max<int64_t>(0, optimization_step - options_.update_after_step - 1);
  if (step <= 0) return 0.0;
  const double s = static_cast<double>(step);
  double value = options_.use_ema_warmup ? 1 - std::pow(1 + s / options_.inv_gamma, -options_.power)
                                         : (1 + s) / (10 + s);
  value = std::min(value, options_.decay);
  return std::max(value, options_.min_decay);
}

void EMAModel::step(const std::vector<torch::Tensor>& params) {
  if (params.size() != shadow_.size()) {
    throw Error("EMAModel::step: got " + std::to_string(params.size()) +
                " parameters, the EMA has " + std::to_string(shadow_.size()) +
                "; pass the same model's parameters");
  }
  ++optimization_step_;
  const double decay = get_decay(optimization_step_);
  cur_decay_value_ = decay;
  const double one_minus_decay = 1 - decay;
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) {
    auto& s = shadow_[i].second;
    const auto& p = params[i];
    TORCH_CHECK(p.sizes() == s.sizes(), "EMAModel::step: parameter ", shadow_[i].first, " is ",
                p.sizes(), ", its shadow ", s.sizes());
    if (p.requires_grad()) {
      // Diffusers: s_param.sub_(one_minus_decay * (s_param - param)).
      s.sub_((s - p.to(s.dtype())).mul_(one_minus_decay));
    } else {
      s.copy_(p);
    }
  }
}

void EMAModel::step(const torch::nn::Module& module) { step(values(module)); }

void EMAModel::copy_to(torch::nn::Module& module) const {
  auto params = values(module);
  if (params.size() != shadow_.size()) {
    throw Error("EMAModel::copy_to: the module has " + std::to_string(params.size()) +
                " parameters, the EMA " + std::to_string(shadow_.size()));
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(shadow_[i].second);
}

void EMAModel::store(const torch::nn::Module& module) {
  stored_.clear();
  for (const auto& p : values(module)) stored_.push_back(p.detach().clone());
}

void EMAModel::restore(torch::nn::Module& module) {
  auto params = values(module);
  if (stored_.size() != params.size()) {
    throw Error("EMAModel::restore: nothing stored for this module; call store() first");
  }
  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].copy_(stored_[i]);
  stored_.clear();
}

nlohmann::json EMAModel::state_meta() const {
  return {{"decay", options_.decay},
          {"min_decay", options_.min_decay},
          {"optimization_step", optimization_step_},
          {"update_after_step", options_.update_after_step},
          {"use_ema_warmup", options_.use_ema_warmup},
          {"inv_gamma", options_.inv_gamma},
          {"power", options_.power},
          {"cur_decay_value", cur_decay_value_}};
}

io::TensorMap EMAModel::state_tensors() const {
  io::TensorMap out;
  for (const auto& [name, t] : shadow_) out[name] = t;
  return out;
}

void EMAModel::load_state(const nlohmann::json& meta, const io::TensorMap& tensors,
                          const std::string& source) {
  for (const auto& [name, t] : shadow_) {
    auto it = tensors.find(name);
    if (it == tensors.end()) {
      throw Error(source + ": EMA state has no tensor for parameter " + name +
                  "; was it saved from another model?");
    }
    if (it->second.sizes() != t.sizes()) {
      throw Error(source + ": EMA tensor " + name + " has the wrong shape for this model");
    }
  }
  if (tensors.size() != shadow_.size()) {
    throw Error(source + ": EMA state has " + std::to_string(tensors.size()) +
                " tensors, the model " + std::to_string(shadow_.size()));
  }
  EMAOptions o;
  int64_t step = 0;
  double cur = 0;
  try {
    o.decay = meta.at("decay").get<double>();
    o.min_decay = meta.at("min_decay").get<double>();
    o.update_after_step = meta.at("update_after_step").get<int64_t>();
    o.use_ema_warmup = meta.at("use_ema_warmup").get<bool>();
    o.inv_gamma = meta.at("inv_gamma").get<double>();
    o.power = meta.at("power").get<double>();
    step = meta.at("optimization_step").get<int64_t>();
    cur = meta.value("cur_decay_value", 0.0);
  } catch (const nlohmann::json::exception& e) {
    throw Error(source + ": malformed EMA state (" + std::string(e.what()) + ")");
  }
  torch::NoGradGuard no_grad;
  for (auto& [name, t] : shadow_) t.copy_(tensors.at(name));
  options_ = o;
  optimization_step_ = step;
  cur_decay_value_ = cur;
}

}  // namespace difftrain::diffusion
