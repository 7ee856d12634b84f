// Fuzzes io::parse_safetensors: header length, JSON header, dtypes, shapes and byte ranges.
#include "difftrain/io/safetensors.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    auto file = difftrain::io::parse_safetensors(bytes, "fuzz.safetensors");
    for (auto& [key, tensor] : file.tensors) (void)tensor.sum();
  });
}
