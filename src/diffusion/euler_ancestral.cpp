// Diffusers' EulerAncestralDiscreteScheduler (0.31): an Euler step to sigma_down plus fresh noise
// of size sigma_up (k-diffusion's sample_euler_ancestral, eta 1). One randn of the sample's shape
// is drawn per step, the last step included, as Diffusers does.

#include "difftrain/core/error.h"
#include "sampler_classes.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

namespace difftrain::diffusion::detail {
namespace {

using nlohmann::json;

const std::vector<BetaSchedule> kBetas = {BetaSchedule::kLinear, BetaSchedule::kScaledLinear,
                                          BetaSchedule::kSquaredcosCapV2};
constexpr const char* kName = "EulerAncestralDiscreteScheduler";

class EulerAncestralSampler : public Sampler {
 public:
  EulerAncestralSampler(const json& config, const std::string& source) {
    const ConfigReader r(config, source);
    betas_ = r.beta_config(kBetas);
    prediction_type_ =
        r.get_choice("prediction_type", "epsilon", {"epsilon", "v_prediction", "sample"});
    if (prediction_type_ == "sample") {
      throw Error(r.where() +
                  "prediction_type \"sample\" is not implemented by Diffusers' "
                  "EulerAncestralDiscreteScheduler; use \"epsilon\" or \"v_prediction\", or the "
                  "\"euler\" sampler");
    }
    timestep_spacing_ =
        r.get_choice("timestep_spacing", "linspace", {"linspace", "leading", "trailing"});
    steps_offset_ = r.get_int("steps_offset", 0);
    if (steps_offset_ < 0) {
      throw Error(r.where() + "steps_offset is " + std::to_string(steps_offset_) +
                  "; it must be >= 0");
    }
    const torch::Tensor ac = r.alphas_cumprod(kBetas, true, true);
    train_sigmas_ = sigmas_from_alphas_cumprod(ac);
    std::vector<float> sig(train_sigmas_.rbegin(), train_sigmas_.rend());
    sig.push_back(0.0f);
    sigmas_ = torch::tensor(sig, torch::kFloat32);
    std::vector<float> ts;
    for (int64_t t = betas_.num_train_timesteps - 1; t >= 0; --t)
      ts.push_back(static_cast<float>(t));
    timesteps_ = torch::tensor(ts, torch::kFloat32);
  }

  std::string class_name() const override { return kName; }

  json config() const override {
    json j = json::object();
    j["_class_name"] = class_name();
    j["num_train_timesteps"] = betas_.num_train_timesteps;
    j["beta_start"] = betas_.beta_start;
    j["beta_end"] = betas_.beta_end;
    j["beta_schedule"] = to_string(betas_.beta_schedule);
    j["trained_betas"] = betas_.trained_betas ? json(*betas_.trained_betas) : json(nullptr);
    j["prediction_type"] = prediction_type_;
    j["timestep_spacing"] = timestep_spacing_;
    j["steps_offset"] = steps_offset_;
    j["rescale_betas_zero_snr"] = betas_.rescale_betas_zero_snr;
    return j;
  }

  void set_timesteps(int64_t n) override {
    const std::vector<float> ts32 =
        spaced_float_timesteps(betas_.num_train_timesteps, n,
                               parse_timestep_spacing(timestep_spacing_), steps_offset_, kName);
    const std::vector<double> sig =
        interp_on_index(std::vector<double>(ts32.begin(), ts32.end()), train_sigmas_);
    std::vector<float> sig32;
    for (double s : sig) sig32.push_back(static_cast<float>(s));
    sig32.push_back(0.0f);
    sigmas_ = torch::tensor(sig32, torch::kFloat32);
    timesteps_ = torch::tensor(ts32, torch::kFloat32);
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
    if (!step_index_) step_index_ = index_for_timestep(timesteps_, timestep, kName);
    const torch::Tensor sigma = sigma_at(*step_index_);
    return sample / (sigma.pow(2) + 1).pow(0.5);
  }

  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample_in,
                     std::optional<at::Generator> generator) override {
    if (!step_index_) step_index_ = index_for_timestep(timesteps_, timestep, kName);
    const int64_t i = *step_index_;
    const torch::Tensor sigma = sigma_at(i);
    const torch::Tensor sample = sample_in.to(torch::kFloat32);
    torch::Tensor pred_original_sample;
    if (prediction_type_ == "epsilon") {
      pred_original_sample = sample - sigma * model_output;
    } else {
      pred_original_sample =
          model_output * (-sigma / (sigma.pow(2) + 1).pow(0.5)) + (sample / (sigma.pow(2) + 1));
    }
    const torch::Tensor sigma_from = sigma;
    const torch::Tensor sigma_to = sigma_at(i + 1);
    const torch::Tensor sigma_up =
        (sigma_to.pow(2) * (sigma_from.pow(2) - sigma_to.pow(2)) / sigma_from.pow(2)).pow(0.5);
    const torch::Tensor sigma_down = (sigma_to.pow(2) - sigma_up.pow(2)).pow(0.5);
    const torch::Tensor derivative = (sample - pred_original_sample) / sigma;
    const torch::Tensor dt = sigma_down - sigma;
    torch::Tensor prev_sample = sample + derivative * dt;
    const torch::Tensor noise = step_noise(model_output, generator);
    prev_sample = prev_sample + noise * sigma_up;
    step_index_ = i + 1;
    return prev_sample.to(model_output.scalar_type());
  }

 private:
  torch::Tensor sigma_at(int64_t i) const {
    if (i < 0 || i >= sigmas_.size(0)) {
      throw Error(std::string(kName) + "::step: step " + std::to_string(i) +
                  " is past the last sigma; call set_timesteps() again before a new loop");
    }
    return sigmas_[i];
  }

  SchedulerConfig betas_;
  std::string prediction_type_, timestep_spacing_;
  int64_t steps_offset_ = 0;
  std::vector<float> train_sigmas_;
  torch::Tensor timesteps_, sigmas_;
  std::optional<int64_t> step_index_;
};

}  // namespace

std::unique_ptr<Sampler> make_euler_ancestral_sampler(const json& config,
                                                      const std::string& source) {
  return std::make_unique<EulerAncestralSampler>(config, source);
}

}  // namespace difftrain::diffusion::detail
