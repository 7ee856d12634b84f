#pragma once
// The loss options every objective's group declares (kohya sd-scripts' names: --loss_type,
// --huber_schedule, --huber_c, --huber_scale), and their values read back from a run. The DDPM
// group (train/ddpm_options.h) and the flow-matching group (train/flow_matching_options.h)
// include them, so every family that trains has them.
#include "difftrain/diffusion/objective.h"
#include "difftrain/train/option_spec.h"

#include <string>
#include <vector>

namespace difftrain::train {

/// --loss_type (l2), --huber_schedule (`default_schedule`: kohya's snr under DDPM; exponential
/// under flow matching, which has no snr schedule), --huber_c (0.1), --huber_scale (1). Each is
/// an exactness option.
std::vector<OptionSpec> loss_option_specs(const std::string& default_schedule);

/// The loss options from a run's family options (which include the group above).
diffusion::LossOptions loss_options(const FamilyOptions& options);

}  // namespace difftrain::train
