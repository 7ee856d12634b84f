#pragma once
// MNIST and Fashion-MNIST from their IDX files, as the images `difftrain train` learns from.

#include "difftrain/data/dataset.h"

#include <torch/types.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::data {

/// Where a dataset difftrain knows by name is installed: "fashion_mnist" (or "fashion-mnist") →
/// /usr/share/datasets/fashion-mnist, the folder of Debian's `dataset-fashion-mnist` package.
/// Throws difftrain::Error for "mnist" (Debian ships no MNIST package: pass --train_data_dir
/// with the MNIST IDX files) and for any other name.
std::string default_dataset_dir(const std::string& dataset_name);

/// Options of MnistDataset (torchvision `datasets.MNIST` / `FashionMNIST` plus the transforms of
/// Diffusers' train_unconditional.py).
struct MnistOptions {
  /// Folder with <prefix>-images-idx3-ubyte(.gz) and <prefix>-labels-idx1-ubyte(.gz); "" means
  /// default_dataset_dir("fashion_mnist").
  std::string dir;
  /// "train" (prefix `train`, 60000 examples) or "test" (prefix `t10k`, 10000 examples).
  std::string split = "train";
  /// Side R of the square output. R >= 28 centres the 28x28 image on an R x R background canvas
  /// (32 gives the usual "padded to 32x32" MNIST; an odd margin puts the extra pixel at the
  /// bottom and right); R < 28 shrinks it to R x R with antialiased bilinear interpolation.
  /// (Other image sizes H x W work alike: padded when R >= H and R >= W, else resized.)
  int64_t resolution = 32;
  /// Mirror left-right with probability 0.5 (torchvision `RandomHorizontalFlip`).
  bool random_flip = false;
  /// Seed of the per-sample augmentation streams (sample_generator).
  uint64_t seed = 0;
  /// Keep only the first `limit` examples (after only_class); 0 keeps all.
  int64_t limit = 0;
  /// Keep only the examples with this label.
  std::optional<int64_t> only_class;
  /// Where uncompressed copies of gzip files are kept (read_idx_cached); "" reads the files each
  /// time. The trainer passes <user_cache_dir()> unless DIFFTRAIN_DATASET_CACHE=0.
  std::string cache_dir;
};

/// MNIST-format images as a Dataset. Example i:
///   "pixel_values" float32 [1, R, R] in [-1, 1] (pixel p → p / 255 * 2 - 1, so the background
///                  and the padding are exactly -1),
///   "class_labels" int64 [] (0..9),
///   "index"        int64 [] (i, the index in this dataset after only_class and limit).
/// The uint8 images are read once and shared by copies of the dataset; get() converts one and is
/// safe to call from several threads. With random_flip, all randomness of get(i) comes from
/// sample_generator(seed, epoch, i, SampleStream::kAugmentation), so it does not depend on the
/// rank or worker that loads i.
class MnistDataset : public Dataset {
 public:
  /// Reads the split's IDX files. Throws difftrain::Error naming the path for a missing folder or
  /// file (with the fix: `sudo apt install dataset-fashion-mnist` or --train_data_dir), unreadable
  /// IDX files, images that are not [N, H, W], a label count that differs from the image
  /// count, a bad split, resolution < 1, limit < 0, or an only_class no example has.
  explicit MnistDataset(MnistOptions options);

  /// Number of examples kept.
  int64_t size() const override { return images_.size(0); }
  /// Example `index` (see the class doc). Throws difftrain::Error for an index out of range.
  Example get(int64_t index) const override;
  /// Selects the augmentation of the coming epoch (the trainer calls it between epochs, never
  /// while get() runs).
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  /// The epoch set_epoch selected (0 at first).
  int64_t epoch() const { return epoch_; }
  /// 1 + the largest label of the split before only_class and limit (10 for MNIST).
  int64_t num_classes() const { return num_classes_; }
  /// The labels kept, int64 [size()].
  const torch::Tensor& labels() const { return labels_; }
  const MnistOptions& options() const { return options_; }

  /// Fashion-MNIST's ten class names, by label: T-shirt/top, Trouser, Pullover, Dress, Coat,
  /// Sandal, Shirt, Sneaker, Bag, Ankle boot.
  static const std::vector<std::string>& fashion_mnist_class_names();

 private:
  MnistOptions options_;
  torch::Tensor images_;  // uint8 [N, 28, 28]
  torch::Tensor labels_;  // int64 [N]
  int64_t num_classes_ = 0;
  int64_t epoch_ = 0;
};

}  // namespace difftrain::data
