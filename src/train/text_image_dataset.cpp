#include "difftrain/train/text_image_dataset.h"

#include "difftrain/core/error.h"
#include "difftrain/data/media_reader.h"

#include <algorithm>
#include <cctype>
#include <filesystem>

namespace difftrain::train {
namespace fs = std::filesystem;

data::ImageFolderOptions image_folder_options(const DataOptions& d, const std::string& dir,
                                              int channels) {
  data::ImageFolderOptions o;
  o.dir = dir;
  o.resolution = d.resolution;
  o.center_crop = d.center_crop;
  o.random_flip = d.random_flip;
  o.skip_bad_images = d.skip_bad_images;
  o.seed = d.seed;
  o.caption_column = d.caption_column;
  o.caption_extension = d.caption_extension;
  o.repeats = d.dataset_repeats;
  o.channels = channels;
  o.masks = d.masked_loss;
  o.mask_dir = d.conditioning_data_dir;
  return o;
}

TextImageDataset::TextImageDataset(Half instance, std::optional<Half> cls, CaptionIds caption_ids)
    : instance_(std::move(instance)),
      class_(std::move(cls)),
      caption_ids_(std::move(caption_ids)) {}

int64_t TextImageDataset::size() const {
  if (!slot_image_.empty()) return static_cast<int64_t>(slot_image_.size());
  const int64_t n = instance_.images->size();
  return class_ ? std::max(n, class_->images->size()) : n;
}

data::Example TextImageDataset::get(int64_t index) const {
  data::Example ex;
  ex["index"] = torch::tensor(index, torch::kInt64);
  const int64_t image = slot_image_.empty() ? index : slot_image_.at(static_cast<size_t>(index));
  add(ex, "", instance_, image % instance_.images->size(), index);
  if (class_) add(ex, "class_", *class_, index % class_->images->size(), index);
  return ex;
}

void TextImageDataset::set_epoch(int64_t epoch) {
  epoch_ = epoch;
  instance_.images->set_epoch(epoch);
  if (class_) class_->images->set_epoch(epoch);
}

void TextImageDataset::add(data::Example& ex, const std::string& prefix, const Half& half,
                           int64_t i, int64_t key) const {
  if (!half.mean.empty()) {
    ex[prefix + "latent_mean"] = half.mean[static_cast<size_t>(i)];
    ex[prefix + "latent_logvar"] = half.logvar[static_cast<size_t>(i)];
    ex[prefix + "original_size"] = half.geometry[i].narrow(0, 0, 2);
    ex[prefix + "crop_top_left"] = half.geometry[i].narrow(0, 2, 2);
    if (!half.masks.empty()) ex[prefix + "mask"] = half.masks[static_cast<size_t>(i)];
  } else {
    auto image = half.images->get(i);
    ex[prefix + "pixel_values"] = image.at("pixel_values");
    ex[prefix + "original_size"] = image.at("original_size");
    ex[prefix + "crop_top_left"] = image.at("crop_top_left");
    if (auto m = image.find("mask"); m != image.end()) ex[prefix + "mask"] = m->second;
  }
  const std::string caption =
      prefix.empty()
          ? processing_.apply(half.captions[static_cast<size_t>(i)], caption_seed_, epoch_, key)
          : half.captions[static_cast<size_t>(i)];
  auto it = cached_text.find(caption);
  if (it != cached_text.end()) {
    for (const auto& [name, t] : it->second) ex[prefix + name] = t;
  } else {
    caption_ids_(ex, prefix, caption);
  }
}

TextImageDataset::Half captioned_images(const DataOptions& d, const std::string& dir,
                                        const std::string& prompt) {
  TextImageDataset::Half half;
  half.images = std::make_shared<data::ImageFolderDataset>(image_folder_options(d, dir, 3));
  // Skipped images (--skip_bad_images) are reported once, by the dataset on the main rank.
  for (int64_t i = 0; i < half.images->size(); ++i) {
    if (!prompt.empty()) {
      half.captions.push_back(prompt);
      continue;
    }
    auto caption = half.images->caption(i);
    if (!caption) {
      throw Error(half.images->file(i) + " has no caption: put it in a " +
                  (d.caption_extension.empty() ? std::string(".txt") : d.caption_extension) +
                  " file beside the image (--caption_extension), or in the \"" + d.caption_column +
                  "\" field of its line of " + dir +
                  "/metadata.jsonl (--caption_column), or give every image one "
                  "--instance_prompt");
    }
    half.captions.push_back(*caption);
  }
  return half;
}

int64_t count_images(const std::string& dir) {
  int64_t n = 0;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) return 0;
  for (const auto& e : fs::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file() && data::is_media_file(e.path().string())) ++n;
  }
  return n;
}

}  // namespace difftrain::train
