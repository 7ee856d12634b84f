// The DDPM objective's option group (train/ddpm_options.h).
#include "difftrain/train/ddpm_options.h"

#include "difftrain/core/error.h"
#include "difftrain/train/loss_options.h"

#include <string>

namespace difftrain::train {

std::vector<OptionSpec> ddpm_option_specs() {
  const auto non_negative = [](const nlohmann::json& v, const std::string&) {
    if (!(v.get<double>() >= 0))
      throw Error("--noise_offset and --input_perturbation must be >= 0");
  };
  std::vector<OptionSpec> specs = {
      {"prediction_type", "string", "epsilon",
       "what the denoiser predicts: epsilon | v_prediction | sample (a pretrained folder's "
       "scheduler config decides otherwise)",
       one_of_check({"epsilon", "v_prediction", "sample"})},
      {"ddpm_num_steps", "int", 1000,
       "DDPMScheduler's num_train_timesteps (a pretrained folder's scheduler config wins)",
       [](const nlohmann::json& v, const std::string&) {
         if (v.get<int64_t>() < 1) throw Error("--ddpm_num_steps must be at least 1");
       }},
      {"ddpm_beta_schedule", "string", "linear",
       "DDPMScheduler's beta_schedule: linear | scaled_linear | squaredcos_cap_v2",
       one_of_check({"linear", "scaled_linear", "squaredcos_cap_v2"})},
      {"snr_gamma", "float?", nullptr, "min-SNR loss weighting's gamma (Diffusers uses 5.0)",
       [](const nlohmann::json& v, const std::string&) {
         if (!v.is_null() && !(v.get<double>() > 0)) {
           throw Error("--snr_gamma must be positive (Diffusers uses 5.0)");
         }
       }},
      {"noise_offset", "float", 0.0, "offset noise's scale (0: none)", non_negative},
      {"input_perturbation", "float", 0.0, "input perturbation of the noise (0: none)",
       non_negative},
      {"multires_noise_iterations", "int", 0,
       "kohya's multi-resolution (pyramid) noise: its levels (0: none; kohya suggests 6-10)",
       [](const nlohmann::json& v, const std::string&) {
         if (v.get<int64_t>() < 0) throw Error("--multires_noise_iterations must be >= 0");
       }},
      {"multires_noise_discount", "float", 0.3,
       "how much each coarser level of multires noise is weakened (0..1]",
       [](const nlohmann::json& v, const std::string&) {
         const double d = v.get<double>();
         if (!(d > 0 && d <= 1)) {
           throw Error("--multires_noise_discount must be in (0, 1] (kohya's default is 0.3)");
         }
       }},
  };
  for (auto& s : specs) {
    s.structural =
        s.name == "prediction_type" || s.name == "ddpm_num_steps" || s.name == "ddpm_beta_schedule";
    s.exactness =
        s.name == "snr_gamma" || s.name == "noise_offset" || s.name.rfind("multires_noise", 0) == 0;
  }
  for (auto& s : loss_option_specs("snr")) specs.push_back(std::move(s));
  return specs;
}

std::map<std::string, std::string> ddpm_other_tools_options() {
  return {{"min_snr_gamma", "--snr_gamma"},
          {"model_prediction_type",
           "--prediction_type (epsilon / v-prediction models; a flow-matching model always "
           "predicts the velocity)"}};
}

NoiseOptions ddpm_noise_options(const FamilyOptions& o, uint64_t seed) {
  NoiseOptions n;
  n.prediction_type = o.text("prediction_type");
  n.ddpm_num_steps = o.integer("ddpm_num_steps");
  n.ddpm_beta_schedule = o.text("ddpm_beta_schedule");
  const auto& gamma = o.at("snr_gamma");
  if (!gamma.is_null()) n.snr_gamma = gamma.get<double>();
  n.noise_offset = o.number("noise_offset");
  n.input_perturbation = o.number("input_perturbation");
  n.multires_noise_iterations = o.integer("multires_noise_iterations");
  n.multires_noise_discount = o.number("multires_noise_discount");
  n.loss = loss_options(o);
  n.seed = seed;
  return n;
}

}  // namespace difftrain::train
