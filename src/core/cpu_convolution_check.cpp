#include "difftrain/core/cpu_convolution_check.h"

#include "difftrain/core/log.h"

#include <ATen/CPUGeneratorImpl.h>
#include <ATen/Context.h>
#include <c10/core/DispatchKeySet.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/torch.h>

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
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
  bool input_gradient;  // check the gradient of the input, else the output
};

// Shapes that went wrong on Debian 13's LibTorch 2.6: a 1-channel 3x3 layer's input gradient, a
// 24-channel forward, a 3-channel bf16 forward. Few, and only what each needs, because every
// primitive oneDNN meets costs it a JIT compile at start-up.
constexpr ConvCase kCases[] = {
    {c10::kFloat, 2, 1, 1, 3, 4, true},
    {c10::kFloat, 2, 24, 1, 3, 8, false},
    {c10::kBFloat16, 2, 3, 8, 3, 4, false},
};

double tolerance(c10::ScalarType dtype) { return dtype == c10::kBFloat16 ? 3e-2 : 1e-4; }

// max |a - b| / max |b|
double relative_error(const torch::Tensor& a, const torch::Tensor& b) {
  const double scale = std::max(1e-12, b.abs().max().item<double>());
  return (a.to(torch::kDouble) - b).abs().max().item<double>() / scale;
}

// conv2d(x, w) (stride 1, same padding) in dtype, or the gradient of its input for the upstream
// gradient g; no autograd, so it runs under any grad mode.
torch::Tensor conv_or_input_gradient(const ConvCase& c, const torch::Tensor& x,
                                     const torch::Tensor& w, const torch::Tensor& g,
                                     c10::ScalarType dtype) {
  const std::vector<int64_t> stride{1, 1}, padding{c.kernel / 2, c.kernel / 2}, dilation{1, 1},
      output_padding{0, 0};
  if (!c.input_gradient) {
    return at::convolution(x.to(dtype), w.to(dtype), {}, stride, padding, dilation, false,
                           output_padding, 1);
  }
  return std::get<0>(at::convolution_backward(g.to(dtype), x.to(dtype), w.to(dtype), c10::nullopt,
                                              stride, padding, dilation, false, output_padding, 1,
                                              {true, false, false}));
}

}  // namespace

double cpu_convolution_error(std::string* worst_case) {
  // Whatever the caller has on (inference mode, autocast), the check runs plain kernels.
  c10::InferenceMode not_inference(false);
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
    const auto g = round(at::randn({c.batch, c.out_channels, c.size, c.size}, gen, options));
    const auto ref = conv_or_input_gradient(c, x, w, g, torch::kDouble);
    const auto got = conv_or_input_gradient(c, x, w, g, c.dtype);
    const double e = relative_error(got, ref) / tolerance(c.dtype);
    if (!(e <= worst)) {  // NaN counts as the worst
      worst = std::isnan(e) ? std::numeric_limits<double>::infinity() : e;
      if (worst_case) {
        *worst_case =
            fmt::format("{} {}x{} conv, {}->{} channels, {}x{} input, {} ({:.2g} relative)",
                        c.dtype == c10::kBFloat16 ? "bf16" : "float32", c.kernel, c.kernel,
                        c.in_channels, c.out_channels, c.size, c.size,
                        c.input_gradient ? "input gradient" : "output", e * tolerance(c.dtype));
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
    const auto start = std::chrono::steady_clock::now();
    result.worst_error = cpu_convolution_error(&result.worst_case);
    result.seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
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
    return fmt::format("oneDNN, checked against float64 in {:.0f} ms (worst {:.2g} of tolerance)",
                       r.seconds * 1e3, r.worst_error);
  }
  return fmt::format(
      "LibTorch's own kernels: oneDNN's were wrong ({}; checked in {:.0f} ms), so they are off",
      r.worst_case, r.seconds * 1e3);
}

}  // namespace difftrain::core
