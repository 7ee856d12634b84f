// Aspect-ratio buckets: the bucket sizes, the nearest-aspect assignment, the slot layout (every
// global batch from one bucket, on every rank) and the image folder's bucket crops and geometry.

#include "difftrain/data/buckets.h"
#include "difftrain/data/data_loader.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/data/sharding.h"
#include "difftrain/io/image.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <set>

namespace difftrain {
namespace {

using Size = std::array<int64_t, 2>;

TEST(Buckets, SdxlSizesAtTenTwentyFour) {
  data::BucketOptions o;
  o.resolution = 1024;
  const auto b = data::make_buckets(o);
  // Sorted by h / w: 512x2048 (widest) ... 1024x1024 ... 2048x512 (tallest).
  // 17 with h <= w (512x2048, 512x1984, ..., 960x1088, 1024x1024) and their 16 transposes.
  ASSERT_EQ(b.size(), 33u);
  EXPECT_EQ(b.front(), (Size{512, 2048}));
  EXPECT_EQ(b.back(), (Size{2048, 512}));
  const std::set<Size> all(b.begin(), b.end());
  for (const Size s :
       {Size{1024, 1024}, Size{960, 1088}, Size{896, 1152}, Size{832, 1216}, Size{768, 1344},
        Size{704, 1472}, Size{640, 1600}, Size{576, 1792}, Size{512, 1984}, Size{1216, 832}}) {
    EXPECT_TRUE(all.count(s)) << s[0] << "x" << s[1];
  }
  for (const auto& s : b) {
    EXPECT_EQ(s[0] % 64, 0);
    EXPECT_EQ(s[1] % 64, 0);
    EXPECT_LE(s[0] * s[1], 1024 * 1024);
    EXPECT_TRUE(all.count({s[1], s[0]}));  // and its transpose
  }
  o.step = 0;
  EXPECT_NE(test::error_of([&] { data::make_buckets(o); }).find("step"), std::string::npos);
}

TEST(Buckets, NearestAspectRatioWins) {
  const std::vector<Size> b = {{16, 48}, {32, 32}, {48, 16}};
  EXPECT_EQ(data::nearest_bucket(b, 24, 48), 0);  // 1:2 is nearer 1:3 than 1:1 in log
  EXPECT_EQ(data::nearest_bucket(b, 480, 500), 1);
  EXPECT_EQ(data::nearest_bucket(b, 48, 24), 2);
  EXPECT_EQ(data::nearest_bucket(b, 1, 100), 0);
}

TEST(Buckets, EveryGlobalBatchComesFromOneBucketOnEveryRank) {
  // 7 wide, 4 square, 2 tall images; batch 2 per rank on 2 ranks: runs of 4.
  std::vector<Size> images;
  for (int i = 0; i < 7; ++i) images.push_back({16, 48});
  for (int i = 0; i < 4; ++i) images.push_back({32, 32});
  for (int i = 0; i < 2; ++i) images.push_back({48, 16});
  const std::vector<Size> buckets = {{16, 48}, {32, 32}, {48, 16}};
  data::BucketLayout layout(buckets, images, 4);
  EXPECT_EQ(layout.num_slots(), 8 + 4 + 4);  // each bucket padded to a multiple of 4
  std::multiset<int64_t> shown;
  for (int64_t s = 0; s < layout.num_slots(); ++s) shown.insert(layout.image_of_slot(s));
  for (int64_t i = 0; i < 13; ++i) EXPECT_GE(shown.count(i), 1u) << i;  // every image is used
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    const auto order = layout.epoch_order(5, epoch);
    EXPECT_EQ(order, layout.epoch_order(5, epoch));  // a function of (seed, epoch)
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    for (int64_t s = 0; s < layout.num_slots(); ++s) EXPECT_EQ(sorted[static_cast<size_t>(s)], s);
    // Through the sharding Accelerate does: step k of rank r is order[4k + 2r, +2).
    for (int rank = 0; rank < 2; ++rank) {
      data::ShardOptions shard;
      shard.rank = rank;
      shard.world_size = 2;
      const auto batches = data::shard_batches(order, 2, false, shard);
      const auto other = data::shard_batches(order, 2, false, [&] {
        auto s = shard;
        s.rank = 1 - rank;
        return s;
      }());
      ASSERT_EQ(batches.size(), other.size());
      for (size_t k = 0; k < batches.size(); ++k) {
        const Size bucket = layout.image_bucket(layout.image_of_slot(batches[k][0]));
        for (int64_t slot : batches[k])
          EXPECT_EQ(layout.image_bucket(layout.image_of_slot(slot)), bucket);
        for (int64_t slot : other[k])
          EXPECT_EQ(layout.image_bucket(layout.image_of_slot(slot)), bucket);
      }
    }
  }
  EXPECT_NE(layout.epoch_order(5, 0), layout.epoch_order(5, 1));
  EXPECT_NE(layout.epoch_order(5, 0), layout.epoch_order(6, 0));
}

TEST(Buckets, LoaderTakesTheSamplerAndChecksItsLength) {
  class Indices : public data::Dataset {
   public:
    int64_t size() const override { return 8; }
    data::Example get(int64_t i) const override {
      return {{"index", torch::tensor(i, torch::kLong)}};
    }
  };
  data::DataLoaderOptions o;
  o.batch_size = 4;
  o.sampler = [](int64_t epoch) {
    std::vector<int64_t> v = {7, 6, 5, 4, 3, 2, 1, 0};
    if (epoch == 1) v.pop_back();
    return v;
  };
  data::DataLoader loader(std::make_shared<Indices>(), o);
  std::vector<int64_t> seen;
  for (const auto& batch : loader) {
    auto idx = batch.at("index");
    for (int64_t k = 0; k < idx.numel(); ++k) seen.push_back(idx[k].item<int64_t>());
  }
  EXPECT_EQ(seen, (std::vector<int64_t>{7, 6, 5, 4, 3, 2, 1, 0}));
  EXPECT_NE(test::error_of([&] {
              for (const auto& batch : loader) (void)batch;
            }).find("the sampler gave 7 indices for a dataset of 8"),
            std::string::npos);
}

TEST(Buckets, ImageFolderCropsToTheBucketAndReportsTheGeometry) {
  const std::string dir = test::temp_dir("bucket_folder");
  // A 30x60 image (h x w): a left-to-right ramp so crops and flips can be told apart.
  auto ramp = torch::arange(60, torch::kFloat).div(59).mul(255).round().to(torch::kUInt8);
  auto img = ramp.view({1, 60, 1}).expand({30, 60, 3}).contiguous();
  io::save_png(dir + "/wide.png", img);
  EXPECT_EQ(io::image_size(dir + "/wide.png"), (Size{30, 60}));
  data::ImageFolderOptions o;
  o.dir = dir;
  o.resolution = 32;
  o.center_crop = true;
  data::ImageFolderDataset ds(o);
  // Square: shorter side to 32 -> 32x64, centre crop left 16.
  auto sq = ds.get(0);
  EXPECT_EQ(sq.at("pixel_values").sizes(), (c10::IntArrayRef{3, 32, 32}));
  EXPECT_TRUE(torch::equal(sq.at("original_size"), torch::tensor({30, 60}, torch::kLong)));
  EXPECT_TRUE(torch::equal(sq.at("crop_top_left"), torch::tensor({0, 16}, torch::kLong)));
  // Bucket 16x48: covering needs width 48 -> 24x48, centre crop top 4, left 0.
  ds.set_target_sizes({{16, 48}});
  auto b = ds.get(0);
  EXPECT_EQ(b.at("pixel_values").sizes(), (c10::IntArrayRef{3, 16, 48}));
  EXPECT_TRUE(torch::equal(b.at("crop_top_left"), torch::tensor({4, 0}, torch::kLong)));
  // Random crops and flips: the corner is the crop's in the flipped image.
  o.center_crop = false;
  o.random_flip = true;
  data::ImageFolderDataset rnd(o);
  rnd.set_target_sizes({{32, 32}});
  bool saw_flip = false, saw_plain = false;
  for (int64_t epoch = 0; epoch < 12; ++epoch) {
    rnd.set_epoch(epoch);
    auto ex = rnd.get(0);
    const int64_t left = ex.at("crop_top_left")[1].item<int64_t>();
    ASSERT_GE(left, 0);
    ASSERT_LE(left, 32);
    // The ramp rises left to right unless flipped.
    const auto row = ex.at("pixel_values")[0][0];
    const bool flipped = row[0].item<float>() > row[31].item<float>();
    // In the image as seen (flipped or not), the crop starts at `left`: its first pixel is the
    // ramp's value there.
    const auto seen =
        flipped ? torch::arange(60, torch::kFloat).flip(0) : torch::arange(60, torch::kFloat);
    // Resize 30x60 -> 32x64: pixel x of the output samples near input x * 60 / 64.
    const double expect =
        seen[static_cast<int64_t>(std::lround((left + 0.5) * 60.0 / 64.0 - 0.5))].item<double>() /
            59 * 2 -
        1;
    EXPECT_NEAR(row[0].item<double>(), expect, 0.08) << "epoch " << epoch << " left " << left;
    (flipped ? saw_flip : saw_plain) = true;
  }
  EXPECT_TRUE(saw_flip && saw_plain);
  EXPECT_NE(test::error_of([&] {
              ds.set_target_sizes({{16, 48}, {16, 48}});
            }).find("one per image"),
            std::string::npos);
}

}  // namespace
}  // namespace difftrain
