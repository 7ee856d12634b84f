#pragma once
// Shared by the `difftrain train` end-to-end tests: a tiny UNet config, the command line around
// it, running it (under `difftrain launch` for several ranks) and comparing exported weights.

#include "subprocess.h"

#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "program_paths.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <array>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

namespace difftrain::testing {

inline const std::string kDifftrain = difftrain_test::difftrain_bin();

inline double max_abs_diff(const io::TensorMap& a, const io::TensorMap& b) {
  EXPECT_EQ(a.size(), b.size());
  double worst = 0;
  for (const auto& [key, t] : a) {
    auto it = b.find(key);
    if (it == b.end()) {
      ADD_FAILURE() << "missing " << key;
      continue;
    }
    worst = std::max(
        worst, (t.to(torch::kFloat64) - it->second.to(torch::kFloat64)).abs().max().item<double>());
  }
  return worst;
}

// The "loss" of every line of a run's metrics.jsonl, in order.
inline std::vector<double> losses(const std::string& out) {
  std::ifstream in(out + "/metrics.jsonl");
  std::vector<double> v;
  std::string line;
  while (std::getline(in, line)) {
    auto j = nlohmann::json::parse(line);
    if (j.contains("loss")) v.push_back(j["loss"].get<double>());
  }
  return v;
}

// The four colours the captioned-folder tests paint, as RGB in [-1, 1].
inline const std::vector<std::pair<std::string, std::array<float, 3>>> kCaptionColours = {
    {"red", {1, -1, -1}}, {"green", {-1, 1, -1}}, {"blue", {-1, -1, 1}}, {"yellow", {1, 1, -1}}};

// Writes image `img` [3, H, W] in [-1, 1] as dir/file (PNG) and its line of metadata.jsonl.
inline void add_captioned_image(const std::string& dir, std::ofstream& meta,
                                const std::string& file, const torch::Tensor& img,
                                const std::string& caption) {
  io::save_png(dir + "/" + file, io::to_uint8_images(img.unsqueeze(0))[0]);
  meta << nlohmann::json({{"file_name", file}, {"text", caption}}).dump() << "\n";
}

// Twelve images of three shapes (32x32, 24x48 wide, 48x24 tall): a coloured square on grey,
// captioned with its colour and shape.
inline std::string make_mixed_aspect_folder(const std::string& dir) {
  std::filesystem::create_directories(dir);
  std::ofstream meta(dir + "/metadata.jsonl");
  const std::vector<std::pair<std::string, std::array<int64_t, 2>>> shapes = {
      {"square", {32, 32}}, {"wide", {24, 48}}, {"tall", {48, 24}}};
  for (int i = 0; i < 12; ++i) {
    const auto& [shape, hw] = shapes[static_cast<size_t>(i % 3)];
    const auto& [name, rgb] = kCaptionColours[static_cast<size_t>(i % 4)];
    auto img = torch::zeros({3, hw[0], hw[1]});
    for (int ch = 0; ch < 3; ++ch) {
      img[ch].narrow(0, hw[0] / 4, hw[0] / 2).narrow(1, hw[1] / 4, hw[1] / 2).fill_(rgb[ch]);
    }
    add_captioned_image(dir, meta, "img" + std::to_string(i) + ".png", img,
                        "a " + name + " " + shape + " picture");
  }
  return dir;
}

inline io::TensorMap unet_weights(const std::string& out) {
  return io::load_safetensors(out + "/unet/diffusion_pytorch_model.safetensors").tensors;
}

// A UNet2DModel small enough for tests: 8x8, two levels, attention at the lower one.
inline std::string tiny_config(const std::string& dir) {
  const std::string path = dir + "/tiny_unet.json";
  std::ofstream(path) << R"({"_class_name": "UNet2DModel", "sample_size": 8, "in_channels": 1,
    "out_channels": 1, "layers_per_block": 1, "block_out_channels": [8, 16],
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
    "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "norm_num_groups": 4,
    "attention_head_dim": 8})";
  return path;
}

inline std::vector<std::string> train_cmd(const std::string& dir, const std::string& out,
                                          std::vector<std::string> extra) {
  std::vector<std::string> cmd = {"train",
                                  "--model_config_name_or_path",
                                  tiny_config(dir),
                                  "--resolution",
                                  "8",
                                  "--max_train_samples",
                                  "64",
                                  "--learning_rate",
                                  "1e-3",
                                  "--lr_warmup_steps",
                                  "2",
                                  "--num_validation_images",
                                  "0",
                                  "--logging_steps",
                                  "1",
                                  "--output_dir",
                                  out};
  cmd.insert(cmd.end(), extra.begin(), extra.end());
  return cmd;
}

inline ProcessResult train(const std::vector<std::string>& cmd, int ranks = 1,
                           double timeout = 300) {
  std::vector<std::string> argv = {kDifftrain};
  if (ranks > 1) {
    argv.insert(argv.end(), {"launch", "--num_processes", std::to_string(ranks), kDifftrain});
  }
  argv.insert(argv.end(), cmd.begin(), cmd.end());
  return run(argv, {}, timeout);
}

}  // namespace difftrain::testing
