#pragma once
// Aspect-ratio buckets (kohya's sd-scripts, SimpleTuner, OneTrainer): images keep roughly their
// shape instead of being cropped square. Every image goes to the bucket of about the training
// area whose aspect ratio is nearest its own, each global batch is drawn from one bucket, and the
// order is a function of (seed, epoch) alone, so sharding and exact resume work as for a plain
// shuffle.

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::data {

/// How the bucket sizes are made.
struct BucketOptions {
  /// The training resolution R: bucket areas are at most R x R (and R x R is a bucket when R is
  /// a multiple of step).
  int64_t resolution = 1024;
  /// Every side is a multiple of this (64 for Stable Diffusion; it must be a multiple of the
  /// VAE's downsampling factor times the UNet's).
  int64_t step = 64;
  /// Smallest and largest side; 0 = R / 2 and 2 R, rounded to multiples of step.
  int64_t min_side = 0, max_side = 0;
};

/// The buckets {height, width}: for every width w = min_side, min_side + step, ..., max_side the
/// tallest height h <= max_side, a multiple of step, with h * w <= R * R (and h >= min_side), and
/// the transposed size; sorted by aspect ratio h / w, without duplicates. Throws difftrain::Error
/// for step < 1, R < step or min_side > max_side.
std::vector<std::array<int64_t, 2>> make_buckets(const BucketOptions& options);

/// The index into `buckets` whose aspect ratio is nearest the image's (|log(h/w) - log(bh/bw)|;
/// ties go to the larger area, then the first).
int64_t nearest_bucket(const std::vector<std::array<int64_t, 2>>& buckets, int64_t height,
                       int64_t width);

/// Images grouped by bucket and laid out as "slots" (the indices of the dataset the loader sees):
/// bucket b's images take group-aligned runs of slots, its last group padded by repeating its
/// first images, so every run of `group` consecutive slots in epoch_order() lies in one bucket.
/// `group` is the number of examples of one optimizer micro-step over all ranks (batch size x
/// ranks, or the batch size with split_batches).
class BucketLayout {
 public:
  /// image_sizes: {height, width} per image. Throws difftrain::Error for group < 1 or no images.
  BucketLayout(std::vector<std::array<int64_t, 2>> buckets,
               const std::vector<std::array<int64_t, 2>>& image_sizes, int64_t group);
  /// The same layout for items whose bucket is already decided: `image_bucket` indexes
  /// `buckets` per item (a video's buckets are size and frame count: several may share a size).
  /// Throws difftrain::Error for group < 1, no items or an index out of range.
  BucketLayout(std::vector<std::array<int64_t, 2>> buckets, std::vector<int64_t> image_bucket,
               int64_t group);

  /// Number of slots (a multiple of group; >= the number of images).
  int64_t num_slots() const { return static_cast<int64_t>(slot_image_.size()); }
  /// The image a slot shows.
  int64_t image_of_slot(int64_t slot) const { return slot_image_.at(static_cast<size_t>(slot)); }
  /// The bucket {height, width} of image i.
  std::array<int64_t, 2> image_bucket(int64_t image) const;
  /// Per image, its bucket size (ImageFolderDataset::set_target_sizes).
  std::vector<std::array<int64_t, 2>> image_targets() const;
  /// The order of epoch `epoch`: the slots of each bucket shuffled, cut into runs of `group`,
  /// and the runs shuffled, all from one CPU generator seeded seed + epoch.
  std::vector<int64_t> epoch_order(uint64_t seed, int64_t epoch) const;
  /// One line per used bucket: "HxW: n images" (for the log).
  std::vector<std::string> summary() const;

 private:
  std::vector<std::array<int64_t, 2>> buckets_;
  std::vector<int64_t> image_bucket_;              // per image, index into buckets_
  std::vector<int64_t> slot_image_;                // per slot
  std::vector<std::pair<int64_t, int64_t>> runs_;  // per bucket used: first slot, slot count
  std::vector<int64_t> run_bucket_;
  int64_t group_;
};

}  // namespace difftrain::data
