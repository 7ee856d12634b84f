#include "difftrain/accel/precision.h"

#include "difftrain/core/cpu_convolution_check.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/torch_compat.h"
#include "difftrain/distributed/collectives.h"

#include <ATen/autocast_mode.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>
#include <torch/torch.h>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <limits>
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
std::once_flag g_fp16_cpu_warning;
}  // namespace

void warn_fp16_on_cpu_once() {
  std::call_once(g_fp16_cpu_warning, []() {
    log::warn(
        "mixed_precision fp16: LibTorch has no fp16 autocast on CPU, so compute stays fp32; the "
        "dynamic loss scaler still runs. Use bf16 on CPU");
  });
}

AutocastGuard::AutocastGuard(MixedPrecision mp, torch::Device device) {
  if (mp == MixedPrecision::kNo) return;
  cuda_ = device.is_cuda();
  if (!cuda_ && mp == MixedPrecision::kFp16) {
    warn_fp16_on_cpu_once();
    return;
  }
  const at::ScalarType dtype = mp == MixedPrecision::kBf16 ? at::kBFloat16 : at::kHalf;
  if (cuda_) {
    previous_enabled_ = compat::autocast_enabled(c10::DeviceType::CUDA);
    previous_dtype_ = compat::autocast_dtype(c10::DeviceType::CUDA);
    compat::set_autocast_dtype(c10::DeviceType::CUDA, dtype);
    compat::set_autocast_enabled(c10::DeviceType::CUDA, true);
  } else {
    // A bf16 CPU scope without the norm fixes fails on the first GroupNorm / LayerNorm.
    install_autocast_fixes();
    previous_enabled_ = compat::autocast_enabled(c10::DeviceType::CPU);
    previous_dtype_ = compat::autocast_dtype(c10::DeviceType::CPU);
    compat::set_autocast_dtype(c10::DeviceType::CPU, dtype);
    compat::set_autocast_enabled(c10::DeviceType::CPU, true);
  }
  // The same per-thread nesting counter torch.autocast uses, so mixed C++/Python scopes agree on
  // which one is outermost.
  at::autocast::increment_nesting();
  active_ = true;
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
    compat::set_autocast_enabled(c10::DeviceType::CUDA, previous_enabled_);
    compat::set_autocast_dtype(c10::DeviceType::CUDA, previous_dtype_);
  } else {
    compat::set_autocast_enabled(c10::DeviceType::CPU, previous_enabled_);
    compat::set_autocast_dtype(c10::DeviceType::CPU, previous_dtype_);
  }
  // The cache holds bf16/fp16 copies of fp32 leaf weights keyed by tensor, not by version: it
  // must not outlive the scope, or the next forward would use weights from before the step.
  if (at::autocast::decrement_nesting() == 0) at::autocast::clear_cache();
}

AutocastDisabledGuard::AutocastDisabledGuard()
    : cpu_(compat::autocast_enabled(c10::DeviceType::CPU)),
      cuda_(compat::autocast_enabled(c10::DeviceType::CUDA)) {
  compat::set_autocast_enabled(c10::DeviceType::CPU, false);
  compat::set_autocast_enabled(c10::DeviceType::CUDA, false);
}

AutocastDisabledGuard::~AutocastDisabledGuard() {
  compat::set_autocast_enabled(c10::DeviceType::CPU, cpu_);
  compat::set_autocast_enabled(c10::DeviceType::CUDA, cuda_);
}

namespace {

// Autocast's fp32 policy for one argument: floating CPU tensors other than fp64 become fp32;
// everything else passes through (at::autocast::cached_cast never caches casts to fp32).
at::Tensor fp32(const at::Tensor& t) {
  return at::autocast::cached_cast(at::kFloat, t, c10::DeviceType::CPU);
}
c10::optional<at::Tensor> fp32(const c10::optional<at::Tensor>& t) {
  return at::autocast::cached_cast(at::kFloat, t, c10::DeviceType::CPU);
}

// aten::group_norm under CPU autocast: run in fp32 whatever the input dtype (CUDA autocast's
// policy), so a bf16 conv output meets its fp32 weight in one dtype. The autocast key is excluded
// while redispatching, so the call below reaches the autograd and CPU kernels; the casts are
// differentiable, so the input's gradient comes back in its own dtype.
at::Tensor group_norm_fp32(const at::Tensor& input, int64_t groups,
                           const c10::optional<at::Tensor>& weight,
                           const c10::optional<at::Tensor>& bias, double eps, bool cudnn) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  return at::group_norm(fp32(input), groups, fp32(weight), fp32(bias), eps, cudnn);
}

// aten::layer_norm, same policy (transformer blocks: a bf16 linear output into an fp32 LayerNorm).
at::Tensor layer_norm_fp32(const at::Tensor& input, at::IntArrayRef normalized_shape,
                           const c10::optional<at::Tensor>& weight,
                           const c10::optional<at::Tensor>& bias, double eps, bool cudnn) {
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::DispatchKey::AutocastCPU);
  return at::layer_norm(fp32(input), normalized_shape, fp32(weight), fp32(bias), eps, cudnn);
}

bool has_autocast_cpu_kernel(const char* op) {
  auto handle = c10::Dispatcher::singleton().findSchema({op, ""});
  return handle && handle->hasKernelForDispatchKey(c10::DispatchKey::AutocastCPU);
}

}  // namespace

