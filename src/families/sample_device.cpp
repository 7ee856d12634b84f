// `difftrain sample --device`, shared by the families' sample code.
#include "builtin.h"
#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <torch/cuda.h>

#include <optional>

namespace difftrain::families {

torch::Device parse_sample_device(const std::string& text) {
  if (text == "auto") {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0)
                                       : torch::Device(torch::kCPU);
  }
  std::optional<torch::Device> device;
  try {
    device = torch::Device(text);
  } catch (const std::exception&) {
  }
  if (!device || (!device->is_cpu() && !device->is_cuda())) {
    throw Error("--device '" + text + "' is not a device: use auto, cpu, cuda or cuda:N");
  }
  if (device->is_cuda()) {
    const auto count = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
    if (count == 0) {
      throw Error("--device " + text +
                  ": no CUDA device is visible to this LibTorch (check `difftrain env`); use "
                  "--device cpu");
    }
    if (device->has_index() && device->index() >= static_cast<int64_t>(count)) {
      throw Error(fmt::format("--device {}: only {} CUDA device(s) are visible", text, count));
    }
  }
  return *device;
}

}  // namespace difftrain::families
