#pragma once
// What the training-step benchmarks share: the peak memory they report (CUDA: the caching
// allocator's peak allocated bytes since reset_peak_memory(), torch.cuda.max_memory_allocated;
// CPU: the process's peak RSS), a device synchronisation, and main()'s one-line error.

#include <torch/cuda.h>
#include <torch/types.h>

#ifdef DIFFTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <cstdio>
#include <exception>
#include <fstream>
#include <string>

namespace difftrain::bench {

inline void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

/// Starts the peak count over (CUDA only: a process's peak RSS cannot be reset).
inline void reset_peak_memory(const torch::Device& device) {
#ifdef DIFFTRAIN_WITH_CUDA
  if (device.is_cuda()) c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
#else
  (void)device;
#endif
}

struct PeakMemory {
  double gib = 0;
  std::string kind;         ///< "max_memory_allocated" or "peak RSS"
  std::string device_name;  ///< the GPU's name; "" on the CPU
};

inline PeakMemory peak_memory(const torch::Device& device) {
  PeakMemory out;
#ifdef DIFFTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device.index());
    out.gib = static_cast<double>(stats.allocated_bytes[0].peak) / (1 << 30);
    out.kind = "max_memory_allocated";
    out.device_name = at::cuda::getDeviceProperties(device.index())->name;
    return out;
  }
#else
  (void)device;
#endif
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmHWM:", 0) == 0) out.gib = std::stod(line.substr(6)) / (1024.0 * 1024.0);
  }
  out.kind = "peak RSS";
  return out;
}

/// main()'s body: `run()`, with an exception printed as one line "NAME: what" and exit 1.
template <typename Run>
int run_main(const char* name, Run run) {
  try {
    return run();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "%s: %s\n", name, e.what());
    return 1;
  }
}

}  // namespace difftrain::bench
