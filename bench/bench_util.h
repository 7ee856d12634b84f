#pragma once
// What the training-step benchmarks share: the peak memory they report (CUDA: the caching
// allocator's peak allocated bytes since reset_peak_memory(), torch.cuda.max_memory_allocated;
// CPU: the process's peak RSS since reset_peak_memory()), a device synchronisation, main()'s
// one-line error, and the timed step loop of the transformer families' LoRA benches (Z-Image,
// Qwen-Image, Wan).

#include "op_shapes.h"

#include <torch/csrc/autograd/profiler.h>
#include <torch/cuda.h>
#include <torch/types.h>
#include <nlohmann/json.hpp>

#ifdef DIFFTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDACachingAllocator.h>
#endif

#include <dlfcn.h>
#include <chrono>
#include <cstdint>
#include <cstdio>

#include <algorithm>
#include <exception>
#include <fstream>
#include <memory>
#include <string>
#include <vector>

namespace difftrain::bench {

inline void synchronize(const torch::Device& device) {
  if (device.is_cuda()) torch::cuda::synchronize(device.index());
}

/// The resident set now, in GiB (CPU; /proc/self/status VmRSS).
inline double resident_gib() {
  std::ifstream status("/proc/self/status");
  for (std::string line; std::getline(status, line);) {
    if (line.rfind("VmRSS:", 0) == 0) return std::stod(line.substr(6)) / (1024.0 * 1024.0);
  }
  return 0;
}

/// bench/alloc_peak.c's counters when it is LD_PRELOADed (null functions otherwise).
struct HeapCounter {
  void (*reset)() = nullptr;
  long long (*peak)() = nullptr;
  long long (*live)() = nullptr;
  HeapCounter() {
    reset = reinterpret_cast<void (*)()>(dlsym(RTLD_DEFAULT, "alloc_peak_reset"));
    peak = reinterpret_cast<long long (*)()>(dlsym(RTLD_DEFAULT, "alloc_peak_bytes"));
    live = reinterpret_cast<long long (*)()>(dlsym(RTLD_DEFAULT, "alloc_live_bytes"));
    if (!reset || !peak || !live) reset = nullptr;
  }
  bool present() const { return reset != nullptr; }
};

/// Starts the peak count over: CUDA, the caching allocator's peak; CPU, the process's peak RSS
/// (VmHWM), reset to the current RSS by writing 5 to /proc/self/clear_refs, as the Python peers
/// do, so both sides' "peak during the timed steps" is the same measure.
inline void reset_peak_memory(const torch::Device& device) {
#ifdef DIFFTRAIN_WITH_CUDA
  if (device.is_cuda()) {
    c10::cuda::CUDACachingAllocator::resetPeakStats(device.index());
    return;
  }
#endif
  if (!device.is_cuda()) {
    std::ofstream("/proc/self/clear_refs") << "5";
    if (const HeapCounter heap; heap.present()) heap.reset();
  }
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

/// A training bench's loop: `warmup` untimed calls of step(timer), then `steps` timed ones (under
/// LibTorch's autograd profiler writing `profile` when it is not empty, for
/// bench/py/op_profile.py; a name ending in .shapes: bench/op_shapes.h's table instead); step
/// returns its loss. The peak memory is reset after the warm-up. Adds the fields every bench prints
/// to `out`: steps, ms_per_step (the median of the timed steps, as the Python peers report it),
/// ms_forward_backward, ms_optimizer (means), rss_before_steps_gib (CPU), peak_mem_gib (during the
/// timed steps), peak_mem_kind, final_loss; with bench/alloc_peak.c preloaded also
/// heap_before_steps_gib and peak_heap_gib (CPU).
template <typename Step>
void run_timed_steps(Step&& step, int64_t warmup, int64_t steps, const std::string& profile,
                     const torch::Device& device, nlohmann::json& out) {
  StepTimer timer;
  for (int64_t i = 0; i < warmup; ++i) step(timer);
  synchronize(device);
  reset_peak_memory(device);
  const double rss_before = device.is_cuda() ? 0.0 : resident_gib();
  const HeapCounter heap;
  const double heap_before = heap.present() ? static_cast<double>(heap.live()) / (1 << 30) : 0.0;
  timer = StepTimer{};
  std::vector<double> step_seconds;
  torch::Tensor loss;
  {
    std::unique_ptr<torch::autograd::profiler::RecordProfile> recording;
    std::unique_ptr<OpShapeProfile> shapes;
    const std::string kShapes = ".shapes";
    if (profile.size() > kShapes.size() &&
        profile.compare(profile.size() - kShapes.size(), kShapes.size(), kShapes) == 0) {
      shapes = std::make_unique<OpShapeProfile>(profile);
    } else if (!profile.empty()) {
      recording = std::make_unique<torch::autograd::profiler::RecordProfile>(profile);
    }
    for (int64_t i = 0; i < steps; ++i) {
      const auto start = std::chrono::steady_clock::now();
      loss = step(timer);
      synchronize(device);
      step_seconds.push_back(
          std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
  }
  std::sort(step_seconds.begin(), step_seconds.end());
  const size_t n_steps = step_seconds.size();
  const double median = n_steps == 0 ? 0.0
                        : n_steps % 2 == 1
                            ? step_seconds[n_steps / 2]
                            : 0.5 * (step_seconds[n_steps / 2 - 1] + step_seconds[n_steps / 2]);
  const auto n = static_cast<double>(steps);
  const auto peak = peak_memory(device);
  out["steps"] = steps;
  out["ms_per_step"] = 1000.0 * median;
  out["ms_forward_backward"] = 1000.0 * timer.forward_backward / n;
  out["ms_optimizer"] = 1000.0 * timer.optimizer / n;
  if (!device.is_cuda()) out["rss_before_steps_gib"] = rss_before;
  if (!device.is_cuda() && heap.present()) {
    // bench/alloc_peak.c: the bytes malloc has handed out and not taken back.
    out["heap_before_steps_gib"] = heap_before;
    out["peak_heap_gib"] = static_cast<double>(heap.peak()) / (1 << 30);
  }
  out["peak_mem_gib"] = peak.gib;
  out["peak_mem_kind"] = device.is_cuda() ? peak.kind : "peak RSS during the timed steps";
  if (!peak.device_name.empty()) out["gpu"] = peak.device_name;
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
