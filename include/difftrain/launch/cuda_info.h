#pragma once

#include <string>
#include <vector>

namespace difftrain::launch {

/// What `difftrain env` reports about CUDA: how LibTorch and difftrain were built, and what this
/// machine has. Filled in from LibTorch's CUDA hooks, so it works against any LibTorch (CPU or
/// CUDA, Debian's, pytorch.org's or a pip `torch`); a CPU LibTorch reports cuda_build = false.
struct CudaInfo {
  bool cuda_build = false;      ///< LibTorch's CUDA library (libtorch_cuda) is loaded
  std::string cuda_runtime;     ///< CUDA runtime LibTorch was built with, e.g. "12.4"
  std::string cudnn;            ///< cuDNN LibTorch was built with, e.g. "9.1.0"; "" if none
  bool difftrain_cuda = false;  ///< difftrain itself built with -DDIFFTRAIN_CUDA=ON (NCCL path)
  std::string nccl;             ///< NCCL version, e.g. "2.22.3" (DIFFTRAIN_CUDA=ON only)
  std::vector<std::string> devices;  ///< one line per visible device: index, name, memory, sm_XY
};

/// Queries LibTorch and the CUDA runtime; never throws (what cannot be read stays empty).
CudaInfo detect_cuda();

/// "12.4" from CUDA's integer version 12040.
std::string format_cuda_version(long version);

/// "9.1.0" from cuDNN's integer version (90100 since cuDNN 9, 8902 = 8.9.2 before it).
std::string format_cudnn_version(long version);

}  // namespace difftrain::launch
