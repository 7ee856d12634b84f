// Fuzzes settings::parse_deepspeed_config (a DeepSpeed JSON config: zero_optimization, fp16/bf16,
// batch sizes, "auto" values).
#include "difftrain/settings/sharding_config.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    (void)difftrain::settings::parse_deepspeed_config(std::string(bytes), "fuzz.json");
  });
}
