// The LoRA trainers' options of issue 61 through `difftrain train` on the tiny fixtures: caption
// dropout with cached text embeddings the same on 1 and 2 ranks, shuffled captions on FLUX.1
// (its encoders then kept and run per batch) the same on 1 and 2 ranks, masked loss from a mask
// folder and from alpha under flow matching (a black mask trains nothing, a white one is no mask),
// and Huber losses with multires noise.
#include "train_util.h"

#include "difftrain/io/safetensors.h"
#include "program_paths.h"
#include "source_dir.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::testing {
namespace {

namespace fs = std::filesystem;

const std::string kOptSd = std::string(difftrain_test::source_dir()) + "/tests/golden/sd/tiny_sd";
const std::string kOptFlux =
    std::string(difftrain_test::source_dir()) + "/tests/golden/flux/tiny_flux";

// Eight 32x32 images of coloured squares, captioned with comma-separated tags; with `masks`, a
// mask image of each (all `mask_value`) under masks/.
std::string make_tagged_folder(const std::string& dir, int mask_value = -1) {
  fs::create_directories(dir + "/data");
  std::ofstream meta(dir + "/data/metadata.jsonl");
  for (int i = 0; i < 8; ++i) {
    auto img = torch::zeros({3, 32, 32});
    const auto& [name, rgb] = kCaptionColours[static_cast<size_t>(i % 4)];
    const int64_t off = i < 4 ? 4 : 16;
    for (int ch = 0; ch < 3; ++ch) img[ch].narrow(0, off, 12).narrow(1, off, 12).fill_(rgb[ch]);
    const std::string file = "img" + std::to_string(i) + ".png";
    add_captioned_image(dir + "/data", meta, file, img,
                        "sks, " + name + ", square, " + (i < 4 ? "top left" : "bottom right") +
                            ", grey background");
    if (mask_value >= 0) {
      fs::create_directories(dir + "/masks");
      io::save_png(dir + "/masks/" + file, torch::full({32, 32, 1}, mask_value, torch::kUInt8));
    }
  }
  return dir + "/data";
}

std::vector<std::string> sd_cmd(const std::string& data, const std::string& out,
                                std::vector<std::string> extra) {
  std::vector<std::string> flags = {
      "--resolution",    "32",       "--center_crop",           "--lora",
      "--rank",          "4",        "--learning_rate",         "1e-2",
      "--lr_scheduler",  "constant", "--lr_warmup_steps",       "0",
      "--use_ema",       "false",    "--num_validation_images", "0",
      "--logging_steps", "1"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return folder_train_cmd(kOptSd, data, out, flags);
}

// A FLUX.1 LoRA run of the tiny folder on `data` at 32 px, then `extra`.
std::vector<std::string> flux_cmd(const std::string& data, const std::string& out,
                                  const std::vector<std::string>& extra) {
  std::vector<std::string> flags = {"--resolution",    "32",   "--center_crop",           "--lora",
                                    "--rank",          "4",    "--max_sequence_length",   "16",
                                    "--learning_rate", "1e-2", "--num_validation_images", "0",
                                    "--logging_steps", "1"};
  flags.insert(flags.end(), extra.begin(), extra.end());
  return folder_train_cmd(kOptFlux, data, out, flags);
}

io::TensorMap lora_of(const std::string& out) {
  return io::load_safetensors(out + "/pytorch_lora_weights.safetensors").tensors;
}

double largest(const io::TensorMap& m) {
  double v = 0;
  for (const auto& [key, t] : m) v = std::max(v, t.abs().max().item<double>());
  return v;
}

TEST(TrainingOptionsCli, CaptionDropoutWithCachedTextIsTheSameOnOneAndTwoRanks) {
  const std::string dir = make_temp_dir("opt_dropout");
  const std::string data = make_tagged_folder(dir);
  auto cmd = [&](const std::string& out, const std::string& batch, const std::string& rate) {
    return sd_cmd(data, out,
                  {"--max_train_steps", "4", "--train_batch_size", batch, "--cache_latents",
                   "--caption_dropout_rate", rate, "--caption_prefix", "photo of", "--cache_dir",
                   dir + "/cache-" + rate});
  };
  auto one = train(cmd(dir + "/one", "2", "0.5"), 1, 600);
  ASSERT_EQ(one.exit_code, 0) << one.log();
  auto two = train(cmd(dir + "/two", "1", "0.5"), 2, 600);
  ASSERT_EQ(two.exit_code, 0) << two.log();
  auto none = train(cmd(dir + "/none", "2", "0"), 1, 600);
  ASSERT_EQ(none.exit_code, 0) << none.log();
  const auto a = lora_of(dir + "/one"), b = lora_of(dir + "/two"), c = lora_of(dir + "/none");
  const double ranks = max_abs_diff(a, b), dropout = max_abs_diff(a, c);
  std::cout << "caption dropout: 2 ranks vs 1 rank " << ranks << ", dropout vs none " << dropout
            << " (weights up to " << largest(a) << ")\n";
  // Adam at lr 1e-2 turns summation-order differences of near-zero gradients into steps of up
  // to ~1e-4; a sample captioned differently on one side moves the losses below far more.
  EXPECT_LE(ranks, 5e-4 * std::max(1.0, largest(a)));
  EXPECT_GT(dropout, 1e-2);  // some captions did drop, and the empty one was in the cache
  const auto la = losses(dir + "/one"), lb = losses(dir + "/two");
  ASSERT_EQ(la.size(), lb.size());
  for (size_t i = 0; i < la.size(); ++i) EXPECT_NEAR(la[i], lb[i], 1e-5 * std::abs(la[i]));
}

TEST(TrainingOptionsCli, ShuffledCaptionsOnFluxKeepTheEncodersAndAreRankInvariant) {
  const std::string dir = make_temp_dir("opt_shuffle");
  const std::string data = make_tagged_folder(dir);
  auto cmd = [&](const std::string& out, const std::string& batch, bool shuffle) {
    std::vector<std::string> extra = {"--train_batch_size", batch,      "--max_train_steps", "3",
                                      "--lr_scheduler",     "constant", "--lr_warmup_steps", "0",
                                      "--loss_type",        "huber"};
    if (shuffle) extra.insert(extra.end(), {"--shuffle_caption", "--keep_tokens", "1"});
    return flux_cmd(data, out, extra);
  };
  auto one = train(cmd(dir + "/one", "2", true), 1, 600);
  ASSERT_EQ(one.exit_code, 0) << one.log();
  EXPECT_EQ(one.err.find("text encoders released"), std::string::npos) << one.log();
  auto two = train(cmd(dir + "/two", "1", true), 2, 600);
  ASSERT_EQ(two.exit_code, 0) << two.log();
  auto plain = train(cmd(dir + "/plain", "2", false), 1, 600);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  EXPECT_NE(plain.err.find("text encoders released"), std::string::npos) << plain.log();
  const auto a = lora_of(dir + "/one"), b = lora_of(dir + "/two"), c = lora_of(dir + "/plain");
  const double ranks = max_abs_diff(a, b), shuffled = max_abs_diff(a, c);
  std::cout << "shuffled captions: 2 ranks vs 1 rank " << ranks << ", shuffled vs plain "
            << shuffled << "\n";
  EXPECT_LE(ranks, 1e-4 * std::max(1.0, largest(a)));
  EXPECT_GT(shuffled, 1e-5);
}

TEST(TrainingOptionsCli, MaskedLossBlackTrainsNothingAndWhiteIsNoMask) {
  const std::string dir = make_temp_dir("opt_mask");
  const std::string black = make_tagged_folder(dir + "/black", 0);
  const std::string white = make_tagged_folder(dir + "/white", 255);
  const auto base = [&](const std::string& data, const std::string& out) {
    return sd_cmd(data, out, {"--max_train_steps", "3", "--train_batch_size", "2"});
  };
  // Black masks (served from the latent cache's masks): every loss is 0 and LoRA's up
  // projections, which start at 0, never move.
  auto c = base(black, dir + "/black_run");
  c.insert(c.end(),
           {"--masked_loss", "--conditioning_data_dir", dir + "/black/masks", "--cache_latents"});
  auto zero = train(c, 1, 600);
  ASSERT_EQ(zero.exit_code, 0) << zero.log();
  for (double l : losses(dir + "/black_run")) EXPECT_EQ(l, 0.0);
  int ups = 0;
  for (const auto& [key, t] : lora_of(dir + "/black_run")) {
    if (key.find("lora.up") != std::string::npos || key.find("lora_B") != std::string::npos) {
      ++ups;
      EXPECT_EQ(t.abs().max().item<double>(), 0.0) << key;
    }
  }
  EXPECT_GT(ups, 0);
  // White masks: bit for bit the run without --masked_loss.
  auto w = base(white, dir + "/white_run");
  w.insert(w.end(), {"--masked_loss", "--conditioning_data_dir", dir + "/white/masks"});
  auto masked = train(w, 1, 600);
  ASSERT_EQ(masked.exit_code, 0) << masked.log();
  auto plain = train(base(white, dir + "/plain_run"), 1, 600);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  EXPECT_EQ(max_abs_diff(lora_of(dir + "/white_run"), lora_of(dir + "/plain_run")), 0.0);
  EXPECT_GT(largest(lora_of(dir + "/plain_run")), 0.0);
}

// Flow matching with masks from the images' alpha: fully transparent images train nothing (a
// zero loss, LoRA's up projections stay 0); the same images opaque train as without a mask.
TEST(TrainingOptionsCli, AlphaMasksUnderFlowMatching) {
  const std::string dir = make_temp_dir("opt_alpha");
  for (const auto& [name, alpha] :
       std::vector<std::pair<std::string, int>>{{"clear", 0}, {"opaque", 255}}) {
    const std::string data = dir + "/" + name;
    fs::create_directories(data);
    std::ofstream meta(data + "/metadata.jsonl");
    for (int i = 0; i < 4; ++i) {
      auto img = torch::full({32, 32, 4}, 128, torch::kUInt8);
      img.narrow(0, 4 + 4 * i, 12).narrow(1, 8, 12).select(2, i % 3).fill_(255);
      img.select(2, 3).fill_(alpha);
      const std::string file = "img" + std::to_string(i) + ".png";
      io::save_png(data + "/" + file, img);
      meta << nlohmann::json({{"file_name", file}, {"text", "a square, grey"}}).dump() << "\n";
    }
  }
  auto cmd = [&](const std::string& data, const std::string& out, bool masked) {
    std::vector<std::string> extra = {"--train_batch_size", "2",           "--max_train_steps", "2",
                                      "--weighting_scheme", "logit_normal"};
    if (masked) extra.push_back("--masked_loss");
    return flux_cmd(data, out, extra);
  };
  auto clear = train(cmd(dir + "/clear", dir + "/clear_run", true), 1, 600);
  ASSERT_EQ(clear.exit_code, 0) << clear.log();
  for (double l : losses(dir + "/clear_run")) EXPECT_EQ(l, 0.0);
  int ups = 0;
  for (const auto& [key, t] : lora_of(dir + "/clear_run")) {
    if (key.find("lora_B") != std::string::npos || key.find("lora.up") != std::string::npos) {
      ++ups;
      EXPECT_EQ(t.abs().max().item<double>(), 0.0) << key;
    }
  }
  EXPECT_GT(ups, 0);
  auto opaque = train(cmd(dir + "/opaque", dir + "/opaque_run", true), 1, 600);
  ASSERT_EQ(opaque.exit_code, 0) << opaque.log();
  auto plain = train(cmd(dir + "/opaque", dir + "/plain_run", false), 1, 600);
  ASSERT_EQ(plain.exit_code, 0) << plain.log();
  EXPECT_EQ(max_abs_diff(lora_of(dir + "/opaque_run"), lora_of(dir + "/plain_run")), 0.0);
  EXPECT_GT(largest(lora_of(dir + "/plain_run")), 0.0);
}

TEST(TrainingOptionsCli, HuberLossAndMultiresNoiseChangeTheRun) {
  const std::string dir = make_temp_dir("opt_huber");
  const std::string data = make_tagged_folder(dir);
  const auto run_with = [&](const std::string& name, std::vector<std::string> flags) {
    std::vector<std::string> f = {"--max_train_steps", "3", "--train_batch_size", "2"};
    f.insert(f.end(), flags.begin(), flags.end());
    auto r = train(sd_cmd(data, dir + "/" + name, f), 1, 600);
    EXPECT_EQ(r.exit_code, 0) << r.log();
    return losses(dir + "/" + name);
  };
  const auto l2 = run_with("l2", {});
  const auto huber = run_with("huber", {"--loss_type", "huber", "--huber_schedule", "snr"});
  const auto smooth = run_with(
      "smooth", {"--loss_type", "smooth_l1", "--huber_schedule", "constant", "--huber_c", "0.5"});
  const auto multires = run_with(
      "multires", {"--multires_noise_iterations", "6", "--multires_noise_discount", "0.3"});
  ASSERT_EQ(l2.size(), 3u);
  for (const auto* l : {&huber, &smooth, &multires}) {
    ASSERT_EQ(l->size(), 3u);
    for (double v : *l) EXPECT_TRUE(std::isfinite(v));
  }
  // The first step sees the same noise and weights under l2 and the Huber losses: Huber with a
  // threshold c is below l2 wherever |d| > c, and 2c(sqrt(d^2 + c^2) - c) <= d^2 always.
  EXPECT_LT(huber[0], l2[0]);
  EXPECT_NE(smooth[0], l2[0]);
  EXPECT_NE(multires[0], l2[0]);
}

}  // namespace
}  // namespace difftrain::testing
