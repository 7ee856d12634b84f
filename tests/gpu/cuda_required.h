#pragma once
// What every gpu-label test starts with: REQUIRE_CUDA() skips on a machine without any CUDA
// device (saying so) and fails where a GPU exists that LibTorch cannot use; NoTf32 holds strict
// fp32 matmuls and convolutions for parity checks.

#include <ATen/Context.h>
#include <torch/cuda.h>

#include <gtest/gtest.h>

#include <filesystem>

namespace difftrain::gpu_test {

// A GPU is there when the NVIDIA kernel driver lists one, or GPU 0's device node exists.
// (/dev/nvidiactl alone proves nothing: the CUDA driver library, run as root, creates it even
// where there is no GPU.)
inline bool machine_has_nvidia_gpu() {
  namespace fs = std::filesystem;
  std::error_code ec;
  if (fs::exists("/dev/nvidia0", ec)) return true;
  const fs::path gpus = "/proc/driver/nvidia/gpus";
  return fs::is_directory(gpus, ec) && fs::directory_iterator(gpus, ec) != fs::directory_iterator();
}

// Skips the test when this machine has no CUDA device; fails it when a device exists but
// LibTorch cannot use it (a CPU-only LibTorch, a driver mismatch, a broken install).
#define REQUIRE_CUDA()                                                                     \
  do {                                                                                     \
    const bool seen = torch::cuda::is_available();                                         \
    if (!seen && !::difftrain::gpu_test::machine_has_nvidia_gpu()) {                       \
      GTEST_SKIP() << "no CUDA device on this machine (no /dev/nvidia0, no GPU in "        \
                      "/proc/driver/nvidia/gpus, torch::cuda::is_available() is false): "  \
                      "the gpu label needs one";                                           \
    }                                                                                      \
    ASSERT_TRUE(seen) << "this machine has an NVIDIA GPU but LibTorch sees no CUDA "       \
                         "device: a CPU-only LibTorch, or a driver/runtime mismatch (see " \
                         "`difftrain env`)";                                               \
  } while (0)

// Strict fp32 on the GPU for the parity checks: TF32 would change the last ~3 digits.
struct NoTf32 {
  NoTf32()
      : cudnn_(at::globalContext().allowTF32CuDNN()),
        matmul_(at::globalContext().allowTF32CuBLAS()) {
    at::globalContext().setAllowTF32CuDNN(false);
    at::globalContext().setAllowTF32CuBLAS(false);
  }
  ~NoTf32() {
    at::globalContext().setAllowTF32CuDNN(cudnn_);
    at::globalContext().setAllowTF32CuBLAS(matmul_);
  }
  bool cudnn_, matmul_;
};

}  // namespace difftrain::gpu_test
