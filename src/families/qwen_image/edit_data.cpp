// Qwen-Image-Edit training data (edit_data.h).

#include "edit_data.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"
#include "difftrain/models/module_info.h"
#include "qwen_image_pipeline.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <sstream>

namespace difftrain::families::qwen_image {
namespace {
namespace fs = std::filesystem;

const std::vector<std::string>& image_extensions() {
  static const std::vector<std::string> e = {".png", ".jpg", ".jpeg", ".webp", ".bmp"};
  return e;
}

// control/<stem>.<ext>, else control/<stem>_0.<ext>, _1, ... in order.
std::vector<std::string> control_files(const fs::path& control_dir, const std::string& stem) {
  std::error_code ec;
  auto find = [&](const std::string& name) -> std::string {
    for (const auto& ext : image_extensions()) {
      const fs::path p = control_dir / (name + ext);
      if (fs::is_regular_file(p, ec)) return p.string();
    }
    return "";
  };
  if (std::string one = find(stem); !one.empty()) return {one};
  std::vector<std::string> out;
  for (int i = 0;; ++i) {
    std::string f = find(stem + "_" + std::to_string(i));
    if (f.empty()) break;
    out.push_back(f);
  }
  return out;
}

// metadata.jsonl's file_name -> its control_image value(s).
std::map<std::string, std::vector<std::string>> metadata_controls(const fs::path& dir) {
  std::map<std::string, std::vector<std::string>> out;
  const fs::path path = dir / "metadata.jsonl";
  std::error_code ec;
  if (!fs::is_regular_file(path, ec)) return out;
  std::istringstream lines(io::read_file(path.string()));
  std::string line;
  int64_t number = 0;
  while (std::getline(lines, line)) {
    ++number;
    if (line.find_first_not_of(" \t\r") == std::string::npos) continue;
    nlohmann::json j;
    try {
      j = nlohmann::json::parse(line);
    } catch (const nlohmann::json::exception&) {
      continue;  // the image folder reports it
    }
    if (!j.is_object() || !j.contains("file_name") || !j.contains("control_image")) continue;
    const auto& c = j.at("control_image");
    std::vector<std::string> files;
    for (const auto& e : c.is_array() ? c : nlohmann::json::array({c})) {
      if (!e.is_string()) {
        throw Error(fmt::format(
            "{}:{}: control_image must be a path or a list of paths (relative to the folder)",
            path.string(), number));
      }
      files.push_back((dir / e.get<std::string>()).string());
    }
    out[j.at("file_name").get<std::string>()] = files;
  }
  return out;
}

}  // namespace

std::vector<EditPair> find_edit_pairs(const std::string& dir, const std::string& caption_column,
                                      const std::string& caption_extension,
                                      const std::string& instance_prompt) {
  data::ImageFolderOptions io_options;
  io_options.dir = dir;
  io_options.caption_column = caption_column;
  io_options.caption_extension = caption_extension;
  const data::ImageFolderDataset images(io_options);
  const auto from_metadata = metadata_controls(dir);
  const fs::path control_dir = fs::path(dir) / "control";
  std::vector<EditPair> out;
  std::error_code ec;
  for (int64_t i = 0; i < images.size(); ++i) {
    EditPair p;
    p.target = images.file(i);
    const std::string rel = images.relative_file(i);
    if (rel.rfind("control/", 0) == 0) continue;
    if (auto it = from_metadata.find(rel); it != from_metadata.end()) {
      p.controls = it->second;
    } else {
      p.controls = control_files(control_dir, fs::path(rel).stem().string());
    }
    if (p.controls.empty()) {
      throw Error(fmt::format(
          "{}: no control image; Qwen-Image-Edit training pairs each target with control/{}.png "
          "(or control/{}_0.png, _1, ... for several) or a metadata.jsonl control_image field",
          p.target, fs::path(rel).stem().string(), fs::path(rel).stem().string()));
    }
    for (const auto& c : p.controls) {
      if (!fs::is_regular_file(c, ec)) {
        throw Error(c + ": no such control image (named for " + p.target + ")");
      }
    }
    const auto caption = images.caption(i);
    if (caption) {
      p.caption = *caption;
    } else if (!instance_prompt.empty()) {
      p.caption = instance_prompt;
    } else {
      throw Error(p.target +
                  ": no instruction; give it a caption (metadata.jsonl or a sidecar file) or "
                  "--instance_prompt");
    }
    if (!out.empty() && out.front().controls.size() != p.controls.size()) {
      throw Error(fmt::format(
          "{} has {} control image(s) but {} has {}; every pair needs the same number", p.target,
          p.controls.size(), out.front().target, out.front().controls.size()));
    }
    out.push_back(std::move(p));
  }
  if (out.empty()) throw Error(dir + ": no target images with control images");
  return out;
}

torch::Tensor cover_and_center_crop(const torch::Tensor& image, int64_t height, int64_t width) {
  const double scale = std::max(static_cast<double>(height) / static_cast<double>(image.size(0)),
                                static_cast<double>(width) / static_cast<double>(image.size(1)));
  const int64_t h = std::max<int64_t>(
      height, static_cast<int64_t>(std::round(static_cast<double>(image.size(0)) * scale)));
  const int64_t w = std::max<int64_t>(
      width, static_cast<int64_t>(std::round(static_cast<double>(image.size(1)) * scale)));
  const torch::Tensor resized = io::resize_image(image, h, w, io::Resample::kBicubic);
  const int64_t top = (h - height) / 2, left = (w - width) / 2;
  return resized.narrow(0, top, height).narrow(1, left, width).contiguous();
}

std::shared_ptr<data::TensorDataset> encode_edit_pairs(const std::vector<EditPair>& pairs,
                                                       int64_t height, int64_t width,
                                                       EditEncoders& enc,
                                                       const std::function<void()>& progress) {
  torch::NoGradGuard no_grad;
  const torch::Device device = models::module_device(*enc.vae);
  const auto dtype = models::module_dtype(*enc.vae);
  std::vector<torch::Tensor> means, logvars, refs, shapes, embeds, masks;
  int64_t longest = 0;
  for (const auto& p : pairs) {
    const auto to_pixels = [](const torch::Tensor& u8) {
      return (2.0F * (u8.permute({2, 0, 1}).to(torch::kFloat32) / 255.0F) - 1.0F)
          .unsqueeze(0)
          .unsqueeze(2);
    };
    const torch::Tensor target = cover_and_center_crop(io::load_image(p.target, 3), height, width);
    auto post = enc.vae->encode(to_pixels(target).to(device, dtype));
    means.push_back(post.mean.select(2, 0).to(torch::kCPU, torch::kFloat32));
    logvars.push_back(post.logvar.select(2, 0).to(torch::kCPU, torch::kFloat32));
    std::vector<torch::Tensor> controls, condition, vae_pixels;
    for (const auto& c : p.controls) {
      controls.push_back(cover_and_center_crop(io::load_image(c, 3), height, width));
      vae_pixels.push_back(to_pixels(controls.back()));
      if (enc.kind == EditKind::kEditPlus) {  // the ~384x384 condition size
        const auto [cw, ch] = qwen_calculate_dimensions(
            384.0 * 384.0, static_cast<double>(width) / static_cast<double>(height));
        condition.push_back(io::resize_image(controls.back(), ch, cw, io::Resample::kLanczos));
      } else {
        condition.push_back(controls.back());
      }
    }
    models::QwenImageGrids grids;
    refs.push_back(
        encode_reference_latents(enc.vae, vae_pixels, &grids).to(torch::kCPU, torch::kFloat32));
    std::vector<int64_t> flat;
    for (const auto& g : grids) flat.insert(flat.end(), g.begin(), g.end());
    shapes.push_back(
        torch::tensor(flat, torch::kInt64).view({1, static_cast<int64_t>(grids.size()), 3}));
    const auto [e, m] = encode_edit_prompts(*enc.encoder, enc.visual, enc.processor, {p.caption},
                                            condition, enc.kind);
    embeds.push_back(e);
    masks.push_back(m);
    longest = std::max(longest, e.size(1));
    if (progress) progress();
  }
  for (size_t i = 0; i < embeds.size(); ++i) {
    const int64_t pad = longest - embeds[i].size(1);
    embeds[i] = torch::constant_pad_nd(embeds[i], {0, 0, 0, pad}, 0);
    masks[i] = torch::constant_pad_nd(masks[i], {0, pad}, 0);
  }
  data::Example columns;
  columns["index"] = torch::arange(static_cast<int64_t>(pairs.size()), torch::kInt64);
  columns["latent_mean"] = torch::cat(means);
  columns["latent_logvar"] = torch::cat(logvars);
  columns["reference_latents"] = torch::cat(refs);
  columns["reference_shapes"] = torch::cat(shapes);
  columns["prompt_embeds"] = torch::cat(embeds);
  columns["prompt_attention_mask"] = torch::cat(masks);
  return std::make_shared<data::TensorDataset>(std::move(columns));
}

}  // namespace difftrain::families::qwen_image
