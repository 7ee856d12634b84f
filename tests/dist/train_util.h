#pragma once
// Shared by the `difftrain train` end-to-end tests: a tiny UNet config, the command line around
// it, running it (under `difftrain launch` for several ranks) and comparing exported weights.

#include "subprocess.h"

#include "difftrain/io/image.h"
#include "difftrain/io/safetensors.h"
#include "program_paths.h"

#include <gtest/gtest.h>
#include <torch/torch.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <filesystem>
#include <fstream>
#include <sstream>
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

// `difftrain train` of the pretrained folder `model` on the image folder `data` into `out`,
// then `flags`.
inline std::vector<std::string> folder_train_cmd(const std::string& model, const std::string& data,
                                                 const std::string& out,
                                                 std::vector<std::string> flags) {
  std::vector<std::string> cmd = {"train",
                                  "--pretrained_model_name_or_path",
                                  model,
                                  "--dataset",
                                  "imagefolder",
                                  "--train_data_dir",
                                  data,
                                  "--output_dir",
                                  out};
  cmd.insert(cmd.end(), flags.begin(), flags.end());
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

// What an export's README.md model card must say (train/model_card.h).
struct ExpectedCard {
  std::string base_model;  ///< "" = no base_model key (trained from scratch)
  std::string license;
  std::vector<std::string> tags;  ///< besides diffusers, diffusers-training, difftrain
  bool lora = false;              ///< tags lora and template:sd-lora
  std::string instance_prompt;    ///< "" = no key
  size_t widgets = 0;             ///< validation images named (and written beside it)
  std::string widget_text;        ///< every widget's text ("" = not checked)
};

// Checks the model card in `out`: its YAML front matter parses and holds the Hub's fields, and
// each widget's image lies beside it. Returns the card's text.
inline std::string expect_model_card(const std::string& out, const ExpectedCard& e) {
  std::ifstream in(out + "/README.md");
  EXPECT_TRUE(in.good()) << out << "/README.md is missing";
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string text = ss.str();
  const auto end = text.find("\n---\n", 4);
  EXPECT_EQ(text.rfind("---\n", 0), 0u) << text;
  if (text.rfind("---\n", 0) != 0 || end == std::string::npos) return text;
  YAML::Node y;
  try {
    y = YAML::Load(text.substr(4, end - 4));
  } catch (const YAML::Exception& ex) {
    ADD_FAILURE() << "the card's front matter is not YAML: " << ex.what() << "\n" << text;
    return text;
  }
  if (e.base_model.empty()) {
    EXPECT_FALSE(y["base_model"]) << text;
  } else {
    EXPECT_EQ(y["base_model"].as<std::string>(""), e.base_model) << text;
  }
  EXPECT_EQ(y["library_name"].as<std::string>(""), "diffusers") << text;
  EXPECT_EQ(y["license"].as<std::string>(""), e.license) << text;
  std::vector<std::string> tags;
  for (const auto& t : y["tags"]) tags.push_back(t.as<std::string>());
  auto want = e.tags;
  want.insert(want.end(), {"diffusers", "diffusers-training", "difftrain"});
  if (e.lora) want.insert(want.end(), {"lora", "template:sd-lora"});
  for (const auto& t : want) {
    EXPECT_NE(std::find(tags.begin(), tags.end(), t), tags.end()) << "tag " << t << "\n" << text;
  }
  if (!e.lora) {
    EXPECT_EQ(std::find(tags.begin(), tags.end(), "lora"), tags.end()) << text;
  }
  if (e.instance_prompt.empty()) {
    EXPECT_FALSE(y["instance_prompt"]) << text;
  } else {
    EXPECT_EQ(y["instance_prompt"].as<std::string>(""), e.instance_prompt) << text;
  }
  EXPECT_EQ(y["widget"].size(), e.widgets) << text;
  for (size_t i = 0; i < y["widget"].size(); ++i) {
    const auto url = y["widget"][i]["output"]["url"].as<std::string>("");
    EXPECT_TRUE(std::filesystem::exists(out + "/" + url)) << url;
    if (!e.widget_text.empty()) {
      EXPECT_EQ(y["widget"][i]["text"].as<std::string>(""), e.widget_text) << text;
    }
  }
  if (e.widgets == 0) {
    EXPECT_FALSE(std::filesystem::exists(out + "/image_0.png"));
  }
  return text;
}

}  // namespace difftrain::testing
