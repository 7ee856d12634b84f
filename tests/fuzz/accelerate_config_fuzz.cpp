// Fuzzes settings::parse_accelerate_config (an Accelerate config YAML: distributed_type,
// fsdp_config, deepspeed_config, ...). deepspeed_config_file is resolved in an empty scratch
// folder.
#include "difftrain/settings/sharding_config.h"
#include "fuzz_files.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    (void)difftrain::settings::parse_accelerate_config(std::string(bytes), "fuzz.yaml",
                                                       difftrain::fuzz::scratch_dir());
  });
}
