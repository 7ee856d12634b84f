#include "difftrain/data/mnist.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/data/idx.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <filesystem>
#include <utility>

namespace difftrain::data {
namespace {

namespace fs = std::filesystem;

constexpr const char* kFashionMnistDir = "/usr/share/datasets/fashion-mnist";
constexpr const char* kInstallHint =
    "install Fashion-MNIST with `sudo apt install dataset-fashion-mnist`, or pass "
    "--train_data_dir with the MNIST IDX files";

// <dir>/<name>.gz, else <dir>/<name>; throws naming both when neither exists.
std::string find_idx(const std::string& dir, const std::string& name) {
  for (const std::string& candidate : {name + ".gz", name}) {
    const auto path = (fs::path(dir) / candidate).string();
    std::error_code ec;
    if (fs::is_regular_file(path, ec)) return path;
  }
  throw Error(fmt::format("{}: neither {}.gz nor {} found; {}", dir, name, name, kInstallHint));
}

}  // namespace

std::string default_dataset_dir(const std::string& dataset_name) {
  if (dataset_name == "fashion_mnist" || dataset_name == "fashion-mnist") return kFashionMnistDir;
  if (dataset_name == "mnist") {
    throw Error(
        "dataset \"mnist\" has no default folder (Debian ships no MNIST package): pass "
        "--train_data_dir with the MNIST IDX files (train-images-idx3-ubyte.gz, ...), or use "
        "fashion_mnist");
  }
  throw Error(fmt::format(
      "dataset \"{}\" has no default folder; known names: fashion_mnist; otherwise pass "
      "--train_data_dir",
      dataset_name));
}

MnistDataset::MnistDataset(MnistOptions options) : options_(std::move(options)) {
  if (options_.dir.empty()) options_.dir = default_dataset_dir("fashion_mnist");
  const std::string& dir = options_.dir;
  if (options_.split != "train" && options_.split != "test") {
    throw Error(fmt::format("MnistDataset: split is \"{}\"; expected \"train\" or \"test\"",
                            options_.split));
  }
  if (options_.resolution < 1) {
    throw Error(fmt::format("MnistDataset: resolution is {}; it must be >= 1 (e.g. 32)",
                            options_.resolution));
  }
  if (options_.limit < 0) {
    throw Error(fmt::format("MnistDataset: limit is {}; it must be >= 0 (0 keeps every example)",
                            options_.limit));
  }
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    throw Error(fmt::format("{}: no such folder; {}", dir, kInstallHint));
  }
  const std::string prefix = options_.split == "train" ? "train" : "t10k";
  const auto images_path = find_idx(dir, prefix + "-images-idx3-ubyte");
  const auto labels_path = find_idx(dir, prefix + "-labels-idx1-ubyte");
  auto note = [](const std::string& line) { log::info("{}", line); };
  auto images = read_idx_cached(images_path, options_.cache_dir, note);
  auto labels = read_idx_cached(labels_path, options_.cache_dir, note);
  if (images.dim() != 3) {
    throw Error(fmt::format("{}: holds an array of shape {}; expected images [N, H, W]",
                            images_path, fmt::join(images.sizes(), "x")));
  }
  if (labels.dim() != 1) {
    throw Error(fmt::format("{}: holds an array of shape {}; expected labels [N]", labels_path,
                            fmt::join(labels.sizes(), "x")));
  }
  if (labels.size(0) != images.size(0)) {
    throw Error(
        fmt::format("{} has {} labels but {} has {} images; the files belong to "
                    "different datasets or splits",
                    labels_path, labels.size(0), images_path, images.size(0)));
  }
  labels = labels.to(torch::kLong);
  num_classes_ = labels.numel() > 0 ? labels.max().item<int64_t>() + 1 : 0;

  if (options_.only_class) {
    const int64_t c = *options_.only_class;
    const auto keep = (labels == c).nonzero().squeeze(1);
    if (keep.numel() == 0) {
      throw Error(
          fmt::format("MnistDataset: only_class {} matches no example of {} ({} split); "
                      "labels are 0..{}",
                      c, dir, options_.split, num_classes_ - 1));
    }
    images = images.index_select(0, keep);
    labels = labels.index_select(0, keep);
  }
  if (options_.limit > 0 && options_.limit < images.size(0)) {
    // clone() so the full split's bytes are released, not kept alive by a view.
    images = images.narrow(0, 0, options_.limit).clone();
    labels = labels.narrow(0, 0, options_.limit).clone();
  }
  images_ = images.contiguous();
  labels_ = labels.contiguous();
}

Example MnistDataset::get(int64_t index) const {
  if (index < 0 || index >= size()) {
    throw Error(fmt::format("MnistDataset index {} is out of range: expected 0 <= index < {}",
                            index, size()));
  }
  const int64_t r = options_.resolution;
  const int64_t h = images_.size(1), w = images_.size(2);
  // [H, W] uint8 → [1, H, W] in [-1, 1]
  auto x = images_[index].to(torch::kFloat).div(255.0).mul(2.0).sub(1.0).unsqueeze(0);
  if (r >= h && r >= w) {
    if (r != h || r != w) {
      auto canvas = torch::full({1, r, r}, -1.0f);
      canvas.narrow(1, (r - h) / 2, h).narrow(2, (r - w) / 2, w).copy_(x);
      x = canvas;
    }
  } else {
    namespace F = torch::nn::functional;
    x = F::interpolate(x.unsqueeze(0), F::InterpolateFuncOptions()
                                           .size(std::vector<int64_t>{r, r})
                                           .mode(torch::kBilinear)
                                           .align_corners(false)
                                           .antialias(true))
            .squeeze(0);
  }
  if (options_.random_flip) {
    auto gen =
        core::sample_generator(options_.seed, epoch_, index, core::SampleStream::kAugmentation);
    if (torch::rand({1}, gen).item<float>() < 0.5f) x = x.flip({2});
  }
  return {{"pixel_values", x.contiguous()},
          {"class_labels", labels_[index].clone()},
          {"index", torch::tensor(index, torch::kLong)}};
}

const std::vector<std::string>& MnistDataset::fashion_mnist_class_names() {
  static const std::vector<std::string> names = {"T-shirt/top", "Trouser",   "Pullover", "Dress",
                                                 "Coat",        "Sandal",    "Shirt",    "Sneaker",
                                                 "Bag",         "Ankle boot"};
  return names;
}

}  // namespace difftrain::data
