// Fuzzes families::stable_diffusion::parse_model_index (a Stable Diffusion pipeline's
// model_index.json: the components, their classes, the ignored ones).
#include "difftrain/families/stable_diffusion/pipeline.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    (void)difftrain::families::stable_diffusion::parse_model_index(std::string(bytes),
                                                                   "fuzz/model_index.json");
  });
}
