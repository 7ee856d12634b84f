// Fuzzes data::read_idx (MNIST-style IDX files, raw or gzip): magic, dims, sizes against the bytes
// present, gzip trailers and corrupt streams. read_idx reads through zlib's gzopen, so each input
// is written to a scratch file in /dev/shm.
#include "difftrain/data/idx.h"
#include "fuzz_files.h"
#include "fuzz_util.h"

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    const std::string path = difftrain::fuzz::write_scratch("input.idx", bytes);
    (void)difftrain::data::read_idx(path).sum();
  });
}
