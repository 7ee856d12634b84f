// Fuzzes models::UNetConfig::parse (a Diffusers UNet2DModel / UNet2DConditionModel config.json)
// and its to_json round trip.
#include "difftrain/models/unets/unet_config.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    auto config = difftrain::models::UNetConfig::parse(std::string(bytes), "fuzz/config.json");
    (void)difftrain::models::UNetConfig::from_json(config.to_json(), "round-trip");
  });
}
