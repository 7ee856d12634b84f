// Diffusers' EulerAncestralDiscreteScheduler (0.31): an Euler step to sigma_down plus fresh noise
// of size sigma_up (k-diffusion's sample_euler_ancestral, eta 1). One randn of the sample's shape
// is drawn per step, the last step included, as Diffusers does.

#include "difftrain/core/error.h"
#include "euler_common.h"
#include "sampler_classes.h"
#include "sigma_schedule.h"

#include <torch/torch.h>

namespace difftrain::diffusion::detail {
namespace {

using nlohmann::json;

constexpr const char* kName = "EulerAncestralDiscreteScheduler";

class EulerAncestralSampler : public EulerSamplerBase {
 public:
  EulerAncestralSampler(const json& config, const std::string& source) : EulerSamplerBase(kName) {
    const ConfigReader r(config, source);
    betas_ = r.beta_config(sampler_beta_schedules());
    prediction_type_ =
        r.get_choice("prediction_type", "epsilon", {"epsilon", "v_prediction", "sample"});
    if (prediction_type_ == "sample") {
      throw Error(r.where() +
                  "prediction_type \"sample\" is not implemented by Diffusers' "
                  "EulerAncestralDiscreteScheduler; use \"epsilon\" or \"v_prediction\", or the "
                  "\"euler\" sampler");
    }
    read_spacing(r);
    set_training_tables(r.alphas_cumprod(sampler_beta_schedules(), true, true));
  }

  json config() const override {
    json j = json::object();
    j["_class_name"] = class_name();
    put_beta_fields(betas_, j);
    j["prediction_type"] = prediction_type_;
    j["timestep_spacing"] = timestep_spacing_;
    j["steps_offset"] = steps_offset_;
    j["rescale_betas_zero_snr"] = betas_.rescale_betas_zero_snr;
    return j;
  }

  void set_timesteps(int64_t n) override {
    const std::vector<float> ts32 = spaced_timesteps(n);
    set_sigmas(interp_on_index(std::vector<double>(ts32.begin(), ts32.end()), train_sigmas_), 0.0f);
    timesteps_ = torch::tensor(ts32, torch::kFloat32);
  }

  torch::Tensor step(const torch::Tensor& model_output, double timestep,
                     const torch::Tensor& sample_in,
                     std::optional<at::Generator> generator) override {
    const int64_t i = step_index(timestep);
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
  std::string prediction_type_;
};

}  // namespace

std::unique_ptr<Sampler> make_euler_ancestral_sampler(const json& config,
                                                      const std::string& source) {
  return std::make_unique<EulerAncestralSampler>(config, source);
}

}  // namespace difftrain::diffusion::detail
