#include "difftrain/accel/precision.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/dist/collectives.h"

#include <ATen/autocast_mode.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cctype>
#include <cmath>
#include <mutex>

namespace difftrain::accel {

MixedPrecision parse_mixed_precision(const std::string& text) {
  std::string lower = text;
  std::transform(lower.begin(), lower.end(), lower.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  if (lower == "no") return MixedPrecision::kNo;
  if (lower == "bf16") return MixedPrecision::kBf16;
  if (lower == "fp16") return MixedPrecision::kFp16;
  throw Error(fmt::format("mixed_precision '{}' is not one of no, bf16, fp16", text));
}

const char* to_string(MixedPrecision mp) {
  switch (mp) {
    case MixedPrecision::kNo: return "no";
    case MixedPrecision::kBf16: return "bf16";
    case MixedPrecision::kFp16: return "fp16";
  }
  return "?";
}

// ------------------------------------------------------------------ autocast

namespace {
// Autocast nesting depth of this thread: the cast cache is cleared when the outermost exits.
thread_local int t_depth = 0;
std::once_flag g_fp16_cpu_warning;
}  // namespace

AutocastGuard::AutocastGuard(MixedPrecision mp, torch::Device device) {
  if (mp == MixedPrecision::kNo) return;
  cuda_ = device.is_cuda();
  if (!cuda_ && mp == MixedPrecision::kFp16) {
    std::call_once(g_fp16_cpu_warning, []() {
      log::warn("fp16 autocast does not exist on CPU in LibTorch 1.13: computing in fp32");
    });
    return;
  }
  const at::ScalarType dtype = mp == MixedPrecision::kBf16 ? at::kBFloat16 : at::kHalf;
  active_ = true;
  if (cuda_) {
    previous_enabled_ = at::autocast::is_enabled();
    previous_dtype_ = at::autocast::get_autocast_gpu_dtype();
    at::autocast::set_autocast_gpu_dtype(dtype);
    at::autocast::set_enabled(true);
  } else {
    previous_enabled_ = at::autocast::is_cpu_enabled();
    previous_dtype_ = at::autocast::get_autocast_cpu_dtype();
    at::autocast::set_autocast_cpu_dtype(dtype);
    at::autocast::set_cpu_enabled(true);
  }
  ++t_depth;
}

AutocastGuard::AutocastGuard(AutocastGuard&& other) noexcept
    : active_(other.active_),
      cuda_(other.cuda_),
      previous_enabled_(other.previous_enabled_),
      previous_dtype_(other.previous_dtype_) {
  other.active_ = false;
}

AutocastGuard::~AutocastGuard() {
  if (!active_) return;
  if (cuda_) {
    at::autocast::set_enabled(previous_enabled_);
    at::autocast::set_autocast_gpu_dtype(previous_dtype_);
  } else {
    at::autocast::set_cpu_enabled(previous_enabled_);
    at::autocast::set_autocast_cpu_dtype(previous_dtype_);
  }
  if (--t_depth == 0) at::autocast::clear_cache();
}

AutocastDisabledGuard::AutocastDisabledGuard()
    : cpu_(at::autocast::is_cpu_enabled()), cuda_(at::autocast::is_enabled()) {
  at::autocast::set_cpu_enabled(false);
  at::autocast::set_enabled(false);
}

AutocastDisabledGuard::~AutocastDisabledGuard() {
  at::autocast::set_cpu_enabled(cpu_);
  at::autocast::set_enabled(cuda_);
}

namespace {

c10::optional<at::Tensor> to_float(const c10::optional<at::Tensor>& t) {
  if (t && t->defined() && t->is_floating_point()) return t->to(at::kFloat);
  return t;
}

// aten::group_norm under CPU autocast: run in fp32 whatever the input dtype (CUDA autocast's
// fp32 policy for group_norm), so a bf16 conv output meets its fp32 weight in one dtype.
at::Tensor group_norm_fp32(const at::Tensor& input, int64_t groups,
                           const c10::optional<at::Tensor>& weight,
                           const c10::optional<at::Tensor>& bias, double eps, bool cudnn) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  const at::Tensor x = input.is_floating_point() ? input.to(at::kFloat) : input;
  return at::group_norm(x, groups, to_float(weight), to_float(bias), eps, cudnn);
}

}  // namespace

void install_autocast_fixes() {
  static std::once_flag once;
  std::call_once(once, []() {
    // A library fragment that lives as long as the process.
    static torch::Library fixes(torch::Library::IMPL, "aten", c10::DispatchKey::AutocastCPU,
                                __FILE__, __LINE__);
    fixes.impl("group_norm", TORCH_FN(group_norm_fp32));
  });
}

// ------------------------------------------------------------------ loss scaling

GradScaler::GradScaler(GradScalerOptions options, dist::ProcessGroup* group)
    : options_(options), group_(group) {
  if (!(options_.init_scale > 0) || !(options_.growth_factor > 1) ||
      !(options_.backoff_factor > 0 && options_.backoff_factor < 1) ||
      options_.growth_interval < 1) {
    throw Error(fmt::format(
        "loss scaler options: need init_scale > 0, growth_factor > 1, 0 < backoff_factor < 1 and "
        "growth_interval >= 1, got {}, {}, {}, {}",
        options_.init_scale, options_.growth_factor, options_.backoff_factor,
        options_.growth_interval));
  }
  state_.scale = options_.init_scale;
}

torch::Tensor GradScaler::scale(const torch::Tensor& loss) const { return loss * state_.scale; }

void GradScaler::unscale_(const std::vector<torch::Tensor>& params) {
  if (unscaled_) return;
  unscaled_ = true;
  torch::NoGradGuard no_grad;
  const double inverse = 1.0 / state_.scale;
  bool local_inf = false;
  for (const auto& p : params) {
    if (!p.grad().defined()) continue;
    auto g = p.grad();
    g.mul_(inverse);
    // One reduction per tensor: a sum is inf/NaN whenever any element is (or overflows, which
    // also means the step is unusable).
    if (!local_inf && !std::isfinite(g.sum().item<double>())) local_inf = true;
  }
  found_inf_ = local_inf;
  if (group_ != nullptr && group_->size() > 1) {
    auto flag = torch::tensor({local_inf ? 1.0f : 0.0f});
    dist::all_reduce(flag, dist::ReduceOp::kMax, *group_);
    found_inf_ = flag.item<float>() > 0;
  }
}

bool GradScaler::step(const std::vector<torch::Tensor>& params,
                      const std::function<void()>& optimizer_step) {
  unscale_(params);
  if (found_inf_) return false;
  optimizer_step();
  return true;
}

void GradScaler::update() {
  if (found_inf_) {
    state_.scale *= options_.backoff_factor;
    state_.growth_tracker = 0;
  } else if (++state_.growth_tracker >= options_.growth_interval) {
    state_.scale *= options_.growth_factor;
    state_.growth_tracker = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
}

void GradScaler::load_state(const GradScalerState& state) {
  if (!(state.scale > 0) || !std::isfinite(state.scale) || state.growth_tracker < 0) {
    throw Error(fmt::format("loss scaler state: scale {} / growth_tracker {} is not valid",
                            state.scale, state.growth_tracker));
  }
  state_ = state;
  unscaled_ = false;
  found_inf_ = false;
}

}  // namespace difftrain::accel
