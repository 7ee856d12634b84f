// Fuzzes io::decode_image (stb_image: PNG, JPEG, BMP, GIF, TGA, PSD, HDR, PIC, PNM). The last
// byte picks the channel conversion (0 = the file's own, 1..4).
#include "difftrain/io/image.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    const int channels = bytes.empty() ? 3 : static_cast<unsigned char>(bytes.back()) % 5;
    auto image = difftrain::io::decode_image(std::string(bytes), "fuzz.img", channels);
    (void)image.sum();
  });
}
