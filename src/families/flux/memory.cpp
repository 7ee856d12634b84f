// `difftrain estimate-memory` for FLUX.1 folders.
#include "difftrain/core/error.h"
#include "flux_family.h"

namespace difftrain::families::flux {

std::vector<train::MemoryEstimate> estimate_flux_memory(
    const std::string& model_path, const train::MemoryEstimateOptions& options,
    const std::vector<accel::ShardingStrategy>& strategies) {
  (void)options;
  (void)strategies;
  // The UNet families build the model and measure one forward; a 12 B transformer cannot be
  // built on most machines, so FLUX.1 needs a model from its config alone (not written yet).
  throw Error(model_path +
              " is a FLUX.1 folder; estimate-memory does not model FLUX.1 yet (it models UNet, "
              "Stable Diffusion and SDXL folders)");
}

}  // namespace difftrain::families::flux
