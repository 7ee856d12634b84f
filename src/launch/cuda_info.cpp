#include "difftrain/launch/cuda_info.h"

#include <ATen/detail/CUDAHooksInterface.h>
#include <torch/cuda.h>

#include <fmt/format.h>

#ifdef DIFFTRAIN_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <torch/csrc/distributed/c10d/NCCLUtils.hpp>
#endif

namespace difftrain::launch {

std::string format_cuda_version(long version) {
  if (version <= 0) return "";
  return fmt::format("{}.{}", version / 1000, version % 1000 / 10);
}

std::string format_cudnn_version(long version) {
  if (version <= 0) return "";
  if (version >= 90000) {
    return fmt::format("{}.{}.{}", version / 10000, version % 10000 / 100, version % 100);
  }
  return fmt::format("{}.{}.{}", version / 1000, version % 1000 / 100, version % 100);
}

CudaInfo detect_cuda() {
  CudaInfo info;
  const auto& hooks = at::detail::getCUDAHooks();
  try {
    // A CPU LibTorch answers with the stub hooks, which throw here.
    info.cuda_runtime = format_cuda_version(hooks.versionCUDART());
    info.cuda_build = true;
  } catch (const std::exception&) {
    info.cuda_build = false;
  }
  if (info.cuda_build) {
    try {
      if (hooks.compiledWithCuDNN()) info.cudnn = format_cudnn_version(hooks.versionCuDNN());
    } catch (const std::exception&) {
    }
  }
#ifdef DIFFTRAIN_WITH_CUDA
  info.difftrain_cuda = true;
  try {
    info.nccl = c10d::getNcclVersion();
  } catch (const std::exception&) {
  }
#endif
  try {
    const int count =
        torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
    for (int i = 0; i < count; ++i) {
#ifdef DIFFTRAIN_WITH_CUDA
      const auto* p = at::cuda::getDeviceProperties(static_cast<c10::DeviceIndex>(i));
      info.devices.push_back(fmt::format("cuda:{} {} ({:.1f} GiB, sm_{}{})", i, p->name,
                                         static_cast<double>(p->totalGlobalMem) / (1 << 30),
                                         p->major, p->minor));
#else
      info.devices.push_back(fmt::format("cuda:{}", i));
#endif
    }
  } catch (const std::exception&) {
  }
  return info;
}

}  // namespace difftrain::launch
