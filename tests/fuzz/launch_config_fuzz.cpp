// Fuzzes launch::parse_config (the YAML of `difftrain config`), validate_config and the round trip
// through config_to_yaml.
#include "difftrain/launch/config.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    auto config = difftrain::launch::parse_config(std::string(bytes), "fuzz.yaml");
    const std::string yaml = difftrain::launch::config_to_yaml(config);
    (void)difftrain::launch::parse_config(yaml, "round-trip.yaml");
    difftrain::launch::validate_config(config, "fuzz.yaml");
  });
}
