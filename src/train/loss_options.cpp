// The loss option group (train/loss_options.h).
#include "difftrain/train/loss_options.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>

namespace difftrain::train {

std::vector<OptionSpec> loss_option_specs(const std::string& default_schedule) {
  std::vector<OptionSpec> specs = {
      {"loss_type", "string", "l2",
       "the element-wise loss: l2 | l1 | huber | smooth_l1 (kohya's names)",
       one_of_check(diffusion::loss_types())},
      {"huber_schedule", "string", default_schedule,
       "the Huber threshold over timesteps (huber, smooth_l1): constant | exponential | snr "
       "(DDPM only)",
       one_of_check(diffusion::huber_schedules())},
      {"huber_c", "float", 0.1, "the Huber threshold (constant) or its decay (0 < c <= 1)",
       [](const nlohmann::json& v, const std::string&) {
         const double c = v.get<double>();
         if (!(c > 0 && c <= 1)) {
           throw Error(fmt::format("--huber_c {} must be in (0, 1] (kohya's default is 0.1)", c));
         }
       }},
      {"huber_scale", "float", 1.0, "scales the constant and exponential Huber thresholds",
       [](const nlohmann::json& v, const std::string&) {
         if (!(v.get<double>() > 0)) throw Error("--huber_scale must be positive");
       }},
  };
  for (auto& s : specs) s.exactness = true;
  return specs;
}

diffusion::LossOptions loss_options(const FamilyOptions& o) {
  diffusion::LossOptions l;
  if (o.find("loss_type") == nullptr) return l;
  l.loss_type = o.text("loss_type");
  l.huber_schedule = o.text("huber_schedule");
  l.huber_c = o.number("huber_c");
  l.huber_scale = o.number("huber_scale");
  return l;
}

}  // namespace difftrain::train
