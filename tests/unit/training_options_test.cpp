// The LoRA trainers' options of issue 61, unit by unit: kohya's caption processing
// (train/caption_processing.h), the element-wise losses and Huber schedules, masked loss and
// multi-resolution noise (diffusion/objective.h), and the masks of an image folder
// (data/image_folder.h), each against a float64 or hand recomputation of kohya's code.
#include "difftrain/core/error.h"
#include "difftrain/core/sample_rng.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/diffusion/flow_match_objective.h"
#include "difftrain/diffusion/objective.h"
#include "difftrain/diffusion/scheduler_config.h"
#include "difftrain/io/image.h"
#include "difftrain/train/caption_processing.h"
#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <string>
#include <vector>

namespace difftrain::test {
namespace {
namespace fs = std::filesystem;

// Checks max |a - b| <= tol (float64) and prints the difference seen.
void expect_near_all(const torch::Tensor& a, const torch::Tensor& b, double tol,
                     const std::string& what) {
  const double diff = max_abs(a.to(torch::kFloat64), b.to(torch::kFloat64));
  std::printf("%s: max abs diff %.3g (tolerance %.0e)\n", what.c_str(), diff, tol);
  EXPECT_LE(diff, tol) << what;
}

// ---------------------------------------------------------------- captions

TEST(CaptionProcessing, PrefixAndSuffixAreJoinedWithASpace) {
  train::CaptionProcessing p;
  p.prefix = "sks style,";
  p.suffix = ", best";
  EXPECT_TRUE(p.affixes());
  EXPECT_EQ(p.fixed("a dog"), "sks style, a dog , best");
  EXPECT_FALSE(p.drops());
  EXPECT_FALSE(p.varies());
  // Nothing drawn: the caption passes through.
  EXPECT_EQ(p.apply("a dog", 1, 0, 3), "a dog");
}

TEST(CaptionProcessing, DropoutIsPerSampleReproducibleAndAtItsRate) {
  train::CaptionProcessing p;
  p.dropout_rate = 0.3;
  int dropped = 0;
  for (int64_t key = 0; key < 2000; ++key) {
    const auto once = p.apply("a cat", 7, 2, key);
    EXPECT_EQ(once, p.apply("a cat", 7, 2, key)) << "key " << key;  // the same draw again
    EXPECT_TRUE(once.empty() || once == "a cat");
    dropped += once.empty() ? 1 : 0;
    // The draw is the first of the sample's caption stream.
    auto g = core::sample_generator(7, 2, key, core::SampleStream::kCaption);
    EXPECT_EQ(once.empty(), torch::rand({1}, g, torch::kFloat64).item<double>() < 0.3);
  }
  std::printf("dropped %d of 2000 at rate 0.3\n", dropped);
  EXPECT_NEAR(dropped / 2000.0, 0.3, 0.04);
  // Another epoch draws anew.
  int same = 0;
  for (int64_t key = 0; key < 200; ++key) {
    same += p.apply("a cat", 7, 2, key) == p.apply("a cat", 7, 3, key) ? 1 : 0;
  }
  EXPECT_LT(same, 200);
}

TEST(CaptionProcessing, EveryNEpochsCountsEpochsFromOneAsKohya) {
  train::CaptionProcessing p;
  p.dropout_every_n_epochs = 3;
  for (int64_t epoch = 0; epoch < 9; ++epoch) {
    // kohya's current_epoch = epoch + 1: epochs 3, 6, 9 (0-based 2, 5, 8) drop every caption.
    const bool drop = (epoch + 1) % 3 == 0;
    for (int64_t key = 0; key < 5; ++key) {
      EXPECT_EQ(p.apply("a cat", 0, epoch, key).empty(), drop) << "epoch " << epoch;
    }
  }
}

TEST(CaptionProcessing, ShuffleKeepsTheFixedTagsAndPermutesTheRest) {
  train::CaptionProcessing p;
  p.shuffle = true;
  p.keep_tokens = 2;
  const std::string caption = "sks, dog,  red ,blue, green, on grass";
  std::set<std::string> orders;
  for (int64_t key = 0; key < 50; ++key) {
    const auto out = p.apply(caption, 0, 0, key);
    orders.insert(out);
    // kohya: tags stripped, the first keep_tokens in place, joined with ", ".
    ASSERT_EQ(out.rfind("sks, dog, ", 0), 0u) << out;
    std::multiset<std::string> tags;
    size_t start = 0;
    while (true) {
      const auto at = out.find(", ", start);
      tags.insert(out.substr(start, at == std::string::npos ? at : at - start));
      if (at == std::string::npos) break;
      start = at + 2;
    }
    EXPECT_EQ(tags, (std::multiset<std::string>{"sks", "dog", "red", "blue", "green", "on grass"}));
  }
  EXPECT_GT(orders.size(), 10u);  // 4! = 24 orders of the free tags
}

TEST(CaptionProcessing, KeepTokensSeparatorFixesAPrefixAndASuffix) {
  train::CaptionProcessing p;
  p.shuffle = true;
  p.keep_tokens = 5;  // ignored: the separator is in the caption
  p.keep_tokens_separator = "|||";
  for (int64_t key = 0; key < 20; ++key) {
    const auto out = p.apply("sks dog, photo ||| a, b, c ||| masterpiece", 0, 0, key);
    EXPECT_EQ(out.rfind("sks dog, photo, ", 0), 0u) << out;
    EXPECT_EQ(out.substr(out.size() - std::string(", masterpiece").size()), ", masterpiece") << out;
    EXPECT_EQ(out.size(), std::string("sks dog, photo, a, b, c, masterpiece").size()) << out;
  }
}

TEST(CaptionProcessing, TagDropoutDropsFreeTagsOnlyAndAnotherSeparatorSplits) {
  train::CaptionProcessing p;
  p.tag_dropout_rate = 0.5;
  p.keep_tokens = 1;
  p.separator = ";";
  std::map<size_t, int> counts;
  for (int64_t key = 0; key < 400; ++key) {
    const auto out = p.apply("sks;a;b;c;d", 3, 1, key);
    ASSERT_EQ(out.rfind("sks", 0), 0u) << out;
    // Order kept (no shuffle), joined with ", " as kohya joins.
    std::string expected = "sks";
    auto g = core::sample_generator(3, 1, key, core::SampleStream::kCaption);
    for (const char* t : {"a", "b", "c", "d"}) {
      if (torch::rand({1}, g, torch::kFloat64).item<double>() >= 0.5)
        expected += std::string(", ") + t;
    }
    EXPECT_EQ(out, expected);
    counts[out.size()]++;
  }
  EXPECT_GT(counts.size(), 3u);
}

// ---------------------------------------------------------------- losses

std::shared_ptr<diffusion::NoiseScheduler> ddpm() {
  diffusion::SchedulerConfig sc;
  sc.class_name = "DDPMScheduler";
  sc.num_train_timesteps = 1000;
  sc.beta_schedule = diffusion::parse_beta_schedule("scaled_linear");
  sc.beta_start = 0.00085;
  sc.beta_end = 0.012;
  return diffusion::make_scheduler(sc, "ddpm");
}

// kohya's conditional_loss (reduction "none") in float64.
torch::Tensor kohya_loss(const torch::Tensor& pred, const torch::Tensor& target,
                         const std::string& type, const torch::Tensor& c) {
  const auto d = pred.to(torch::kFloat64) - target.to(torch::kFloat64);
  if (type == "l2") return d.pow(2);
  if (type == "l1") return d.abs();
  const auto cc = c.to(torch::kFloat64).view({-1, 1, 1, 1});
  const auto s = torch::sqrt(d.pow(2) + cc.pow(2)) - cc;
  return type == "huber" ? 2 * cc * s : 2 * s;
}

TEST(Losses, DdpmHuberSchedulesAndTypesMatchKohya) {
  const auto scheduler = ddpm();
  // alphas_cumprod in float64, from the betas of scaled_linear.
  const auto betas =
      torch::linspace(std::sqrt(0.00085), std::sqrt(0.012), 1000, torch::kFloat64).pow(2);
  const auto alpha_bar = torch::cumprod(1 - betas, 0);
  const auto x0 = torch::randn({4, 3, 6, 6}, torch::kFloat32);
  const std::vector<int64_t> keys = {0, 1, 2, 3};
  for (const std::string schedule : {"constant", "exponential", "snr"}) {
    for (const std::string type : {"l2", "l1", "huber", "smooth_l1"}) {
      diffusion::DdpmObjectiveOptions o;
      o.seed = 5;
      o.loss.loss_type = type;
      o.loss.huber_schedule = schedule;
      o.loss.huber_c = 0.2;
      o.loss.huber_scale = 1.5;
      diffusion::DdpmObjective obj(scheduler, o);
      const auto b = obj.noise(x0, keys, 0, torch::kCPU);
      const auto pred = b.target + 0.7 * torch::randn_like(b.target);
      const auto t = b.timesteps.to(torch::kFloat64);
      torch::Tensor c;
      if (schedule == "constant") {
        c = torch::full({4}, 0.2 * 1.5, torch::kFloat64);
      } else if (schedule == "exponential") {
        c = torch::exp(-(-std::log(0.2) / 1000.0) * t) * 1.5;
      } else {
        const auto ab = alpha_bar.index_select(0, b.timesteps);
        const auto sigma = ((1 - ab) / ab).sqrt();
        c = (1 - 0.2) / (1 + sigma).pow(2) + 0.2;
      }
      if (type == "huber" || type == "smooth_l1") {
        ASSERT_TRUE(b.huber_c.defined());
        expect_near_all(b.huber_c, c, 1e-5, "huber_c " + schedule);
      } else {
        EXPECT_FALSE(b.huber_c.defined());
      }
      const auto expected = kohya_loss(pred, b.target, type, c).mean({1, 2, 3});
      expect_near_all(obj.losses(pred, b), expected, 2e-5, type + " / " + schedule);
    }
  }
}

TEST(Losses, FlowMatchingHuberUsesSigmaTimesThousandAndRefusesSnr) {
  const nlohmann::json config = {{"_class_name", "FlowMatchEulerDiscreteScheduler"},
                                 {"num_train_timesteps", 1000},
                                 {"shift", 1.0}};
  diffusion::FlowMatchOptions o;
  o.timestep_sampling = "uniform";
  o.loss.loss_type = "huber";
  o.loss.huber_schedule = "snr";
  try {
    diffusion::FlowMatchObjective bad(config, "test", o);
    FAIL() << "snr under flow matching was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("--huber_schedule snr"), std::string::npos) << e.what();
  }
  o.loss.huber_schedule = "exponential";
  o.loss.huber_c = 0.1;
  diffusion::FlowMatchObjective obj(config, "test", o);
  const auto x0 = torch::randn({3, 4, 4, 4});
  const auto b = obj.noise(x0, {0, 1, 2}, 0, torch::kCPU);
  // kohya's FLUX.1 timesteps are sigma x 1000; uniform sampling gives t = 1000 sigma too.
  const auto c = torch::exp(-(-std::log(0.1) / 1000.0) * b.timesteps.to(torch::kFloat64));
  expect_near_all(b.huber_c, c, 1e-5, "flow huber_c");
  const auto pred = torch::randn_like(b.target);
  expect_near_all(obj.losses(pred, b), kohya_loss(pred, b.target, "huber", c).mean({1, 2, 3}), 2e-5,
                  "flow huber loss");
  diffusion::LossOptions bad;
  bad.loss_type = "l3";
  EXPECT_THROW(obj.set_loss_options(bad), Error);
  bad.loss_type = "huber";
  bad.huber_c = 0;
  EXPECT_THROW(obj.set_loss_options(bad), Error);
}

TEST(Losses, MaskedLossIsKohyasAreaResizedMaskOverTheMeanOfAllElements) {
  const auto scheduler = ddpm();
  diffusion::DdpmObjectiveOptions o;
  diffusion::DdpmObjective obj(scheduler, o);
  const auto x0 = torch::randn({2, 4, 4, 6});
  const auto b = obj.noise(x0, {0, 1}, 0, torch::kCPU);
  const auto pred = torch::randn_like(b.target);
  // A mask at 8x the latent grid (pixels), with soft values.
  const auto mask = torch::rand({2, 1, 32, 48}, torch::kFloat64);
  // Area interpolation by an integer factor = the mean of each 8 x 8 block.
  const auto area = mask.view({2, 1, 4, 8, 6, 8}).mean({3, 5});
  const auto expected =
      ((pred.to(torch::kFloat64) - b.target.to(torch::kFloat64)).pow(2) * area).mean({1, 2, 3});
  expect_near_all(obj.losses(pred, b, mask.to(torch::kFloat32)), expected, 1e-5, "masked loss");
  // All ones is no mask; all zeros is no loss.
  expect_near_all(obj.losses(pred, b, torch::ones({2, 1, 32, 48})), obj.losses(pred, b), 0, "ones");
  EXPECT_EQ(obj.losses(pred, b, torch::zeros({2, 1, 32, 48})).abs().max().item<double>(), 0.0);
  // A clip's loss: every frame weighed by the image mask.
  const auto clip = torch::randn({2, 4, 3, 4, 6});
  const auto masked = diffusion::apply_loss_mask(clip, mask.to(torch::kFloat32));
  expect_near_all(masked, clip.to(torch::kFloat64) * area.unsqueeze(2), 1e-6, "clip mask");
  EXPECT_THROW(diffusion::apply_loss_mask(clip, torch::ones({2, 3, 8, 8})), Error);
}

// kohya's pyramid_noise_like for one sample in float64, r drawn per level from `g`.
torch::Tensor pyramid_reference(torch::Tensor noise, at::Generator& g, int64_t iterations,
                                double discount) {
  const int64_t H = noise.size(-2), W = noise.size(-1);
  auto x = noise.reshape({1, -1, H, W}).to(torch::kFloat64);
  for (int64_t i = 0; i < iterations; ++i) {
    const double r = torch::rand({1}, g, torch::kFloat64).item<double>() * 2 + 2;
    const int64_t h = std::max<int64_t>(1, static_cast<int64_t>(H / std::pow(r, i)));
    const int64_t w = std::max<int64_t>(1, static_cast<int64_t>(W / std::pow(r, i)));
    const auto level = torch::randn({1, x.size(1), h, w}, g, torch::kFloat32).to(torch::kFloat64);
    x = x + torch::upsample_bilinear2d(level, {H, W}, false) * std::pow(discount, i);
    if (h == 1 || w == 1) break;
  }
  return (x / x.std()).reshape(noise.sizes());
}

TEST(MultiresNoise, PyramidNoiseIsKohyasPerSampleAndUnitVariance) {
  for (const auto& shape : {std::vector<int64_t>{4, 16, 16}, std::vector<int64_t>{4, 3, 8, 12}}) {
    auto g1 = core::sample_generator(1, 0, 0, core::SampleStream::kNoise);
    auto g2 = core::sample_generator(1, 0, 0, core::SampleStream::kNoise);
    const auto base1 = torch::randn(shape, g1, torch::kFloat32);
    const auto base2 = torch::randn(shape, g2, torch::kFloat32);
    const auto got = diffusion::pyramid_noise(base1, g1, 6, 0.3);
    const auto want = pyramid_reference(base2, g2, 6, 0.3);
    expect_near_all(got, want, 1e-5, "pyramid noise");
    EXPECT_NEAR(got.std().item<double>(), 1.0, 1e-5);
  }
  // The DDPM objective adds it after the offset, from the noise stream: with iterations the
  // noise differs from plain noise, and a sample's noise does not depend on its batch mates.
  diffusion::DdpmObjectiveOptions o;
  o.multires_noise_iterations = 4;
  o.seed = 3;
  diffusion::DdpmObjective obj(ddpm(), o);
  diffusion::DdpmObjectiveOptions po;
  po.seed = 3;
  diffusion::DdpmObjective plain(ddpm(), po);
  const auto x0 = torch::zeros({2, 4, 8, 8});
  const auto pair = obj.noise(x0, {10, 11}, 0, torch::kCPU);
  const auto single = obj.noise(x0.narrow(0, 1, 1), {11}, 0, torch::kCPU);
  EXPECT_TRUE(torch::equal(pair.model_input[1], single.model_input[0]));
  EXPECT_FALSE(
      torch::equal(pair.model_input, plain.noise(x0, {10, 11}, 0, torch::kCPU).model_input));
}

// ---------------------------------------------------------------- masks of an image folder

// An RGBA image whose alpha is its red channel: after any crop, resize and flip the mask must
// equal the red channel of pixel_values mapped back to [0, 1].
torch::Tensor red_is_alpha(int64_t h, int64_t w) {
  auto img = torch::randint(0, 256, {h, w, 4}, torch::kUInt8);
  img.select(2, 3).copy_(img.select(2, 0));
  return img;
}

TEST(ImageFolderMasks, AlphaMaskMovesWithCropsFlipsAndBuckets) {
  const auto dir = temp_dir("masks_alpha");
  io::save_png(dir + "/a.png", red_is_alpha(20, 30));
  io::save_png(dir + "/b.png", red_is_alpha(33, 17));
  io::save_png(dir + "/c.png", torch::full({12, 12, 3}, 200, torch::kUInt8));  // opaque
  data::ImageFolderOptions o;
  o.dir = dir;
  o.resolution = 12;
  o.random_flip = true;
  o.masks = true;
  data::ImageFolderDataset ds(o);
  ds.set_target_sizes({{12, 16}, {16, 8}, {12, 12}});
  for (int64_t epoch = 0; epoch < 4; ++epoch) {
    ds.set_epoch(epoch);
    for (int64_t i = 0; i < 2; ++i) {
      const auto ex = ds.get(i);
      const auto& mask = ex.at("mask");
      const auto red = (ex.at("pixel_values")[0] + 1) / 2;
      ASSERT_EQ(mask.sizes(), (std::vector<int64_t>{1, red.size(0), red.size(1)}));
      expect_near_all(mask[0], red.clamp(0, 1), 2e-6, "alpha mask vs red channel");
    }
    const auto opaque = ds.get(2).at("mask");
    EXPECT_EQ(opaque.min().item<float>(), 1.0f);
  }
}

TEST(ImageFolderMasks, MaskFolderAndMetadataColumn) {
  const auto dir = temp_dir("masks_dir");
  auto img = torch::randint(0, 256, {16, 16, 3}, torch::kUInt8);
  io::save_png(dir + "/data/sub/a.png", img);
  // A grey mask of half the size, in the conditioning folder under the same relative name (as
  // .png); its bilinear upsampling to the image then rides along with the image's transforms.
  auto grey = torch::randint(0, 256, {8, 8, 1}, torch::kUInt8);
  io::save_png(dir + "/cond/sub/a.png", grey);
  data::ImageFolderOptions o;
  o.dir = dir + "/data";
  o.resolution = 16;
  o.center_crop = true;
  o.masks = true;
  o.mask_dir = dir + "/cond";
  data::ImageFolderDataset ds(o);
  namespace F = torch::nn::functional;
  const auto up = F::interpolate(grey.permute({2, 0, 1}).unsqueeze(0).to(torch::kFloat),
                                 F::InterpolateFuncOptions()
                                     .size(std::vector<int64_t>{16, 16})
                                     .mode(torch::kBilinear)
                                     .align_corners(false))
                      .round()
                      .div(255.0);
  expect_near_all(ds.get(0).at("mask"), up[0], 1e-6, "mask from the conditioning folder");
  // A missing mask is named.
  io::save_png(dir + "/data/b.png", img);
  try {
    data::ImageFolderDataset missing(o);
    FAIL() << "a missing mask was accepted";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("b.png: no mask in"), std::string::npos) << e.what();
  }
  // metadata.jsonl's "mask" field.
  const auto meta_dir = dir + "/meta";
  io::save_png(meta_dir + "/x.png", img);
  io::save_png(meta_dir + "/masks/x_mask.png", torch::full({16, 16, 1}, 51, torch::kUInt8));
  std::ofstream(meta_dir + "/metadata.jsonl")
      << R"({"file_name": "x.png", "text": "x", "mask": "masks/x_mask.png"})"
      << "\n";
  o.dir = meta_dir;
  o.mask_dir.clear();
  data::ImageFolderDataset meta(o);
  ASSERT_EQ(meta.size(), 1);
  EXPECT_NEAR(meta.get(0).at("mask").mean().item<double>(), 0.2, 1e-6);
}

}  // namespace
}  // namespace difftrain::test
