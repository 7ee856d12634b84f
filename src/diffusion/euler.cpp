// Diffusers' EulerDiscreteScheduler (0.31): Algorithm 2 of Karras et al. (2022) with s_churn 0,
// the sampler SDXL ships with. Tables follow Diffusers' dtypes: the training sigmas are torch
// float32, set_timesteps() works in numpy float64 and casts to float32 at the end, and step()
// works on 0-dim float32 tensors as Diffusers does.

#include "difftrain/core/error.h"
#include "sampler_classes.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

#include <cmath>

namespace difftrain::diffusion::detail {
namespace {

using nlohmann::json;

const std::vector<BetaSchedule> kEulerBetas = {BetaSchedule::kLinear, BetaSchedule::kScaledLinear,
                                               BetaSchedule::kSquaredcosCapV2};

json optional_json(const std::optional<double>& v) { return v ? json(*v) : json(nullptr); }

class EulerSampler : public Sampler {
 public:
  EulerSampler(const json& config, const std::string& source) {
    const ConfigReader r(config, source);
    betas_ = r.beta_config(kEulerBetas);
    prediction_type_ = r.get_choice("prediction_type", "epsilon",
                                    {"epsilon", "v_prediction", "sample", "original_sample"});
    interpolation_type_ = r.get_choice("interpolation_type", "linear", {"linear", "log_linear"});
    use_karras_sigmas_ = r.get_bool("use_karras_sigmas", false);
    use_exponential_sigmas_ = r.get_bool("use_exponential_sigmas", false);
    use_beta_sigmas_ = r.get_bool("use_beta_sigmas", false);
    sigma_min_ = r.get_optional_double("sigma_min");
    sigma_max_ = r.get_optional_double("sigma_max");
    timestep_spacing_ =
        r.get_choice("timestep_spacing", "linspace", {"linspace", "leading", "trailing"});
    timestep_type_ = r.get_choice("timestep_type", "discrete", {"discrete", "continuous"});
    steps_offset_ = r.get_int("steps_offset", 0);
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
    if (steps_offset_ < 0) {
      throw Error(r.where() + "steps_offset is " + std::to_string(steps_offset_) +
                  "; it must be >= 0");
    }
    for (const auto& [name, v] : {std::pair{"sigma_min", sigma_min_}, {"sigma_max", sigma_max_}}) {
      if (v && !(*v > 0 && std::isfinite(*v))) {
        throw Error(r.where() + name + " is " + std::to_string(*v) +
                    "; it must be a finite number > 0 or null");
      }
    }
    alphas_cumprod_ = r.alphas_cumprod(kEulerBetas, true, true);
    train_sigmas_ = sigmas_from_alphas_cumprod(alphas_cumprod_);
    log_sigmas_ = log_float32(train_sigmas_);
    // The tables before set_timesteps(): every training timestep, descending.
    std::vector<float> sig(train_sigmas_.rbegin(), train_sigmas_.rend());
    sig.push_back(0.0f);
    sigmas_ = torch::tensor(sig, torch::kFloat32);
    const int64_t T = betas_.num_train_timesteps;
    std::vector<float> ts;
    for (int64_t t = T - 1; t >= 0; --t) ts.push_back(static_cast<float>(t));
    timesteps_ =
        continuous_v() ? continuous_timesteps(sigmas_, T) : torch::tensor(ts, torch::kFloat32);
  }

  std::string class_name() const override { return "EulerDiscreteScheduler"; }

  json config() const override {
    json j = json::object();
    j["_class_name"] = class_name();
    j["num_train_timesteps"] = betas_.num_train_timesteps;
    j["beta_start"] = betas_.beta_start;
    j["beta_end"] = betas_.beta_end;
    j["beta_schedule"] = to_string(betas_.beta_schedule);
    j["trained_betas"] = betas_.trained_betas ? json(*betas_.trained_betas) : json(nullptr);
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
    const int64_t T = betas_.num_train_timesteps;
    const std::vector<float> ts32 = spaced_float_timesteps(
        T, n, parse_timestep_spacing(timestep_spacing_), steps_offset_, "EulerDiscreteScheduler");
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
    std::vector<float> sig32;
    for (double s : sig) sig32.push_back(static_cast<float>(s));
    sig32.push_back(sigma_last);
    sigmas_ = torch::tensor(sig32, torch::kFloat32);
    if (continuous_v()) {
      timesteps_ = continuous_timesteps(sigmas_, sigmas_.size(0) - 1);
    } else {
      std::vector<float> t32;
      for (double t : ts) t32.push_back(static_cast<float>(t));
      timesteps_ = torch::tensor(t32, torch::kFloat32);
    }
    step_index_.reset();
  }

  const torch::Tensor& timesteps() const override { return timesteps_; }
  torch::Tensor sigmas() const override { return sigmas_; }

  double init_noise_sigma() const override {
    const torch::Tensor max_sigma = sigmas_.max();
    if (timestep_spacing_ == "linspace" || timestep_spacing_ == "trailing") {
      return max_sigma.item<double>();
    }
    return (max_sigma.pow(2) + 1).pow(0.5).item<double>();
  }

  torch::Tensor scale_model_input(const torch::Tensor& sample, double timestep) override {
    if (!step_index_)
      step_index_ = index_for_timestep(timesteps_, timestep, "EulerDiscreteScheduler");
    const torch::Tensor sigma = sigma_at(*step_index_);
    return sample / (sigma.pow(2) + 1).pow(0.5);
  }

  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample_in, std::optional<at::Generator>) override {
    if (!step_index_)
      step_index_ = index_for_timestep(timesteps_, timestep, "EulerDiscreteScheduler");
    const int64_t i = *step_index_;
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

  torch::Tensor sigma_at(int64_t i) const {
    if (i < 0 || i >= sigmas_.size(0)) {
      throw Error("EulerDiscreteScheduler::step: step " + std::to_string(i) +
                  " is past the last sigma; call set_timesteps() again before a new loop");
    }
    return sigmas_[i];
  }

  SchedulerConfig betas_;
  std::string prediction_type_, interpolation_type_, timestep_spacing_, timestep_type_,
      final_sigmas_type_;
  bool use_karras_sigmas_ = false, use_exponential_sigmas_ = false, use_beta_sigmas_ = false;
  std::optional<double> sigma_min_, sigma_max_;
  int64_t steps_offset_ = 0;
  torch::Tensor alphas_cumprod_;
  std::vector<float> train_sigmas_, log_sigmas_;
  torch::Tensor timesteps_, sigmas_;
  std::optional<int64_t> step_index_;
};

}  // namespace

std::unique_ptr<Sampler> make_euler_sampler(const json& config, const std::string& source) {
  return std::make_unique<EulerSampler>(config, source);
}

}  // namespace difftrain::diffusion::detail
