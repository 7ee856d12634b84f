// Diffusers' EulerDiscreteScheduler (0.31): Algorithm 2 of Karras et al. (2022) with s_churn 0,
// the sampler SDXL ships with. Tables follow Diffusers' dtypes: the training sigmas are torch
// float32, set_timesteps() works in numpy float64 and casts to float32 at the end, and step()
// works on 0-dim float32 tensors as Diffusers does.

#include "difftrain/core/error.h"
#include "euler_common.h"
#include "sampler_classes.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

#include <cmath>

namespace difftrain::diffusion::detail {
namespace {

using nlohmann::json;

json optional_json(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

class EulerSampler : public EulerSamplerBase {
 public:
  EulerSampler(const json& config, const std::string& source)
      : EulerSamplerBase("EulerDiscreteScheduler") {
    const ConfigReader r(config, source);
    betas_ = r.beta_config(sampler_beta_schedules());
    prediction_type_ = r.get_choice("prediction_type", "epsilon",
                                    {"epsilon", "v_prediction", "sample", "original_sample"});
    interpolation_type_ = r.get_choice("interpolation_type", "linear", {"linear", "log_linear"});
    use_karras_sigmas_ = r.get_bool("use_karras_sigmas", false);
    use_exponential_sigmas_ = r.get_bool("use_exponential_sigmas", false);
    use_beta_sigmas_ = r.get_bool("use_beta_sigmas", false);
    sigma_min_ = r.get_optional_double("sigma_min");
    sigma_max_ = r.get_optional_double("sigma_max");
    read_spacing(r);
    timestep_type_ = r.get_choice("timestep_type", "discrete", {"discrete", "continuous"});
    final_sigmas_type_ = r.get_choice("final_sigmas_type", "zero", {"zero", "sigma_min"});
    if (int(use_karras_sigmas_) + int(use_exponential_sigmas_) + int(use_beta_sigmas_) > 1) {
      throw Error(r.where() +
                  "only one of use_karras_sigmas, use_exponential_sigmas, use_beta_sigmas can be "
                  "true; set the others to false");
    }
    if (use_beta_sigmas_) {
      throw Error(r.where() +
                  "use_beta_sigmas is not supported by difftrain's EulerDiscreteScheduler (it "
                  "needs scipy's beta quantiles); set it to false, or use_karras_sigmas or "
                  "use_exponential_sigmas true for a non-uniform schedule");
    }
    for (const auto& [name, v] : {std::pair{"sigma_min", sigma_min_}, {"sigma_max", sigma_max_}}) {
      if (v && !(*v > 0 && std::isfinite(*v))) {
        throw Error(r.where() + name + " is " + std::to_string(*v) +
                    "; it must be a finite number > 0 or null");
      }
    }
    alphas_cumprod_ = r.alphas_cumprod(sampler_beta_schedules(), true, true);
    set_training_tables(alphas_cumprod_);
    log_sigmas_ = log_float32(train_sigmas_);
    if (continuous_v()) timesteps_ = continuous_timesteps(sigmas_, betas_.num_train_timesteps);
  }

  json config() const override {
    json j = json::object();
    j["_class_name"] = class_name();
    put_beta_fields(betas_, j);
    j["prediction_type"] = prediction_type_;
    j["interpolation_type"] = interpolation_type_;
    j["use_karras_sigmas"] = use_karras_sigmas_;
    j["use_exponential_sigmas"] = use_exponential_sigmas_;
    j["use_beta_sigmas"] = use_beta_sigmas_;
    j["sigma_min"] = optional_json(sigma_min_);
    j["sigma_max"] = optional_json(sigma_max_);
    j["timestep_spacing"] = timestep_spacing_;
    j["timestep_type"] = timestep_type_;
    j["steps_offset"] = steps_offset_;
    j["rescale_betas_zero_snr"] = betas_.rescale_betas_zero_snr;
    j["final_sigmas_type"] = final_sigmas_type_;
    return j;
  }

  void set_timesteps(int64_t n) override {
    const std::vector<float> ts32 = spaced_timesteps(n);
    std::vector<double> ts(ts32.begin(), ts32.end());
    // sigmas: numpy float64 for "linear" (np.interp), float32 for "log_linear" (torch).
    std::vector<double> sig;
    if (interpolation_type_ == "linear") {
      sig = interp_on_index(ts, train_sigmas_);
    } else {
      // torch.linspace(np.log(sigmas[-1]), np.log(sigmas[0]), n + 1).exp(): n + 1 values (one
      // more than the timesteps, so sigmas() has n + 2 entries, as in Diffusers).
      const torch::Tensor s = torch::linspace(static_cast<double>(std::log(train_sigmas_.back())),
                                              static_cast<double>(std::log(train_sigmas_.front())),
                                              n + 1, torch::kFloat32)
                                  .exp()
                                  .contiguous();
      sig.assign(s.data_ptr<float>(), s.data_ptr<float>() + s.numel());
    }
    if (use_karras_sigmas_) {
      const double lo = sigma_min_ ? *sigma_min_ : sig.back();
      const double hi = sigma_max_ ? *sigma_max_ : sig.front();
      sig = karras_sigmas(lo, hi, n);
      ts.clear();
      for (double s : sig) ts.push_back(sigma_to_t(s, log_sigmas_));
    } else if (use_exponential_sigmas_) {
      // torch.linspace(math.log(sigma_max), math.log(sigma_min), n).exp(): float32.
      const double lo = sigma_min_ ? *sigma_min_ : sig.back();
      const double hi = sigma_max_ ? *sigma_max_ : sig.front();
      const torch::Tensor e =
          torch::linspace(std::log(hi), std::log(lo), n, torch::kFloat32).exp().contiguous();
      sig.assign(e.data_ptr<float>(), e.data_ptr<float>() + e.numel());
      ts.clear();
      for (double s : sig) ts.push_back(sigma_to_t(s, log_sigmas_));
    }
    float sigma_last = 0.0f;
    if (final_sigmas_type_ == "sigma_min") {
      const torch::Tensor a0 = alphas_cumprod_[0];
      sigma_last = ((1 - a0) / a0).pow(0.5).item<float>();
    }
    set_sigmas(sig, sigma_last);
    if (continuous_v()) {
      timesteps_ = continuous_timesteps(sigmas_, sigmas_.size(0) - 1);
    } else {
      std::vector<float> t32;
      for (double t : ts) t32.push_back(static_cast<float>(t));
      timesteps_ = torch::tensor(t32, torch::kFloat32);
    }
  }

  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample_in, std::optional<at::Generator>) override {
    const int64_t i = step_index(timestep);
    const torch::Tensor sample = sample_in.to(torch::kFloat32);
    const torch::Tensor sigma = sigma_at(i);
    // s_churn = 0: gamma = 0 and sigma_hat = sigma * (0 + 1) = sigma, no noise.
    const torch::Tensor sigma_hat = sigma * 1.0;
    torch::Tensor pred_original_sample;
    if (prediction_type_ == "sample" || prediction_type_ == "original_sample") {
      pred_original_sample = model_output;
    } else if (prediction_type_ == "epsilon") {
      pred_original_sample = sample - sigma_hat * model_output;
    } else {
      pred_original_sample =
          model_output * (-sigma / (sigma.pow(2) + 1).pow(0.5)) + (sample / (sigma.pow(2) + 1));
    }
    const torch::Tensor derivative = (sample - pred_original_sample) / sigma_hat;
    const torch::Tensor dt = sigma_at(i + 1) - sigma_hat;
    const torch::Tensor prev_sample = sample + derivative * dt;
    step_index_ = i + 1;
    return prev_sample.to(model_output.scalar_type());
  }

 private:
  bool continuous_v() const {
    return timestep_type_ == "continuous" && prediction_type_ == "v_prediction";
  }

  // torch.Tensor([0.25 * sigma.log() for sigma in sigmas[:count]]): float32 [count].
  static torch::Tensor continuous_timesteps(const torch::Tensor& sigmas, int64_t count) {
    std::vector<float> out;
    for (int64_t i = 0; i < count; ++i) out.push_back((sigmas[i].log() * 0.25).item<float>());
    return torch::tensor(out, torch::kFloat32);
  }

  std::string prediction_type_, interpolation_type_, timestep_type_, final_sigmas_type_;
  bool use_karras_sigmas_ = false, use_exponential_sigmas_ = false, use_beta_sigmas_ = false;
  std::optional<double> sigma_min_, sigma_max_;
  torch::Tensor alphas_cumprod_;
  std::vector<float> log_sigmas_;
};

}  // namespace

std::unique_ptr<Sampler> make_euler_sampler(const json& config, const std::string& source) {
  return std::make_unique<EulerSampler>(config, source);
}

}  // namespace difftrain::diffusion::detail