void install_autocast_fixes() {
  core::ensure_correct_cpu_convolutions();  // bf16 convolutions go through oneDNN too
  static std::once_flag once;
  std::call_once(once, []() {
    // Registered at runtime rather than by a static TORCH_LIBRARY_IMPL: in a static library an
    // object file that nothing references is never linked, and its registration would silently
    // vanish. The fragment lives as long as the process.
    static torch::Library fixes(torch::Library::IMPL, "aten", c10::DispatchKey::AutocastCPU,
                                __FILE__, __LINE__);
    if (!has_autocast_cpu_kernel("aten::group_norm")) {
      fixes.impl("group_norm", TORCH_FN(group_norm_fp32));
    }
    if (!has_autocast_cpu_kernel("aten::layer_norm")) {
      fixes.impl("layer_norm", TORCH_FN(layer_norm_fp32));
    }
  });
}

// ------------------------------------------------------------------ loss scaling

void to_json(nlohmann::json& json, const GradScalerState& state) {
  json = nlohmann::json{{"scale", state.scale}, {"growth_tracker", state.growth_tracker}};
}

void from_json(const nlohmann::json& json, GradScalerState& state) {
  const bool has_scale = json.is_object() && json.contains("scale") && json.at("scale").is_number();
  const bool has_tracker = json.is_object() && json.contains("growth_tracker") &&
                           json.at("growth_tracker").is_number_integer();
  if (!has_scale || !has_tracker) {
    throw Error(fmt::format(
        "loss scaler state {} has no numeric '{}': expected {{\"scale\": s, \"growth_tracker\": "
        "n}} as GradScalerState saves it",
        json.dump(), has_scale ? "growth_tracker" : "scale"));
  }
  GradScalerState s;
  s.scale = json.at("scale").get<double>();
  s.growth_tracker = json.at("growth_tracker").get<int64_t>();
  if (!(s.scale > 0) || !std::isfinite(s.scale) || s.growth_tracker < 0) {
    throw Error(fmt::format(
        "loss scaler state: scale {} / growth_tracker {} is not valid: the scale must be finite "
        "and > 0 and the tracker >= 0",
        s.scale, s.growth_tracker));
  }
  state = s;
}

GradScaler::GradScaler(GradScalerOptions options, distributed::ProcessGroup* group)
    : options_(options), group_(group) {
  if (!(options_.init_scale > 0) || !std::isfinite(options_.init_scale) ||
      !(options_.growth_factor > 1) ||
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

torch::Tensor GradScaler::scale(const torch::Tensor& loss) const {
  // 65536 * a half loss overflows fp16; torch promotes through its fp32 scale tensor, so do we.
  if (loss.scalar_type() == at::kHalf || loss.scalar_type() == at::kBFloat16) {
    return loss.to(at::kFloat) * state_.scale;
  }
  return loss * state_.scale;
}

void GradScaler::unscale_(const std::vector<torch::Tensor>& params) {
  if (unscaled_) return;
  unscaled_ = true;
  torch::NoGradGuard no_grad;
  // One sum per gradient, all summed on the device and read back once: a sum is inf/NaN whenever
  // an element is. Only a gradient whose finite sum overflows fp32 (elements ~1e30, an unusable
  // step anyway) would be counted as inf by this test but not by torch's elementwise check.
  std::vector<torch::Tensor> sums;
  c10::optional<torch::Device> device;
  for (size_t i = 0; i < params.size(); ++i) {
    torch::Tensor g = params[i].grad();
    if (!g.defined()) continue;
    if (g.is_sparse()) {
      throw Error(fmt::format(
          "loss scaling: parameter {} has a sparse gradient; fp16 loss scaling needs dense "
          "gradients (build the embedding with sparse=false)",
          i));
    }
    if (!device) device = g.device();
    if (g.scalar_type() == at::kHalf || g.scalar_type() == at::kBFloat16) {
      // In fp32 (1/65536 or a large scale are not representable in fp16), rounded once; check the
      // rounded values, since a quotient above 65504 becomes inf in fp16.
      g.copy_(g.to(at::kFloat).div_(state_.scale));
      sums.push_back(g.sum(at::kFloat));
    } else {
      // A division, not a multiplication by 1/scale: the result is exactly the float64 quotient
      // rounded to the gradient's dtype for any scale representable in it.
      g.div_(state_.scale);
      sums.push_back(g.sum());
    }
  }
  const bool grouped = group_ != nullptr && group_->size() > 1;
  if (!device) {
    device = grouped && group_->backend_name() == "nccl" ? torch::Device(torch::kCUDA)
                                                         : torch::Device(torch::kCPU);
  }
  torch::Tensor flag = torch::zeros({1}, torch::TensorOptions().dtype(at::kFloat).device(*device));
  if (!sums.empty()) {
    for (auto& s : sums) s = s.to(*device, at::kDouble);
    flag = torch::isfinite(torch::stack(sums).sum()).logical_not().to(at::kFloat).reshape({1});
  }
  if (grouped) distributed::all_reduce(flag, distributed::ReduceOp::kMax, *group_);
  found_inf_ = flag.item<float>() > 0;
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
    // As torch's update kernel: never grow to a scale the fp32 loss cannot hold.
    const double grown = state_.scale * options_.growth_factor;
    if (grown <= std::numeric_limits<float>::max()) state_.scale = grown;
    state_.growth_tracker = 0;
  }
  unscaled_ = false;
  found_inf_ = false;
}

void GradScaler::load_state(const GradScalerState& state) {
  if (!(state.scale > 0) || !std::isfinite(state.scale) || state.growth_tracker < 0) {
    throw Error(fmt::format(
        "loss scaler state: scale {} / growth_tracker {} is not valid: the scale must be finite "
        "and > 0 and the tracker >= 0",
        state.scale, state.growth_tracker));
  }
  state_ = state;
  unscaled_ = false;
  found_inf_ = false;
}

}  // namespace difftrain::accel
