// Fuzzes diffusion::SchedulerConfig::parse (a Diffusers scheduler_config.json), validate() and
// the to_json round trip.
#include "difftrain/diffusion/scheduler_config.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    using difftrain::diffusion::SchedulerConfig;
    auto config = SchedulerConfig::parse(std::string(bytes), "fuzz/scheduler_config.json");
    (void)SchedulerConfig::from_json(config.to_json(), "round-trip");
  });
}
