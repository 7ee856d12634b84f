#pragma once
// What the training-step benchmarks share: the peak memory they report (CUDA: the caching
// allocator's peak allocated bytes since reset_peak_memory(), torch.cuda.max_memory_allocated;
// CPU: the process's peak RSS), a device synchronisation, main()'s one-line error, and the timed
// step loop of the transformer families' LoRA benches (Z-Image, Qwen-Image, Wan).

#include <torch/csrc/autograd/profiler.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <nlohmann/json.hpp>

#ifdef DIFFTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <fstream>
#include <memory>
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

/// The parts of one training step a bench times: forward + backward (to where the optimizer
/// starts) and the optimizer's step.
struct StepTimer {
  double forward_backward = 0, optimizer = 0;
  std::chrono::steady_clock::time_point mark = std::chrono::steady_clock::now();
  /// Starts a step.
  void start() { mark = std::chrono::steady_clock::now(); }
  /// Forward and backward done: the optimizer starts.
  void backward_done() {
    const auto now = std::chrono::steady_clock::now();
    forward_backward += std::chrono::duration<double>(now - mark).count();
    mark = now;
  }
  /// The optimizer's step done.
  void optimizer_done() {
    optimizer += std::chrono::duration<double>(std::chrono::steady_clock::now() - mark).count();
  }
};

/// A LoRA bench's loop: `warmup` untimed calls of step(timer), then `steps` timed ones (under
/// LibTorch's autograd profiler writing `profile` when it is not empty, for
/// bench/py/op_profile.py); step returns its loss. Adds the fields every bench prints to `out`:
/// steps, ms_per_step, ms_forward_backward, ms_optimizer, peak_mem_gib, final_loss.
template <typename Step>
void run_timed_steps(Step&& step, int64_t warmup, int64_t steps, const std::string& profile,
                     const torch::Device& device, nlohmann::json& out) {
  StepTimer timer;
  for (int64_t i = 0; i < warmup; ++i) step(timer);
  timer = StepTimer{};
  const auto start = std::chrono::steady_clock::now();
  torch::Tensor loss;
  {
    std::unique_ptr<torch::autograd::profiler::RecordProfile> recording;
    if (!profile.empty()) {
      recording = std::make_unique<torch::autograd::profiler::RecordProfile>(profile);
    }
    for (int64_t i = 0; i < steps; ++i) loss = step(timer);
  }
  synchronize(device);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
  const auto n = static_cast<double>(steps);
  out["steps"] = steps;
  out["ms_per_step"] = 1000.0 * seconds / n;
  out["ms_forward_backward"] = 1000.0 * timer.forward_backward / n;
  out["ms_optimizer"] = 1000.0 * timer.optimizer / n;
  out["peak_mem_gib"] = peak_memory(device).gib;
  out["final_loss"] = loss.item<double>();
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
