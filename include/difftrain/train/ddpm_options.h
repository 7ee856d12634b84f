#pragma once
// The DDPM objective's training options (Diffusers' training scripts' names), as a group of
// family options (train/option_spec.h) that a family training with diffusion::DdpmObjective
// declares (the UNet-based ones), and the objective's options read back from a run. The
// flow-matching group is train/flow_matching_options.h.
#include "difftrain/train/option_spec.h"
#include "difftrain/train/training_task.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace difftrain::train {

/// --prediction_type (epsilon), --ddpm_num_steps (1000), --ddpm_beta_schedule (linear):
/// structural; --snr_gamma (none), --noise_offset (0): exactness; --input_perturbation (0).
std::vector<OptionSpec> ddpm_option_specs();

/// Other tools' names for the group's options, as ModelFamily::other_tools_options() gives them
/// (kohya's --min_snr_gamma, --model_prediction_type).
std::map<std::string, std::string> ddpm_other_tools_options();

/// The objective's options from a run's family options (which include the group above), with
/// the per-sample streams seeded by `seed`.
NoiseOptions ddpm_noise_options(const FamilyOptions& options, uint64_t seed);

}  // namespace difftrain::train
