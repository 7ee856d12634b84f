#pragma once
// The Huber thresholds of a batch (kohya's get_huber_threshold_if_needed), shared by the DDPM and
// flow-matching objectives. Private to src/diffusion.
#include "difftrain/diffusion/objective.h"

#include <torch/types.h>

#include <cstdint>

namespace difftrain::diffusion {

/// c [B] float32 on `device` for timesteps `t` [B] in 0..T under options.huber_schedule:
/// constant, exponential, or snr from `snr_sigmas` [B] (sqrt((1 - alpha_bar) / alpha_bar); only
/// read under snr, which a caller without alpha_bar refuses before).
torch::Tensor huber_thresholds(const LossOptions& options, const torch::Tensor& t, int64_t T,
                               const torch::Tensor& snr_sigmas, torch::Device device);

}  // namespace difftrain::diffusion
