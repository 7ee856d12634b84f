// Fuzzes the YAML file of `difftrain train --config` (families::parse_train_config: the trainer's
// options and the run's family's, the default family's without a model): option names, value
// types, lists, nesting, validation. The file is written to a scratch path; a deepspeed or
// accelerate config file it names is resolved like any path.
#include "difftrain/families/family.h"
#include "difftrain/train/train_config.h"
#include "fuzz_files.h"
#include "fuzz_util.h"

#include <nlohmann/json.hpp>

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    const std::string path = difftrain::fuzz::write_scratch("train.yaml", bytes);
    auto config = difftrain::families::parse_train_config({"--config", path});
    (void)config.to_json().dump();
  });
}
