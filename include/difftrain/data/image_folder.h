#pragma once
// A folder of images as a Dataset, with the layouts of Hugging Face's "imagefolder" loader and
// the transforms of Diffusers' train_unconditional.py.

#include "difftrain/data/dataset.h"

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::data {

/// Options of ImageFolderDataset (HF `load_dataset("imagefolder", data_dir=dir)` plus Diffusers'
/// `--resolution --center_crop --random_flip`).
struct ImageFolderOptions {
  /// The folder (Diffusers `--train_data_dir`).
  std::string dir;
  /// Side R of the square output: the shorter side is resized to R, then an R x R crop is taken.
  int64_t resolution = 64;
  /// Crop the centre (torchvision `CenterCrop`); false crops at a random place (`RandomCrop`).
  bool center_crop = false;
  /// Mirror left-right with probability 0.5 (torchvision `RandomHorizontalFlip`).
  bool random_flip = false;
  /// Decode every image once at construction and drop the ones that fail (see skipped_files());
  /// false decodes lazily in get() and throws there for a bad file.
  bool skip_bad_images = false;
  /// Seed of the per-sample augmentation streams (sample_generator).
  uint64_t seed = 0;
  /// The metadata.jsonl field holding an integer class label (HF: a metadata column).
  std::string label_column = "label";
  /// The metadata.jsonl field holding a caption (Diffusers `--caption_column`, default "text").
  std::string caption_column = "text";
  /// kohya-style sidecar captions: `a.png`'s caption is the first non-empty line of `a.txt` beside
  /// it (kohya's `--caption_extension`). Read for every image metadata.jsonl gives no caption;
  /// where both exist metadata.jsonl wins (said once). "" reads none.
  std::string caption_extension = ".txt";
  /// Read kohya's `<N>_<name>` repeat folders (see the class doc). False keeps Hugging Face's
  /// imagefolder reading of such folders as classes (`0_airplane/`, `1_car/` label 0 and 1), as
  /// the class-conditional UNet task does.
  bool kohya_repeat_folders = true;
  /// Times each image is used per epoch (kohya's --dataset_repeats, Diffusers' --repeats), on
  /// top of its kohya repeat folder's count; >= 1.
  int64_t repeats = 1;
  /// Output channels: 3 (RGB: grey is replicated, alpha dropped, as PIL's `.convert("RGB")`) or
  /// 1 (luminance, stb's (77 R + 150 G + 29 B) / 256, close to PIL's `.convert("L")`).
  int channels = 3;
  /// kohya's masked loss: every example also gets a "mask" [1, H, W] in [0, 1], cropped, resized
  /// and flipped with its image. Where it comes from, first match: the image of the same
  /// relative path in mask_dir (any image extension: kohya's conditioning_data_dir), its red
  /// channel (grey masks read as themselves); the metadata.jsonl field mask_column (a file under
  /// dir); the image's alpha channel; else all ones (an opaque image: nothing masked).
  bool masks = false;
  std::string mask_dir;
  std::string mask_column = "mask";
};

/// The PNG, JPEG and BMP files under a folder (extensions .png .jpg .jpeg .bmp, any case).
///
/// Which files, in which order, with which labels:
/// - With `<dir>/metadata.jsonl` (one JSON object per line, blank lines ignored), exactly the
///   files it lists, in its order: {"file_name": "relative/path.png", "label": 3, "text": "..."}.
///   The label (under label_column, an integer >= 0) is optional but then absent on every line;
///   the caption (under caption_column, a string) is optional per line. Other fields are ignored.
/// - Otherwise every image found recursively, sorted by relative path (byte order). When every
///   image sits directly in a first-level sub-folder and there are at least two sub-folders, the
///   label of an image is the index of its sub-folder among the sorted sub-folder names
///   (HF imagefolder's inferred `label` ClassLabel); otherwise there are no labels.
/// - kohya's layout (with kohya_repeat_folders, a scanned folder one of whose first-level
///   sub-folders is named `<N>_<name>`, e.g. `10_sks dog/`): only the images in such folders, each
///   used N times per epoch, captioned `<name>` when no caption file or metadata gives one (kohya's
///   class tokens); no inferred labels. Images elsewhere are skipped, with one warning.
/// - Every image is then used `repeats` times (examples i*n .. i*n+n-1 are one file, each with
///   its own augmentation stream). Files of a scanned folder that are neither images nor their
///   caption files are reported once, as caption files with no image.
/// No file may lie outside `dir`: absolute file_names, `..` components and symbolic links that
/// resolve outside it are rejected at construction (so a downloaded metadata.jsonl cannot make
/// training read other files).
///
/// Example i:
///   "pixel_values" float32 [C, R, R] in [-1, 1] (C = channels),
///   "class_labels" int64 [] (only when the folder has labels),
///   "index"        int64 [] (i),
///   "original_size"  int64 [2] (the file's height, width),
///   "crop_top_left"  int64 [2] (top, left of the crop in the resized image, as seen after the
///                    flip: SDXL's crops_coords_top_left),
///   "mask"           float32 [1, R, R] in [0, 1] (only with options.masks; a mask whose size
///                    differs from its image's is first resized to it, bilinear).
/// After set_target_sizes() the output of image i is H_i x W_i instead of R x R: the image is
/// resized to cover it (the side that fits tighter becomes exact, the other floor(side * scale)),
/// then cropped as below. Without, get(i) decodes the file, resizes its shorter side to R (bilinear
/// with antialiasing, the longer side to floor(long * R / short) as torchvision's `Resize(R)`),
/// crops R x R (centre: offsets round-half-to-even((size - R) / 2) as torchvision; random: top then
/// left drawn with randint(0, size - R + 1)), flips when random_flip and rand() < 0.5, and maps p
/// to p / 255 * 2 - 1. Unlike PIL it does not round to uint8 after resizing. All randomness comes
/// from sample_generator(seed, epoch, i, SampleStream::kAugmentation), so it does not depend on
/// the rank or worker that loads i. get() is safe to call from several threads.
class ImageFolderDataset : public Dataset {
 public:
  /// Lists (and with skip_bad_images, decodes) the images. Throws a one-line difftrain::Error
  /// naming the path for: a missing folder; no images; a metadata.jsonl line that is not a JSON
  /// object, lacks a "file_name" string, has a bad label or caption, names a missing file, or
  /// escapes the folder (each naming the line number); a symbolic link out of the folder;
  /// resolution < 1; channels other than 1 or 3; every image bad with skip_bad_images.
  explicit ImageFolderDataset(ImageFolderOptions options);

  /// Number of examples per epoch: the images used, each counted once per repeat.
  int64_t size() const override { return static_cast<int64_t>(files_.size()); }
  /// Example `index` (see the class doc). Throws difftrain::Error naming the file when it cannot
  /// be decoded, and for an index out of range.
  Example get(int64_t index) const override;
  /// Selects the augmentation of the coming epoch (the trainer calls it between epochs, never
  /// while get() runs).
  void set_epoch(int64_t epoch) { epoch_ = epoch; }
  /// The epoch set_epoch selected (0 at first).
  int64_t epoch() const { return epoch_; }

  /// Per image {height, width} of its output (aspect-ratio buckets, data/buckets.h) instead of
  /// resolution x resolution; empty restores the square. Throws difftrain::Error unless there is
  /// one entry per image, each side >= 1. Call it before loading, like set_epoch().
  void set_target_sizes(std::vector<std::array<int64_t, 2>> sizes);
  /// The output size of image `index`: its target size, or {resolution, resolution}.
  std::array<int64_t, 2> target_size(int64_t index) const;
  /// The path of image `index` (dir joined with its relative path).
  std::string file(int64_t index) const;
  /// Its path relative to dir, '/'-separated (metadata.jsonl's file_name).
  const std::string& relative_file(int64_t index) const;
  /// The label of image `index`, or std::nullopt when the folder has none.
  std::optional<int64_t> label(int64_t index) const;
  /// The caption of image `index`: metadata.jsonl's caption_column, else its sidecar file, if any.
  std::optional<std::string> caption(int64_t index) const;
  /// Class names by label: the sub-folder names for inferred labels, "0".."K-1" for
  /// metadata.jsonl labels, empty without labels.
  const std::vector<std::string>& class_names() const { return class_names_; }
  /// Number of classes (1 + the largest label); 0 when unlabelled.
  int64_t num_classes() const { return static_cast<int64_t>(class_names_.size()); }
  /// How many files skip_bad_images dropped.
  int64_t skipped() const { return static_cast<int64_t>(skipped_files_.size()); }
  /// The paths skip_bad_images dropped, in listing order.
  const std::vector<std::string>& skipped_files() const { return skipped_files_; }
  const ImageFolderOptions& options() const { return options_; }

 private:
  void check_index(int64_t index) const;

  ImageFolderOptions options_;
  std::vector<std::string> files_;  // relative to options_.dir, generic separators
  std::vector<int64_t> labels_;     // one per file, or empty
  std::vector<std::optional<std::string>> captions_;  // one per file
  std::vector<std::string> mask_files_;  // with options.masks: one per file ("" = alpha)
  std::vector<std::string> class_names_;
  std::vector<std::string> skipped_files_;
  std::vector<std::array<int64_t, 2>> target_sizes_;  // empty: square
  std::map<std::string, int64_t> kohya_;              // kohya folder -> its images
  int64_t epoch_ = 0;
};

}  // namespace difftrain::data
