#pragma once

#include "difftrain/dist/process_group.h"

#include <torch/types.h>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace difftrain::accel {

/// Mixed precision mode (Accelerate's `mixed_precision`).
enum class MixedPrecision { kNo, kBf16, kFp16 };

/// "no" | "bf16" | "fp16" (case-insensitive); anything else throws difftrain::Error listing the
/// valid values.
MixedPrecision parse_mixed_precision(const std::string& text);
const char* to_string(MixedPrecision mp);

/// Autocast for a scope (torch.autocast; Accelerate's `accelerator.autocast()`). kNo does nothing.
/// CPU: bf16 CPU autocast (fp16 has no CPU autocast in LibTorch 1.13: the scope then computes in
/// fp32 while the loss scaler still runs). CUDA: CUDA autocast in fp16 or bf16. Nestable: the
/// previous state is restored on exit, and the cast cache is cleared when the outermost exits.
class AutocastGuard {
 public:
  AutocastGuard(MixedPrecision mp, torch::Device device);
  ~AutocastGuard();
  AutocastGuard(AutocastGuard&& other) noexcept;
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;
  AutocastGuard& operator=(AutocastGuard&&) = delete;

 private:
  bool active_ = false;
  bool cuda_ = false;
  bool previous_enabled_ = false;
  at::ScalarType previous_dtype_ = at::kBFloat16;
};

/// Turns CPU and CUDA autocast off for a scope (used around backward), restoring it after.
class AutocastDisabledGuard {
 public:
  AutocastDisabledGuard();
  ~AutocastDisabledGuard();
  AutocastDisabledGuard(const AutocastDisabledGuard&) = delete;
  AutocastDisabledGuard& operator=(const AutocastDisabledGuard&) = delete;

 private:
  bool cpu_ = false;
  bool cuda_ = false;
};

/// Makes bf16 CPU autocast work for GroupNorm models. LibTorch 1.13's CPU autocast casts conv
/// outputs to bf16 but has no policy for group_norm, whose CPU kernel then fails on the fp32
/// weight ("expected scalar type BFloat16 but found Float"; the same bug breaks Accelerate +
/// Diffusers bf16 training on CPU). This registers an AutocastCPU kernel for aten::group_norm
/// that runs it in fp32 — CUDA autocast's policy for group_norm. Idempotent; the Accelerator
/// calls it at construction.
void install_autocast_fixes();

/// Dynamic loss-scaling settings (torch.cuda.amp.GradScaler's arguments and defaults).
struct GradScalerOptions {
  double init_scale = 65536.0;
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
};

/// Checkpointable state of a GradScaler.
struct GradScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;
};

/// Dynamic loss scaling for fp16 (torch.cuda.amp.GradScaler semantics): scale the loss, unscale
/// gradients once per step, skip the step when any rank saw inf/NaN, then back off or grow.
class GradScaler {
 public:
  /// `group`: found_inf is all-reduced (max) over it so every rank skips together; nullptr or a
  /// world of one decides locally.
  explicit GradScaler(GradScalerOptions options = {}, dist::ProcessGroup* group = nullptr);

  /// loss * scale.
  torch::Tensor scale(const torch::Tensor& loss) const;
  /// Divides every defined gradient of `params` by the scale (in float64 arithmetic of the
  /// factor) and decides found_inf over all ranks. A second call before update() is a no-op.
  void unscale_(const std::vector<torch::Tensor>& params);
  /// unscale_ if not done yet; runs `optimizer_step` unless found_inf. True when it ran.
  bool step(const std::vector<torch::Tensor>& params, const std::function<void()>& optimizer_step);
  /// After a step: on found_inf scale *= backoff and the tracker resets; otherwise the tracker
  /// counts up and the scale grows by growth_factor every growth_interval good steps.
  void update();

  double get_scale() const { return state_.scale; }
  bool found_inf() const { return found_inf_; }
  GradScalerState state() const { return state_; }
  void load_state(const GradScalerState& state);
  const GradScalerOptions& options() const { return options_; }

 private:
  GradScalerOptions options_;
  dist::ProcessGroup* group_;
  GradScalerState state_;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

}  // namespace difftrain::accel
