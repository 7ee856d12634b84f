// Fuzzes LoRA file reading: io::parse_safetensors, then io::parse_lora's key parsing and format
// detection (Diffusers, PEFT, kohya), ranks, alphas and shapes, then the conversion back.
#include "difftrain/io/lora_format.h"
#include "difftrain/io/safetensors.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    auto file = difftrain::io::parse_safetensors(bytes, "fuzz.safetensors");
    auto lora = difftrain::io::parse_lora(file.tensors, "fuzz.safetensors");
    for (const auto& [component, targets] : lora.components) {
      for (const auto& target : targets) (void)target.scale();
    }
    (void)difftrain::io::lora_to_tensors(lora, lora.format);
  });
}
