#include "difftrain/launch/env_report.h"

#include "difftrain/core/cpu_convolution_check.h"
#include "difftrain/distributed/shm_allreduce.h"
#include "difftrain/launch/config.h"
#include "difftrain/launch/cuda_info.h"
#include "difftrain/launch/launcher.h"
#include "difftrain/version.h"

#include <ATen/Parallel.h>
#include <torch/cuda.h>
#include <torch/torch.h>
#include <torch/version.h>

#include <fmt/format.h>
#include <link.h>

#include <chrono>
#include <climits>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <thread>

namespace difftrain::launch {

namespace {

int collect_blas(dl_phdr_info* info, size_t, void* data) {
  auto* found = static_cast<std::string*>(data);
  const std::string name = info->dlpi_name ? info->dlpi_name : "";
  const auto slash = name.rfind('/');
  const std::string base = name.substr(slash == std::string::npos ? 0 : slash + 1);
  if (found->empty() && (base.rfind("libblas", 0) == 0 || base.rfind("libopenblas", 0) == 0 ||
                         base.rfind("libmkl_rt", 0) == 0 || base.rfind("libblis", 0) == 0)) {
    *found = name;
  }
  return 0;
}

std::string getenv_or(const char* name, const std::string& fallback) {
  const char* value = std::getenv(name);
  return value && *value ? value : fallback;
}

std::string cpu_summary() {
  std::ifstream in("/proc/cpuinfo");
  std::string line, model = "unknown", flags;
  while (std::getline(in, line)) {
    if (model == "unknown" && line.rfind("model name", 0) == 0)
      model = line.substr(line.find(':') + 2);
    if (flags.empty() && line.rfind("flags", 0) == 0) flags = line.substr(line.find(':') + 2);
  }
  std::set<std::string> present;
  std::istringstream words(flags);
  for (std::string w; words >> w;) present.insert(w);
  std::string features;
  for (const char* f : {"sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw",
                        "avx512_bf16", "avx512_vnni", "amx_bf16"}) {
    if (present.count(f)) features += (features.empty() ? "" : " ") + std::string(f);
  }
  return model + "; features: " + (features.empty() ? "none of note" : features);
}

}  // namespace

BlasInfo detect_blas() {
  // One matmul makes sure LibTorch has loaded (and bound) its BLAS.
  (void)torch::mm(torch::ones({2, 2}), torch::ones({2, 2}));
  std::string name;
  dl_iterate_phdr(collect_blas, &name);
  BlasInfo info;
  if (name.empty()) {
    info.kind = "unknown";
    info.library = "(no libblas loaded)";
    return info;
  }
  std::error_code ec;
  const auto real = std::filesystem::canonical(name, ec);
  info.library = ec ? name : real.string();
  const std::string& path = info.library;
  if (path.find("openblas") != std::string::npos) {
    info.kind = "openblas";
  } else if (path.find("blis") != std::string::npos) {
    info.kind = "blis";
  } else if (path.find("mkl") != std::string::npos) {
    info.kind = "mkl";
  } else if (path.find("atlas") != std::string::npos) {
    info.kind = "atlas";
  } else if (path.find("/blas/") != std::string::npos) {
    info.kind = "reference";
  } else {
    info.kind = "unknown";
  }
  info.is_reference = info.kind == "reference";
  return info;
}

double measure_matmul_gflops(double seconds, int n) {
  torch::NoGradGuard no_grad;
  const auto a = torch::randn({n, n});
  const auto b = torch::randn({n, n});
  auto c = torch::mm(a, b);  // warm-up
  using Clock = std::chrono::steady_clock;
  const auto start = Clock::now();
  int iterations = 0;
  double elapsed = 0;
  do {
    c = torch::mm(a, b);
    ++iterations;
    elapsed = std::chrono::duration<double>(Clock::now() - start).count();
  } while (elapsed < seconds);
  return 2.0 * n * n * static_cast<double>(n) * iterations / elapsed / 1e9;
}

std::string environment_report(double probe_seconds) {
  std::ostringstream out;
  out << "- difftrain version: " << DIFFTRAIN_VERSION << "\n";
  out << "- LibTorch version: " << TORCH_VERSION << "\n";
  out << "- compiler: " << DIFFTRAIN_CXX_COMPILER << " (C++" << (__cplusplus / 100 % 100) << ")\n";
  const BlasInfo blas = detect_blas();
  out << "- BLAS: " << blas.kind << " (" << blas.library << ")\n";
  if (probe_seconds > 0) {
    const double gflops = measure_matmul_gflops(probe_seconds);
    out << fmt::format("- matmul probe: {:.1f} GFLOP/s (float32 512x512, {} thread(s), {:g} s)\n",
                       gflops, at::get_num_threads(), probe_seconds);
    if (blas.is_reference || gflops < 5.0) {
      out << "- WARNING: LibTorch is running on reference BLAS or an equally slow one: matmuls are "
             "~40x slower than they should be. Install libopenblas0-openmp (scripts/setup does) "
             "or select it with update-alternatives --config libblas.so.3-x86_64-linux-gnu\n";
    }
  }
  out << "- CPU convolutions: " << core::cpu_convolution_report() << "\n";
  const unsigned cores = std::thread::hardware_concurrency();
  out << fmt::format(
      "- threads: intra-op {} (at::get_num_threads), inter-op {}; "
      "OMP_NUM_THREADS={}, DIFFTRAIN_NUM_THREADS={}; cores {}; `difftrain launch` "
      "gives each of N local ranks cores/N threads (here: 1 rank -> {}, 2 -> {})\n",
      at::get_num_threads(), at::get_num_interop_threads(), getenv_or("OMP_NUM_THREADS", "unset"),
      getenv_or("DIFFTRAIN_NUM_THREADS", "unset"), cores, default_threads_per_process(1),
      default_threads_per_process(2));
  out << fmt::format(
      "- allocator: glibc malloc, {} (DIFFTRAIN_MALLOC_TUNING={}; 0 keeps glibc's defaults)\n",
      std::string(getenv_or("DIFFTRAIN_MALLOC_TUNING", "")) == "0"
          ? "glibc's default mmap threshold"
          : "heap up to 32 MiB blocks, 1 GiB kept after free",
      getenv_or("DIFFTRAIN_MALLOC_TUNING", "unset"));
  out << "- CPU: " << cpu_summary() << "\n";
  const CudaInfo cuda = detect_cuda();
  out << "- LibTorch build: "
      << (cuda.cuda_build ? fmt::format("CUDA {}, cuDNN {}", cuda.cuda_runtime,
                                        cuda.cudnn.empty() ? "none" : cuda.cudnn)
                          : std::string("CPU only"))
      << "\n";
  out << fmt::format("- difftrain CUDA/NCCL path: {}\n",
                     cuda.difftrain_cuda ? fmt::format("compiled (DIFFTRAIN_CUDA=ON), NCCL {}",
                                                       cuda.nccl.empty() ? "unknown" : cuda.nccl)
                                         : std::string("not compiled (DIFFTRAIN_CUDA=OFF)"));
  out << fmt::format("- CUDA devices: {}{}\n", cuda.devices.size(),
                     cuda.devices.empty() ? " (training runs on the CPU)" : "");
  for (const auto& line : cuda.devices) out << "    " << line << "\n";
  const bool nccl = cuda.difftrain_cuda && !cuda.devices.empty();
  const bool shm_off = !distributed::ShmAllReduce::enabled_by_environment();
  out << fmt::format("- collectives backend: {}{}\n", nccl ? "nccl" : "gloo",
                     nccl ? ""
                     : shm_off
                         ? "; ranks on one machine all-reduce through Gloo too "
                           "(DIFFTRAIN_SHM_ALLREDUCE=0)"
                         : "; float all-reduces of ranks on one machine through shared memory "
                           "(DIFFTRAIN_SHM_ALLREDUCE=0: Gloo)");
  const std::string path = default_config_path();
  out << "- default config (" << path << "): ";
  std::ifstream config(path);
  if (!config) {
    out << "none (run `difftrain config`)\n";
  } else {
    out << "\n";
    for (std::string line; std::getline(config, line);) {
      if (!line.empty() && line[0] != '#') out << "    " << line << "\n";
    }
  }
  return out.str();
}

}  // namespace difftrain::launch
