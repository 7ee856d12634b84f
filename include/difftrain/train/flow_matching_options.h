#pragma once
// The flow-matching training options (Diffusers' SD3/FLUX scripts' and kohya's names), as a group
// of family options (train/option_spec.h) that a family training with
// diffusion::FlowMatchObjective declares, and the objective's options read back from a run.
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/train/option_spec.h"

#include <cstdint>
#include <vector>

namespace difftrain::train {

/// --weighting_scheme, --logit_mean, --logit_std, --mode_scale, --timestep_sampling,
/// --sigmoid_scale, --discrete_flow_shift, with Diffusers' defaults (none, 0, 1, 1.29, sigma, 1,
/// 3); every one changes the noise draws, so each is an exactness option.
std::vector<OptionSpec> flow_matching_option_specs();

/// The objective's options from a run's family options (which include the group above), with
/// the per-sample streams seeded by `seed`.
diffusion::FlowMatchOptions flow_matching_options(const FamilyOptions& options, uint64_t seed);

}  // namespace difftrain::train
