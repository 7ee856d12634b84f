#include "difftrain/core/cpu_convolution_check.h"

#include "difftrain/core/log.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>

namespace difftrain::core {
namespace {

struct ConvCase {
  c10::ScalarType dtype;
  int64_t batch, in_channels, out_channels, kernel, size;
};

// Shapes that went wrong on Debian 13's LibTorch 2.6 (a 1-channel input gradient, a 24-channel
// forward, a 3-channel bf16 forward) and one ordinary UNet-sized layer.
constexpr ConvCase kCases[] = {
    {c10::kFloat, 2, 1, 1, 3, 4},   {c10::kFloat, 2, 24, 1, 3, 8},   {c10::kFloat, 2, 16, 16, 3, 8},
    {c10::kFloat, 2, 16, 32, 1, 8}, {c10::kBFloat16, 2, 3, 8, 3, 4},
};

double tolerance(c10::ScalarType dtype) { return dtype == c10::kBFloat16 ? 3e-2 : 1e-4; }

// max |a - b| / max |b|
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(1e-12, b.abs().max().item<double>());
  return (a.to(torch::kDouble) - b).abs().max().item<double>() / scale;
}

// The output and both gradients of conv2d(x, w, b) for the upstream gradient g, computed in dtype.
std::vector<torch::Tensor> conv_with_gradients(const torch::Tensor& x, const torch::Tensor& w,
                                               const torch::Tensor& b, const torch::Tensor& g,
                                               c10::ScalarType dtype, int64_t padding) {
  auto xx = x.to(dtype).detach().requires_grad_();
  auto ww = w.to(dtype).detach().requires_grad_();
  auto bb = b.to(dtype).detach().requires_grad_();
  auto y = torch::conv2d(xx, ww, bb, 1, padding);
  auto grads = torch::autograd::grad({y}, {xx, ww}, {g.to(dtype)});
  return {y.detach(), grads[0], grads[1]};
}

}  // namespace

double cpu_convolution_error(std::string* worst_case) {
  // Whatever the caller has on (inference mode, no-grad, autocast), the check runs plain autograd.
  c10::InferenceMode not_inference(false);
  torch::AutoGradMode grad_on(true);
  c10::impl::ExcludeDispatchKeyGuard no_autocast(c10::autocast_dispatch_keyset);
  const auto options = torch::TensorOptions().dtype(torch::kDouble);
  // A fixed generator, so the check neither depends on nor advances the caller's random stream.
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234);
  double worst = 0;
  for (const auto& c : kCases) {
    // Inputs rounded to the dtype first: the float64 reference then sees the same numbers.
    auto round = [&](torch::Tensor t) { return t.to(c.dtype).to(torch::kDouble); };
    const auto x = round(at::randn({c.batch, c.in_channels, c.size, c.size}, gen, options));
    const auto w =
        round(at::randn({c.out_channels, c.in_channels, c.kernel, c.kernel}, gen, options));
    const auto b = round(at::randn({c.out_channels}, gen, options));
    const auto g = round(at::randn({c.batch, c.out_channels, c.size, c.size}, gen, options));
    const int64_t padding = c.kernel / 2;
    const auto ref = conv_with_gradients(x, w, b, g, torch::kDouble, padding);
    const auto got = conv_with_gradients(x, w, b, g, c.dtype, padding);
    static const char* const kWhat[] = {"output", "input gradient", "weight gradient"};
    for (size_t i = 0; i < ref.size(); ++i) {
      const double e = relative_error(got[i], ref[i]) / tolerance(c.dtype);
      if (!(e <= worst)) {  // NaN counts as the worst
        worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : e;
        if (worst_case) {
          *worst_case = fmt::format(
              "{} {}x{} conv, {}->{} channels, {}x{} input, {} ({:.2g} relative)",
              c.dtype == c10::kBFloat16 ? "bf16" : "float32", c.kernel, c.kernel, c.in_channels,
              c.out_channels, c.size, c.size, kWhat[i], e * tolerance(c.dtype));
        }
      }
    }
  }
  return worst;
}

const CpuConvolutionCheck& ensure_correct_cpu_convolutions() {
  static CpuConvolutionCheck result;
  static std::once_flag once;
  std::call_once(once, []() {
    const char* skip = std::getenv("DIFFTRAIN_CHECK_CPU_CONVOLUTIONS");
    if ((skip && std::strcmp(skip, "0") == 0) || !at::hasMKLDNN() ||
        !at::globalContext().userEnabledMkldnn()) {
      return;
    }
    result.checked = true;
    result.worst_error = cpu_convolution_error(&result.worst_case);
    result.onednn_correct = result.worst_error < 1;
    if (result.onednn_correct) return;
    at::globalContext().setUserEnabledMkldnn(false);
    result.onednn_turned_off = true;
    std::string after;
    const double still = cpu_convolution_error(&after);
    if (still < 1) {
      log::warn(
          "LibTorch's oneDNN CPU convolutions are wrong on this machine ({}; Debian 13's "
          "LibTorch 2.6 with libdnnl 3.7 does this): turned ATen's oneDNN off for this process, "
          "so CPU convolutions take LibTorch's own kernels (right, somewhat slower). "
          "DIFFTRAIN_CHECK_CPU_CONVOLUTIONS=0 skips this check",
          result.worst_case);
    } else {
      log::warn(
          "LibTorch's CPU convolutions are wrong on this machine with oneDNN ({}) and without it "
          "({}): CPU training results will be wrong; use another LibTorch build "
          "(scripts/setup installs Debian 12's)",
          result.worst_case, after);
    }
  });
  return result;
}

std::string cpu_convolution_report() {
  const auto& r = ensure_correct_cpu_convolutions();
  if (!r.checked) {
    return at::hasMKLDNN()
               ? "not checked (DIFFTRAIN_CHECK_CPU_CONVOLUTIONS=0, or oneDNN already off)"
               : "LibTorch's own kernels (LibTorch has no oneDNN)";
  }
  if (r.onednn_correct) {
    return fmt::format("oneDNN, checked against float64 (worst {:.2g} of tolerance)",
                       r.worst_error);
  }
  return fmt::format("LibTorch's own kernels: oneDNN's were wrong ({}), so they are off",
                     r.worst_case);
}

}  // namespace difftrain::core
