// `difftrain sample`'s entry point (families::sample: the folder's family, with progress lines)
// and its --device, shared by the families' sample code.
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/family.h"
#include "difftrain/io/image.h"
#include "difftrain/io/prompt_file.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/io/video.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/cuda.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>

namespace difftrain::families {

std::vector<std::string> sample_prompts(const SampleOptions& a, const std::string& folder_kind) {
  if (!a.prompts.empty() && !a.prompt_file.empty()) {
    throw Error("give --prompt or --prompt_file, not both");
  }
  if (!a.prompt_file.empty()) {
    auto prompts = io::read_prompt_file(a.prompt_file);
    if (prompts.empty()) throw Error("--prompt_file " + a.prompt_file + " has no prompts");
    return prompts;
  }
  if (a.prompts.empty()) {
    throw Error("a " + folder_kind + " folder needs --prompt \"...\" (or --prompt_file F)");
  }
  return a.prompts;
}

torch::Device parse_sample_device(const std::string& text) {
  if (text == "auto") {
    return torch::cuda::is_available() ? torch::Device(torch::kCUDA, 0)
                                       : torch::Device(torch::kCPU);
  }
  std::optional<torch::Device> device;
  try {
    device = torch::Device(text);
  } catch (const std::exception&) {
  }
  if (!device || (!device->is_cpu() && !device->is_cuda())) {
    throw Error("--device '" + text + "' is not a device: use auto, cpu, cuda or cuda:N");
  }
  if (device->is_cuda()) {
    const auto count = torch::cuda::is_available() ? torch::cuda::device_count() : 0;
    if (count == 0) {
      throw Error("--device " + text +
                  ": no CUDA device is visible to this LibTorch (check `difftrain env`); use "
                  "--device cpu");
    }
    if (device->has_index() && device->index() >= static_cast<int64_t>(count)) {
      throw Error(fmt::format("--device {}: only {} CUDA device(s) are visible", text, count));
    }
  }
  return *device;
}

std::vector<std::pair<train::OptionSpec, std::vector<std::string>>> all_sample_options() {
  std::vector<std::pair<train::OptionSpec, std::vector<std::string>>> out;
  for (const auto* f : families()) {
    for (auto& spec : f->sample_options()) {
      auto same = std::find_if(out.begin(), out.end(),
                               [&](const auto& o) { return o.first.name == spec.name; });
      if (same == out.end()) {
        out.push_back({std::move(spec), {f->name()}});
      } else {
        same->second.push_back(f->name());
      }
    }
  }
  return out;
}

train::FamilyOptions parse_family_flags(
    const std::string& family, std::vector<train::OptionSpec> specs,
    const std::map<std::string, std::vector<std::string>>& values) {
  train::FamilyOptions out;
  out.family = family;
  out.specs = std::move(specs);
  for (const auto& [name, texts] : values) {
    const auto* spec = out.find(name);
    if (spec == nullptr)
      throw Error("--" + name + " is not an option of the " + family + " family");
    out.values[name] = train::parse_option_values(*spec, texts, "--" + name);
  }
  out.complete_and_check();
  return out;
}

train::FamilyOptions sample_family_options(
    const ModelFamily& family, const std::map<std::string, std::vector<std::string>>& flags,
    const std::string& model) {
  const auto specs = family.sample_options();
  for (const auto& flag : flags) {
    const std::string& name = flag.first;  // a lambda may not capture a structured binding
    const bool declared = std::any_of(specs.begin(), specs.end(),
                                      [&](const train::OptionSpec& s) { return s.name == name; });
    if (!declared) {
      std::vector<std::string> owners;
      for (const auto& [s, names] : all_sample_options()) {
        if (s.name == name) owners = names;
      }
      const std::string whose =
          owners.empty() ? std::string("is no family's sample option")
                         : fmt::format("is an option of the {} famil{}", fmt::join(owners, ", "),
                                       owners.size() > 1 ? "ies" : "y");
      throw Error(fmt::format(
          "--{} {}; {} is a {} folder, which does not take it (difftrain sample --help lists "
          "each family's options)",
          name, whose, model, family.name()));
    }
  }
  return parse_family_flags(family.name(), specs, flags);
}

diffusion::GenerateResult sample(SampleOptions options, double* seconds) {
  using Clock = std::chrono::steady_clock;
  // Timed from the first denoising step (after loading), a line every two seconds and at the end.
  auto start = std::make_shared<Clock::time_point>(Clock::now());
  auto last = std::make_shared<Clock::time_point>(*start);
  options.on_start = [start, last] { *start = *last = Clock::now(); };
  options.on_step = [start, last](int64_t i, int64_t n) {
    const auto now = Clock::now();
    if (i != n && now - *last < std::chrono::seconds(2)) return;
    *last = now;
    const double rate = i / std::max(std::chrono::duration<double>(now - *start).count(), 1e-9);
    log::info("step {}/{}  {:.2f} it/s  ETA {:.0f}s", i, n, rate, (n - i) / rate);
  };
  const ModelFamily& family = family_of(options.model);
  options.family = sample_family_options(family, options.family_flags, options.model);
  auto result = family.sample(options);
  if (seconds != nullptr) *seconds = std::chrono::duration<double>(Clock::now() - *start).count();
  return result;
}

namespace {

bool is_video_path(const std::string& path) {
  std::string ext = std::filesystem::path(path).extension().string();
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  const auto& known = io::video_write_extensions();
  return std::find(known.begin(), known.end(), ext) != known.end();
}

}  // namespace

void sample_to_files(const SampleOptions& options, const SampleOutputs& outputs) {
  // Refused before the model loads: a video file of a family that makes images, or a video path
  // a build without FFmpeg cannot write.
  const std::string given = outputs.grid;
  if (!given.empty() && is_video_path(given) && !io::video_supported()) {
    io::write_video(given, torch::zeros({1, 2, 2, 3}, torch::kUInt8));  // throws, naming packages
  }
  double seconds = 0;
  const auto result = sample(options, &seconds);
  const int64_t F = result.num_frames();
  const bool clips = result.images.dim() == 5;
  std::string out =
      given.empty() ? (clips && io::video_supported() ? "samples.mp4" : "samples.png") : given;
  const int64_t total = result.images.size(0);
  std::vector<std::string> written;
  if (is_video_path(out)) {
    if (!clips) {
      throw Error(fmt::format("--output {}: {} makes images, not clips; write a .png grid", out,
                              options.model));
    }
    io::VideoWriteOptions w;
    w.fps = outputs.fps > 0 ? outputs.fps : (result.fps > 0 ? result.fps : 16.0);
    const std::filesystem::path p(out);
    for (int64_t k = 0; k < total; ++k) {
      const std::string file =
          total == 1 ? out
                     : (p.parent_path() /
                        (p.stem().string() + "_" + std::to_string(k) + p.extension().string()))
                           .string();
      io::write_video(file, result.images[k], w);
      written.push_back(file);
    }
  } else {
    io::save_image_grid(out, result.images, result.labels, outputs.columns);
    written.push_back(out);
  }
  if (!outputs.frames_dir.empty()) {
    const auto frames = result.frames();
    for (int64_t k = 0; k < total; ++k) {
      const auto dir = std::filesystem::path(outputs.frames_dir) / std::to_string(k);
      std::filesystem::create_directories(dir);
      for (int64_t i = 0; i < F; ++i) {
        io::save_png((dir / fmt::format("frame_{:04d}.png", i)).string(),
                     frames[k][i].mul(255).round().clamp(0, 255).to(torch::kUInt8));
      }
    }
    written.push_back(outputs.frames_dir + "/");
  }
  if (!outputs.tensors.empty()) {
    io::save_safetensors(outputs.tensors, result.tensors(), {{"format", "np"}});
    written.push_back(outputs.tensors);
  }
  log::info("wrote {} ({} {}, {:.2f} {}/s)", fmt::join(written, ", "), total,
            clips ? "clips" : "images", total / std::max(seconds, 1e-9),
            clips ? "clips" : "images");
}

std::optional<torch::Dtype> parse_sample_dtype(const std::string& text) {
  if (text == "fp32" || text == "float32") return std::nullopt;
  if (text == "bf16" || text == "bfloat16") return torch::kBFloat16;
  if (text == "fp16" || text == "float16") return torch::kFloat16;
  throw Error("--dtype " + text + ": use fp32, bf16 or fp16");
}

}  // namespace difftrain::families
