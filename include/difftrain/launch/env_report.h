#pragma once

#include <string>

namespace difftrain::launch {

/// The BLAS library LibTorch's matmul ends up in.
struct BlasInfo {
  std::string
      library;       ///< resolved path of the loaded libblas, e.g. .../openblas-openmp/libblas.so.3
  std::string kind;  ///< "openblas", "blis", "mkl", "atlas", "reference" or "unknown"
  bool is_reference =
      false;  ///< true for Netlib's reference BLAS (~2 GFLOP/s: install libopenblas0-openmp)
};

/// Finds the BLAS loaded in this process (after forcing one matmul so it is loaded).
BlasInfo detect_blas();

/// Runs float32 matmuls of `n` x `n` for about `seconds` and returns GFLOP/s.
double measure_matmul_gflops(double seconds = 1.0, int n = 512);

/// The `difftrain env` report: versions, BLAS and its measured speed, threads, CPU, CUDA/NCCL and
/// the default launch config — meant to be pasted into a bug report.
/// `probe_seconds` = 0 skips the matmul probe.
std::string environment_report(double probe_seconds = 1.0);

}  // namespace difftrain::launch
