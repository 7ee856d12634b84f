#pragma once
// Mixed precision (Accelerate's `mixed_precision`): the mode, autocast scopes with the CPU bf16
// fixes LibTorch 1.13 needs, and dynamic loss scaling for fp16.

#include "difftrain/distributed/process_group.h"

#include <torch/types.h>
#include <nlohmann/json_fwd.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

namespace difftrain::accel {

/// Mixed precision mode. Accelerate: `Accelerator(mixed_precision="no" | "bf16" | "fp16")`.
enum class MixedPrecision { kNo, kBf16, kFp16 };

/// "no" | "bf16" | "fp16", case-insensitive (exactly Accelerate's three values of
/// `--mixed_precision`). Anything else throws difftrain::Error listing the valid values.
MixedPrecision parse_mixed_precision(const std::string& text);
/// "no", "bf16" or "fp16": what parse_mixed_precision() reads back.
const char* to_string(MixedPrecision mp);

// ------------------------------------------------------------------ autocast

/// Logs, once per process, that fp16 on the CPU computes in fp32 (LibTorch has no CPU fp16
/// autocast): the Accelerator calls it when built, AutocastGuard at its first fp16 CPU scope.
void warn_fp16_on_cpu_once();

/// Autocast for a scope. torch: `with torch.autocast(device_type, dtype)`; Accelerate:
/// `with accelerator.autocast()`. kNo does nothing.
/// CPU: bf16 CPU autocast (call install_autocast_fixes() once so GroupNorm / LayerNorm models
/// work). fp16 on CPU: LibTorch 1.13 has no fp16 CPU autocast, so the scope computes in fp32 (the
/// loss scaler still runs) and a warning is logged once per process. CUDA: CUDA autocast in fp16
/// or bf16. Nestable: the previous state is restored on exit, and autocast's cast cache (the
/// low-precision copies of fp32 weights) is cleared when the outermost scope of the thread exits,
/// as torch.autocast does, so an optimizer step between two scopes is always seen.
/// Autocast state is per thread.
class [[nodiscard]] AutocastGuard {
 public:
  AutocastGuard(MixedPrecision mp, torch::Device device);
  ~AutocastGuard();
  /// Moving hands the scope over (so `auto scope = accelerator.autocast();` works).
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

/// Turns CPU and CUDA autocast off for a scope, restoring both after (used around backward).
/// torch: `with torch.autocast(device_type, enabled=False)`.
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

/// Makes bf16 CPU autocast work for GroupNorm and LayerNorm models. LibTorch 1.13's CPU autocast
/// runs conv / linear / matmul in bf16 but has no policy for group_norm or layer_norm, whose CPU
/// kernels then fail on the fp32 weight ("expected scalar type BFloat16 but found Float"; the same
/// gap breaks Accelerate + Diffusers bf16 training on CPU). This registers AutocastCPU kernels for
/// aten::group_norm and aten::layer_norm that run them in fp32 — CUDA autocast's policy for both —
/// for any caller (torch::nn::GroupNorm, torch::group_norm, F::layer_norm...). An op whose
/// AutocastCPU slot is already taken (a newer LibTorch) is left alone. Idempotent and thread-safe;
/// the Accelerator calls it at construction. There is no torch equivalent.
void install_autocast_fixes();

// ------------------------------------------------------------------ loss scaling

/// Dynamic loss-scaling settings: torch.cuda.amp.GradScaler's arguments and defaults.
struct GradScalerOptions {
  double init_scale = 65536.0;     ///< first scale (`init_scale=2.**16`)
  double growth_factor = 2.0;      ///< scale *= this after growth_interval good steps
  double backoff_factor = 0.5;     ///< scale *= this after a step with inf/NaN gradients
  int64_t growth_interval = 2000;  ///< good steps in a row before growing
};

/// Checkpointable state of a GradScaler (torch: `scaler.state_dict()`'s "scale" and
/// "_growth_tracker").
struct GradScalerState {
  double scale = 65536.0;
  int64_t growth_tracker = 0;
};

/// {"scale": s, "growth_tracker": n} (nlohmann ADL hook, so `json j = state` works).
void to_json(nlohmann::json& json, const GradScalerState& state);
/// Reads what to_json wrote; throws difftrain::Error naming a missing, non-numeric or out-of-range
/// field (scale must be finite and > 0, growth_tracker >= 0).
void from_json(const nlohmann::json& json, GradScalerState& state);

/// Dynamic loss scaling for fp16 (torch.cuda.amp.GradScaler semantics; Accelerate keeps one as
/// `accelerator.scaler`): scale the loss, unscale the gradients once per step, skip the step when
/// any rank saw inf/NaN, then back off or grow the scale.
class GradScaler {
 public:
  /// `group`: found_inf is all-reduced (max of a 0/1 flag) over it so every rank skips the same
  /// steps; nullptr or a world of one decides locally. Throws difftrain::Error on options outside
  /// init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1, growth_interval >= 1.
  explicit GradScaler(GradScalerOptions options = {}, distributed::ProcessGroup* group = nullptr);

  /// loss * scale (any shape and dtype). torch: `scaler.scale(loss)`.
  torch::Tensor scale(const torch::Tensor& loss) const;
  /// Divides every defined gradient of `params` by the scale in place (fp32/fp64 gradients by an
  /// exact division; fp16/bf16 ones computed in fp32 and rounded once) and decides found_inf: any
  /// inf/NaN in any gradient on any rank. One host sync (plus one all-reduce in a group).
  /// A second call before update() is a no-op. torch: `scaler.unscale_(optimizer)`.
  void unscale_(const std::vector<torch::Tensor>& params);
  /// unscale_ if not done yet this step; runs `optimizer_step` unless found_inf. Returns true
  /// when the step ran. torch: `scaler.step(optimizer)`.
  bool step(const std::vector<torch::Tensor>& params, const std::function<void()>& optimizer_step);
  /// Ends the step: on found_inf scale *= backoff_factor and the tracker resets; otherwise the
  /// tracker counts up and the scale grows by growth_factor when it reaches growth_interval
  /// (never to inf). Resets the per-step unscale state. torch: `scaler.update()`.
  void update();

  /// The current scale. torch: `scaler.get_scale()`.
  double get_scale() const { return state_.scale; }
  /// True when this step's unscale_ saw inf/NaN (on any rank); false again after update().
  bool found_inf() const { return found_inf_; }
  /// torch: `scaler.state_dict()`.
  GradScalerState state() const { return state_; }
  /// Restores a state(); throws difftrain::Error on a scale that is not finite and > 0 or a
  /// negative tracker. torch: `scaler.load_state_dict()`.
  void load_state(const GradScalerState& state);
  /// The options this scaler was built with.
  const GradScalerOptions& options() const { return options_; }

 private:
  GradScalerOptions options_;
  distributed::ProcessGroup* group_;
  GradScalerState state_;
  bool unscaled_ = false;
  bool found_inf_ = false;
};

}  // namespace difftrain::accel
