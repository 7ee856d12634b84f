#pragma once

// LibTorch's CPU convolutions (ATen's oneDNN kernels) checked against float64 once per process.
//
// Debian 13's LibTorch 2.6 with its oneDNN (libdnnl 3.7.2) computes many float32 and bf16 CPU
// convolutions wrongly: on an AVX-512 CPU 121 of 720 small 1x1/3x3 shapes, on the same CPU capped
// to AVX2 88 of them, had outputs 20-60% or input gradients 50-110% off (docs/LIBTORCH.md).
// LibTorch's own convolution kernels (im2col + BLAS), which ATen uses when oneDNN is off, are right
// on all of them. So every entry point that runs convolutions (the Accelerator, the UNet and VAE
// constructors, bf16 autocast) calls ensure_correct_cpu_convolutions(): a few convolutions in
// float32 and bf16 against float64, and if any is wrong, ATen's oneDNN is turned off for the
// process (at::globalContext().setUserEnabledMkldnn(false)) with one warning.

#include <string>

namespace difftrain::core {

/// What the check found. `checked` is false where DIFFTRAIN_CHECK_CPU_CONVOLUTIONS=0 skipped it
/// or LibTorch has no oneDNN.
struct CpuConvolutionCheck {
  bool checked = false;
  bool onednn_correct = true;      ///< every case within tolerance with oneDNN on
  bool onednn_turned_off = false;  ///< the check turned ATen's oneDNN off
  double worst_error = 0;          ///< largest error / tolerance seen with oneDNN on (< 1: pass)
  double seconds = 0;              ///< how long the check took
  std::string worst_case;          ///< e.g. "float32 3x3 conv, 1->1 channels, input gradient"
};

/// Runs the check once per process (thread-safe; later calls return the first result) and turns
/// ATen's oneDNN off when it fails. Also safe inside InferenceMode, NoGradGuard and autocast.
const CpuConvolutionCheck& ensure_correct_cpu_convolutions();

/// Measures, with ATen's oneDNN in whatever state it is now, the largest error / tolerance of the
/// check's cases against float64 (< 1: all pass), and names the worst case in *worst_case.
double cpu_convolution_error(std::string* worst_case = nullptr);

/// One line for `difftrain env`: the check's result.
std::string cpu_convolution_report();

}  // namespace difftrain::core
