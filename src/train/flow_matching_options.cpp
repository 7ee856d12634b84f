// The flow-matching option group (train/flow_matching_options.h).
#include "difftrain/train/flow_matching_options.h"

#include "difftrain/core/error.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/train/loss_options.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <vector>

#include <string>

namespace difftrain::train {
namespace {

// A check that the number is > 0, with `why` after the message.
std::function<void(const nlohmann::json&, const std::string&)> positive(std::string why = "") {
  return [why = std::move(why)](const nlohmann::json& v, const std::string& where) {
    if (!(v.get<double>() > 0)) throw Error(where + " must be positive" + why);
  };
}

}  // namespace

std::vector<OptionSpec> flow_matching_option_specs() {
  // The samplings after Diffusers' "sigma" are kohya's (and those the families registered).
  auto samplings = diffusion::flow_timestep_samplings();
  const std::string kohya = fmt::format(
      "{}", fmt::join(std::vector<std::string>(samplings.begin() + 1, samplings.end()), " | "));
  std::vector<OptionSpec> specs = {
      {"weighting_scheme", "string", "none",
       "flow-matching density and loss weight: none | logit_normal | mode | cosmap | sigma_sqrt",
       one_of_check(diffusion::flow_weighting_schemes())},
      {"logit_mean", "float", 0.0, "logit_normal's mean", {}},
      {"logit_std", "float", 1.0, "logit_normal's standard deviation", positive()},
      {"mode_scale", "float", 1.29, "the mode scheme's scale", {}},
      {"timestep_sampling", "string", "sigma",
       "how sigma is drawn: sigma (Diffusers' tables) | " + kohya + " (kohya's)",
       one_of_check(samplings)},
      {"sigmoid_scale", "float", 1.0,
       "kohya's scale of the sigmoid draws (every sampling but "
       "sigma and uniform)",
       positive()},
      {"discrete_flow_shift", "float", 3.0, "kohya's shift of sigma (timestep_sampling shift)",
       positive(" (kohya uses 3.0)")},
      {"min_timestep", "float", 0.0,
       "musubi-tuner's / kohya's lower end of the trained timesteps (0..1000; continuous "
       "samplings)",
       range_check(0, 1000)},
      {"max_timestep", "float", 1000.0, "the upper end (0..1000)", range_check(0, 1000)},
  };
  for (auto& s : specs) s.exactness = true;
  for (auto& s : loss_option_specs("exponential")) specs.push_back(std::move(s));
  return specs;
}

diffusion::FlowMatchOptions flow_matching_options(const FamilyOptions& o, uint64_t seed) {
  diffusion::FlowMatchOptions f;
  f.weighting_scheme = o.text("weighting_scheme");
  f.logit_mean = o.number("logit_mean");
  f.logit_std = o.number("logit_std");
  f.mode_scale = o.number("mode_scale");
  f.timestep_sampling = o.text("timestep_sampling");
  f.sigmoid_scale = o.number("sigmoid_scale");
  f.discrete_flow_shift = o.number("discrete_flow_shift");
  f.min_timestep = o.number("min_timestep");
  f.max_timestep = o.number("max_timestep");
  f.loss = loss_options(o);
  f.seed = seed;
  return f;
}

}  // namespace difftrain::train
