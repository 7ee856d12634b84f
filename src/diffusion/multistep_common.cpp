// Tables and conversions shared by DPM-Solver and UniPC (see multistep_common.h).

#include "multistep_common.h"

#include "difftrain/core/error.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

namespace difftrain::diffusion::detail {

std::vector<int64_t> multistep_timesteps(int64_t num_train_timesteps, int64_t last_timestep,
                                         int64_t n, const std::string& spacing,
                                         int64_t steps_offset) {
  std::vector<int64_t> out;  // descending
  if (spacing == "linspace") {
    const std::vector<double> lin = linspace(0.0, static_cast<double>(last_timestep - 1), n + 1);
    for (int64_t i = n; i >= 1; --i) {
      out.push_back(static_cast<int64_t>(std::nearbyint(lin[static_cast<size_t>(i)])));
    }
  } else if (spacing == "leading") {
    const int64_t ratio = last_timestep / (n + 1);  // Python // on non-negative ints
    for (int64_t i = n; i >= 1; --i) out.push_back(i * ratio + steps_offset);
  } else if (spacing == "trailing") {
    // np.arange(last, 0, -T / n): length ceil((0 - last) / -ratio); numpy fills element i >= 2
    // as start + i * (x[1] - x[0]), which can differ from start - i * ratio in the last bit.
    const double ratio = static_cast<double>(num_train_timesteps) / static_cast<double>(n);
    const double start = static_cast<double>(last_timestep);
    const double length = std::ceil((0.0 - start) / -ratio);
    const double second = start + -ratio;
    const double delta = second - start;
    for (int64_t i = 0; i < static_cast<int64_t>(length); ++i) {
      const double value =
          i == 0 ? start : (i == 1 ? second : start + static_cast<double>(i) * delta);
      out.push_back(static_cast<int64_t>(std::nearbyint(value)) - 1);
    }
  } else {
    throw Error("timestep_spacing '" + spacing +
                "' is not supported; choose one of 'linspace', 'leading' or 'trailing'");
  }
  return out;
}

void multistep_sigmas(SigmaSpacing spacing, int64_t n, const std::vector<float>& train_sigmas,
                      std::vector<int64_t>& timesteps, std::vector<double>& sigmas) {
  const std::vector<float> log_sigmas = log_float32(train_sigmas);
  const auto from_sigmas = [&] {
    timesteps.clear();
    for (double s : sigmas) {
      timesteps.push_back(static_cast<int64_t>(std::nearbyint(sigma_to_t(s, log_sigmas))));
    }
  };
  switch (spacing) {
    case SigmaSpacing::kInterp: {
      std::vector<double> x(timesteps.begin(), timesteps.end());
      sigmas = interp_on_index(x, train_sigmas);
      return;
    }
    case SigmaSpacing::kKarras:
      // in_sigmas = flip(sigmas): sigma_min = sigmas[0], sigma_max = sigmas[-1] (float32 values).
      sigmas = karras_sigmas(train_sigmas.front(), train_sigmas.back(), n);
      from_sigmas();
      return;
    case SigmaSpacing::kLu: {
      // _convert_to_lu with rho = 1 over flip(log_sigmas): lambda_min = log_sigmas[0],
      // lambda_max = log_sigmas[-1] (Diffusers' names), then sigmas = exp(lambdas).
      const double lo = log_sigmas.front(), hi = log_sigmas.back();
      const std::vector<double> ramp = linspace(0.0, 1.0, n);
      sigmas.clear();
      for (double r : ramp) sigmas.push_back(std::exp(hi + r * (lo - hi)));
      from_sigmas();
      return;
    }
  }
}

std::pair<torch::Tensor, torch::Tensor> sigma_to_alpha_sigma_t(const torch::Tensor& sigma) {
  // Python's `1 / x` on a tensor is x.reciprocal() * 1.
  const torch::Tensor alpha_t = torch::reciprocal(torch::pow(torch::pow(sigma, 2) + 1, 0.5)) * 1;
  const torch::Tensor sigma_t = sigma * alpha_t;
  return {alpha_t, sigma_t};
}

torch::Tensor lambda_of(const torch::Tensor& alpha_t, const torch::Tensor& sigma_t) {
  return torch::log(alpha_t) - torch::log(sigma_t);
}

torch::Tensor threshold_sample(const torch::Tensor& sample, double ratio, double max_value,
                               const std::string& who) {
  if (sample.dim() < 2) {
    throw Error(who + ": thresholding needs samples of shape [B, C, ...], got " +
                std::to_string(sample.dim()) + " dims");
  }
  const auto dtype = sample.scalar_type();
  torch::Tensor x = sample;
  // quantile needs float32/float64, and clamp has no CPU half kernel.
  if (dtype != torch::kFloat32 && dtype != torch::kFloat64) x = x.to(torch::kFloat32);
  x = x.reshape({x.size(0), -1});
  torch::Tensor s = at::quantile(x.abs(), ratio, 1);
  s = torch::clamp(s, 1, max_value).unsqueeze(1);
  x = torch::clamp(x, -s, s) / s;
  return x.reshape(sample.sizes()).to(dtype);
}

int64_t index_for_timestep(const torch::Tensor& timesteps, double timestep) {
  const torch::Tensor ts = timesteps.to(torch::kCPU, torch::kFloat64).contiguous();
  const double* p = ts.data_ptr<double>();
  std::vector<int64_t> hits;
  for (int64_t i = 0; i < ts.numel(); ++i) {
    if (p[i] == timestep) hits.push_back(i);
  }
  if (hits.empty()) return ts.numel() - 1;
  return hits.size() > 1 ? hits[1] : hits[0];
}

torch::Tensor draw_step_noise(at::IntArrayRef shape, const torch::Device& device,
                              const std::optional<at::Generator>& generator) {
  c10::optional<at::Generator> gen;
  torch::Device draw_on = device;
  if (generator) {
    gen = *generator;
    if (generator->device().type() == torch::kCPU) draw_on = torch::kCPU;
  }
  const auto options = torch::TensorOptions().dtype(torch::kFloat32).device(draw_on);
  return at::randn(shape, gen, options).to(device);
}

MultistepSampler::MultistepSampler(const nlohmann::json& json, const std::string& source,
                                   std::string class_name)
    : reader_(json, source), class_name_(std::move(class_name)) {
  const ConfigReader& r = reader_;
  betas_ = r.beta_config(sampler_beta_schedules());
  solver_order_ = r.get_int("solver_order", 2);
  prediction_type_ = r.get_choice("prediction_type", "epsilon",
                                  {"epsilon", "sample", "v_prediction", "flow_prediction"});
  use_flow_sigmas_ = r.get_bool("use_flow_sigmas", false);
  flow_shift_ = r.get_double("flow_shift", 1.0);
  if ((prediction_type_ == "flow_prediction") != use_flow_sigmas_) {
    throw Error(r.where() +
                "prediction_type flow_prediction and use_flow_sigmas go together (a flow-matching "
                "model's scheduler sets both)");
  }
  if (use_flow_sigmas_ && !(flow_shift_ > 0)) {
    throw Error(r.where() + "flow_shift must be > 0");
  }
  if (use_flow_sigmas_ &&
      (r.get_bool("use_dynamic_shifting", false) ||
       (r.json().contains("shift_terminal") && !r.json().at("shift_terminal").is_null()))) {
    throw Error(r.where() +
                "use_dynamic_shifting and shift_terminal with use_flow_sigmas are not supported; "
                "use flow_shift");
  }
  thresholding_ = r.get_bool("thresholding", false);
  dynamic_thresholding_ratio_ = r.get_double("dynamic_thresholding_ratio", 0.995);
  sample_max_value_ = r.get_double("sample_max_value", 1.0);
  lower_order_final_ = r.get_bool("lower_order_final", true);
  use_karras_sigmas_ = r.get_bool("use_karras_sigmas", false);
  use_exponential_sigmas_ = r.get_bool("use_exponential_sigmas", false);
  use_beta_sigmas_ = r.get_bool("use_beta_sigmas", false);
  timestep_spacing_ =
      r.get_choice("timestep_spacing", "linspace", {"linspace", "leading", "trailing"});
  steps_offset_ = r.get_non_negative_int("steps_offset", 0);
  final_sigmas_type_ = r.get_choice("final_sigmas_type", "zero", {"zero", "sigma_min"});

  if (use_flow_sigmas_ && (use_karras_sigmas_ || use_exponential_sigmas_ || use_beta_sigmas_)) {
    throw Error(r.where() +
                "use_flow_sigmas with Karras, exponential or beta sigmas is not supported");
  }
  if (int(use_karras_sigmas_) + int(use_exponential_sigmas_) + int(use_beta_sigmas_) > 1) {
    throw Error(r.where() +
                "only one of use_karras_sigmas, use_exponential_sigmas and "
                "use_beta_sigmas may be true");
  }
  if (thresholding_ && !(dynamic_thresholding_ratio_ > 0 && dynamic_thresholding_ratio_ <= 1)) {
    throw Error(r.where() + "dynamic_thresholding_ratio must be in (0, 1]");
  }
  alphas_cumprod_ = r.alphas_cumprod(sampler_beta_schedules(), true, true);
  train_sigmas_ = sigmas_from_alphas_cumprod(alphas_cumprod_);
}

nlohmann::json MultistepSampler::shared_config() const {
  nlohmann::json c = nlohmann::json::object();
  c["_class_name"] = class_name_;
  put_beta_fields(betas_, c);
  // trained_betas as the config gave it (integers stay integers).
  const nlohmann::json& in = reader_.json();
  c["trained_betas"] = in.contains("trained_betas") ? in["trained_betas"] : nlohmann::json();
  c["rescale_betas_zero_snr"] = betas_.rescale_betas_zero_snr;
  c["solver_order"] = solver_order_;
  c["prediction_type"] = prediction_type_;
  c["thresholding"] = thresholding_;
  c["dynamic_thresholding_ratio"] = dynamic_thresholding_ratio_;
  c["sample_max_value"] = sample_max_value_;
  c["lower_order_final"] = lower_order_final_;
  c["use_karras_sigmas"] = use_karras_sigmas_;
  c["use_exponential_sigmas"] = use_exponential_sigmas_;
  c["use_beta_sigmas"] = use_beta_sigmas_;
  c["timestep_spacing"] = timestep_spacing_;
  c["steps_offset"] = steps_offset_;
  c["final_sigmas_type"] = final_sigmas_type_;
  c["use_flow_sigmas"] = use_flow_sigmas_;
  c["flow_shift"] = flow_shift_;
  return c;
}

std::vector<int64_t> MultistepSampler::spaced_timesteps(int64_t n, int64_t last_timestep) const {
  if (n < 1) {
    throw Error(class_name_ + ": num_inference_steps is " + std::to_string(n) +
                "; it must be >= 1");
  }
  std::vector<int64_t> ts = multistep_timesteps(betas_.num_train_timesteps, last_timestep, n,
                                                timestep_spacing_, steps_offset_);
  if (ts.empty()) {
    throw Error(class_name_ + ": set_timesteps(" + std::to_string(n) +
                ") gives no timesteps with timestep_spacing '" + timestep_spacing_ +
                "'; use more steps or another spacing");
  }
  return ts;
}

void MultistepSampler::set_tables(const std::vector<int64_t>& timesteps,
                                  const std::vector<double>& sigmas) {
  std::vector<float> sigmas32(sigmas.begin(), sigmas.end());
  sigmas_ = torch::tensor(sigmas32, torch::kFloat32);
  timesteps_ = torch::tensor(timesteps, torch::kLong);
  num_inference_steps_ = static_cast<int64_t>(timesteps.size());
  model_outputs_.assign(static_cast<size_t>(solver_order_), torch::Tensor());
  lower_order_nums_ = 0;
  step_index_.reset();
}

int64_t MultistepSampler::begin_step(double timestep) {
  if (num_inference_steps_ == 0) {
    throw Error(class_name_ + ": step() before set_timesteps(); call set_timesteps first");
  }
  if (!step_index_) step_index_ = index_for_timestep(timesteps_, timestep);
  const int64_t i = *step_index_;
  const int64_t L = timesteps_.size(0);
  if (i >= L) {
    throw Error(class_name_ + ": step() called " + std::to_string(i + 1) +
                " times after set_timesteps(" + std::to_string(L) +
                "); call set_timesteps again to sample anew");
  }
  return i;
}

void MultistepSampler::push_model_output(const torch::Tensor& converted) {
  for (int64_t k = 0; k + 1 < solver_order_; ++k) model_outputs_[k] = model_outputs_[k + 1];
  model_outputs_.back() = converted;
}

void MultistepSampler::end_step(int64_t i) {
  if (lower_order_nums_ < solver_order_) ++lower_order_nums_;
  step_index_ = i + 1;
}

torch::Tensor MultistepSampler::predicted_x0(const torch::Tensor& model_output,
                                             const torch::Tensor& sample,
                                             const torch::Tensor& alpha_t,
                                             const torch::Tensor& sigma_t) const {
  torch::Tensor x0;
  if (prediction_type_ == "flow_prediction") {
    x0 = sample - sigma_t * model_output;
  } else if (prediction_type_ == "epsilon") {
    x0 = (sample - sigma_t * model_output) / alpha_t;
  } else if (prediction_type_ == "sample") {
    x0 = model_output;
  } else {
    x0 = alpha_t * sample - sigma_t * model_output;
  }
  if (thresholding_) x0 = threshold(x0);
  return x0;
}

torch::Tensor MultistepSampler::predicted_epsilon(const torch::Tensor& model_output,
                                                  const torch::Tensor& sample,
                                                  const torch::Tensor& alpha_t,
                                                  const torch::Tensor& sigma_t) const {
  if (prediction_type_ == "epsilon") return model_output;
  if (prediction_type_ == "sample") return (sample - alpha_t * model_output) / sigma_t;
  return alpha_t * model_output + sigma_t * sample;
}

std::pair<torch::Tensor, torch::Tensor> MultistepSampler::alpha_sigma(
    const torch::Tensor& sigma) const {
  if (use_flow_sigmas_) return {1 - sigma, sigma};
  return sigma_to_alpha_sigma_t(sigma);
}

torch::Tensor MultistepSampler::threshold(const torch::Tensor& x0) const {
  return threshold_sample(x0, dynamic_thresholding_ratio_, sample_max_value_, class_name_);
}

}  // namespace difftrain::diffusion::detail
