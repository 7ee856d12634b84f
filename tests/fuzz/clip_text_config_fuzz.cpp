// Fuzzes models::parse_clip_text_config (a Transformers CLIPTextModel / CLIPModel config.json).
#include "difftrain/models/text_encoders/clip_text_model.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    (void)difftrain::models::parse_clip_text_config(std::string(bytes), "fuzz/config.json");
  });
}
