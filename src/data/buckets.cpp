#include "difftrain/data/buckets.h"

#include "difftrain/core/error.h"

#include <ATen/CPUGeneratorImpl.h>
#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <map>
#include <set>

namespace difftrain::data {

std::vector<std::array<int64_t, 2>> make_buckets(const BucketOptions& o) {
  if (o.step < 1) throw Error(fmt::format("bucket step must be >= 1, got {}", o.step));
  const int64_t r = o.resolution;
  if (r < o.step) {
    throw Error(fmt::format("--resolution {} is smaller than the bucket step {}", r, o.step));
  }
  auto round_to_step = [&](int64_t v) { return std::max(o.step, v / o.step * o.step); };
  const int64_t lo = o.min_side > 0 ? round_to_step(o.min_side) : round_to_step(r / 2);
  const int64_t hi = o.max_side > 0 ? round_to_step(o.max_side) : round_to_step(2 * r);
  if (lo > hi) {
    throw Error(
        fmt::format("bucket sides: the smallest ({}) is larger than the largest ({})", lo, hi));
  }
  const int64_t area = r * r;
  std::set<std::array<int64_t, 2>> found;
  for (int64_t w = lo; w <= hi; w += o.step) {
    const int64_t h = std::min(hi, area / w / o.step * o.step);
    if (h < lo) continue;
    found.insert({h, w});
    found.insert({w, h});
  }
  std::vector<std::array<int64_t, 2>> out(found.begin(), found.end());
  std::stable_sort(out.begin(), out.end(), [](const auto& a, const auto& b) {
    return a[0] * b[1] < b[0] * a[1];  // h/w ascending
  });
  return out;
}

int64_t nearest_bucket(const std::vector<std::array<int64_t, 2>>& buckets, int64_t height,
                       int64_t width) {
  const double ratio = std::log(static_cast<double>(height) / static_cast<double>(width));
  int64_t best = -1;
  double best_err = 0;
  for (size_t i = 0; i < buckets.size(); ++i) {
    const double err = std::abs(
        ratio - std::log(static_cast<double>(buckets[i][0]) / static_cast<double>(buckets[i][1])));
    const bool better = best < 0 || err < best_err - 1e-12 ||
                        (std::abs(err - best_err) <= 1e-12 &&
                         buckets[i][0] * buckets[i][1] > buckets[static_cast<size_t>(best)][0] *
                                                             buckets[static_cast<size_t>(best)][1]);
    if (better) {
      best = static_cast<int64_t>(i);
      best_err = err;
    }
  }
  return best;
}

namespace {
std::vector<int64_t> nearest_buckets(const std::vector<std::array<int64_t, 2>>& buckets,
                                     const std::vector<std::array<int64_t, 2>>& image_sizes) {
  if (image_sizes.empty()) throw Error("aspect-ratio buckets need at least one image");
  if (buckets.empty()) throw Error("aspect-ratio buckets: no bucket sizes");
  std::vector<int64_t> out;
  for (const auto& s : image_sizes) out.push_back(nearest_bucket(buckets, s[0], s[1]));
  return out;
}
}  // namespace

BucketLayout::BucketLayout(std::vector<std::array<int64_t, 2>> buckets,
                           const std::vector<std::array<int64_t, 2>>& image_sizes, int64_t group)
    : BucketLayout(buckets, nearest_buckets(buckets, image_sizes), group) {}

BucketLayout::BucketLayout(std::vector<std::array<int64_t, 2>> buckets,
                           std::vector<int64_t> image_bucket, int64_t group)
    : buckets_(std::move(buckets)), image_bucket_(std::move(image_bucket)), group_(group) {
  if (group < 1) throw Error(fmt::format("bucket group must be >= 1, got {}", group));
  if (image_bucket_.empty()) throw Error("buckets need at least one item");
  std::map<int64_t, std::vector<int64_t>> members;  // bucket -> images, in image order
  for (size_t i = 0; i < image_bucket_.size(); ++i) {
    const int64_t b = image_bucket_[i];
    if (b < 0 || b >= static_cast<int64_t>(buckets_.size())) {
      throw Error(fmt::format("item {} is given bucket {} of {}", i, b, buckets_.size()));
    }
    members[b].push_back(static_cast<int64_t>(i));
  }
  for (const auto& [b, images] : members) {
    const int64_t n = static_cast<int64_t>(images.size());
    const int64_t padded = (n + group - 1) / group * group;
    runs_.emplace_back(static_cast<int64_t>(slot_image_.size()), padded);
    run_bucket_.push_back(b);
    for (int64_t k = 0; k < padded; ++k) slot_image_.push_back(images[static_cast<size_t>(k % n)]);
  }
}

std::array<int64_t, 2> BucketLayout::image_bucket(int64_t image) const {
  return buckets_.at(static_cast<size_t>(image_bucket_.at(static_cast<size_t>(image))));
}

std::vector<std::array<int64_t, 2>> BucketLayout::image_targets() const {
  std::vector<std::array<int64_t, 2>> out;
  for (int64_t b : image_bucket_) out.push_back(buckets_[static_cast<size_t>(b)]);
  return out;
}

std::vector<int64_t> BucketLayout::epoch_order(uint64_t seed, int64_t epoch) const {
  auto gen = at::detail::createCPUGenerator(seed + static_cast<uint64_t>(epoch));
  const auto opts = torch::TensorOptions().dtype(torch::kLong);
  std::vector<std::vector<int64_t>> groups;
  for (const auto& [first, count] : runs_) {
    const auto perm = torch::randperm(count, gen, opts);
    const int64_t* p = perm.data_ptr<int64_t>();
    for (int64_t g = 0; g < count; g += group_) {
      std::vector<int64_t> run;
      for (int64_t k = g; k < g + group_; ++k) run.push_back(first + p[k]);
      groups.push_back(std::move(run));
    }
  }
  const auto order = torch::randperm(static_cast<int64_t>(groups.size()), gen, opts);
  std::vector<int64_t> out;
  out.reserve(slot_image_.size());
  for (int64_t i = 0; i < order.numel(); ++i) {
    const auto& run = groups[static_cast<size_t>(order.data_ptr<int64_t>()[i])];
    out.insert(out.end(), run.begin(), run.end());
  }
  return out;
}

std::vector<std::string> BucketLayout::summary() const {
  std::map<int64_t, int64_t> count;
  for (int64_t b : image_bucket_) ++count[b];
  std::vector<std::string> out;
  for (const auto& [b, n] : count) {
    const auto& s = buckets_[static_cast<size_t>(b)];
    out.push_back(fmt::format("{}x{}: {} image(s)", s[0], s[1], n));
  }
  return out;
}

}  // namespace difftrain::data
