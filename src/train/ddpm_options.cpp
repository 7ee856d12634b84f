// The DDPM objective's option group (train/ddpm_options.h).
#include "difftrain/train/ddpm_options.h"

#include "difftrain/core/error.h"

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
  };
  for (auto& s : specs) {
    s.structural =
        s.name == "prediction_type" || s.name == "ddpm_num_steps" || s.name == "ddpm_beta_schedule";
    s.exactness = s.name == "snr_gamma" || s.name == "noise_offset";
  }
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
  n.seed = seed;
  return n;
}

}  // namespace difftrain::train
