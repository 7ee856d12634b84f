#include "difftrain/train/class_images.h"

#include "difftrain/core/error.h"
#include "difftrain/core/phase.h"
#include "difftrain/io/image.h"
#include "difftrain/train/text_image_dataset.h"

#include <cstdio>
#include <filesystem>

namespace difftrain::train {
namespace fs = std::filesystem;

void generate_class_images(accel::Accelerator& acc, const ClassImageOptions& o,
                           const ClassImageRenderer& render) {
  const fs::path dir(o.class_data_dir);
  const int64_t have = count_images(o.class_data_dir);
  if (have >= o.num_class_images) return;
  if (fs::exists(dir / "metadata.jsonl")) {
    throw Error(o.class_data_dir + " has " + std::to_string(have) + " of --num_class_images " +
                std::to_string(o.num_class_images) +
                " images and a metadata.jsonl; add the images, lower --num_class_images, or "
                "remove metadata.jsonl so difftrain can generate the rest");
  }
  const int64_t missing = o.num_class_images - have;
  acc.print("prior preservation: generating {} class image(s) of \"{}\" into {}", missing,
            o.class_prompt, o.class_data_dir);
  if (acc.is_main_process()) fs::create_directories(dir);
  acc.wait_for_everyone();
  const auto [begin, end] = acc.split_range(missing);
  core::PhaseScope phase("generating class images");
  if (begin < end) {
    torch::Tensor images;  // [end - begin, H, W, 3]
    {
      auto autocast = acc.autocast();
      images = render(end - begin, o.seed + static_cast<uint64_t>(have + begin));
    }
    const auto u8 = io::to_uint8_images(images.permute({0, 3, 1, 2}));
    for (int64_t j = 0; j < end - begin; ++j) {
      char name[64];
      std::snprintf(name, sizeof name, "class_%06lld.png",
                    static_cast<long long>(have + begin + j));
      io::save_png((dir / name).string(), u8[j]);
    }
  }
  acc.wait_for_everyone();
}

}  // namespace difftrain::train
