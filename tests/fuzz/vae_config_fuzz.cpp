// Fuzzes models::parse_autoencoder_kl_config (a Diffusers AutoencoderKL config.json).
#include "difftrain/models/autoencoders/autoencoder_kl.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    auto config =
        difftrain::models::parse_autoencoder_kl_config(std::string(bytes), "fuzz/config.json");
    (void)config.downsample_factor();
  });
}
