// Fuzzes the metadata.jsonl reader of data::ImageFolderDataset: each input is the metadata.jsonl
// of a scratch folder holding a.png, sub/b.png and c.txt (file names, labels, captions, paths
// that escape the folder), then the first examples are loaded.
#include "difftrain/data/image_folder.h"
#include "difftrain/io/image.h"
#include "fuzz_files.h"
#include "fuzz_util.h"

#include <torch/torch.h>

namespace {
std::string folder;
}

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  difftrain::fuzz::init_torch();
  using difftrain::fuzz::write_scratch;
  const auto png =
      difftrain::io::encode_png(torch::arange(4 * 6 * 3).reshape({4, 6, 3}).to(torch::kUInt8));
  folder = std::filesystem::path(write_scratch("images/a.png", png)).parent_path().string();
  write_scratch("images/sub/b.png", png);
  write_scratch("images/c.txt", "not an image");
  write_scratch("outside.png", png);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  return difftrain::fuzz::run_one(data, size, [](std::string_view bytes) {
    difftrain::fuzz::write_scratch("images/metadata.jsonl", bytes);
    difftrain::data::ImageFolderOptions options;
    options.dir = folder;
    options.resolution = 4;
    difftrain::data::ImageFolderDataset dataset(options);
    for (int64_t i = 0; i < std::min<int64_t>(dataset.size(), 2); ++i) {
      (void)dataset.get(i);
      (void)dataset.caption(i);
      (void)dataset.label(i);
    }
  });
}
