// Trackers: image validation, the JSON-lines log with its resume truncation, the multiplexer and
// make_trackers(). The TensorBoard writer is in tensorboard.cpp.

#include "difftrain/accel/trackers.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/image.h"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <exception>
#include <filesystem>

namespace difftrain::accel {

namespace {

namespace fs = std::filesystem;

std::string describe(const torch::Tensor& t) {
  if (!t.defined()) return "undefined";
  std::string dims;
  for (int64_t i = 0; i < t.dim(); ++i) dims += (i ? ", " : "") + std::to_string(t.size(i));
  return fmt::format("{} [{}]", c10::toString(t.scalar_type()), dims);
}

constexpr const char* kValidReportTo =
    "valid values: tensorboard, jsonl, all, none, or a comma list such as \"tensorboard,jsonl\"";

std::string trim_lower(const std::string& text) {
  std::string out;
  for (unsigned char c : text) {
    if (!std::isspace(c)) out.push_back(static_cast<char>(std::tolower(c)));
  }
  return out;
}

// Calls `f` on every tracker even when one throws, then rethrows the first error.
template <typename F>
void call_each(const std::vector<std::unique_ptr<Tracker>>& trackers, F&& f) {
  std::exception_ptr first;
  for (const auto& tracker : trackers) {
    try {
      f(*tracker);
    } catch (...) {
      if (!first) first = std::current_exception();
    }
  }
  if (first) std::rethrow_exception(first);
}

// Keeps the lines of an existing log whose "step" is <= resume_step; see JsonlTracker's docs.
void truncate_jsonl(const std::string& path, int64_t resume_step) {
  const std::string text = io::read_file(path);
  std::string kept;
  int64_t n_kept = 0, n_later = 0, n_bad = 0;
  size_t begin = 0;
  while (begin < text.size()) {
    size_t end = text.find('\n', begin);
    if (end == std::string::npos) end = text.size();
    const std::string line = text.substr(begin, end - begin);
    begin = end + 1;
    if (std::all_of(line.begin(), line.end(), [](unsigned char c) { return std::isspace(c); })) {
      continue;
    }
    const auto j = nlohmann::json::parse(line, nullptr, /*allow_exceptions=*/false);
    if (j.is_discarded() || !j.is_object() || !j.contains("step") ||
        !j["step"].is_number_integer()) {
      ++n_bad;
      continue;
    }
    if (j["step"].get<int64_t>() <= resume_step) {
      kept += line;
      kept += '\n';
      ++n_kept;
    } else {
      ++n_later;
    }
  }
  io::write_file_atomic(path, kept);
  if (n_later > 0 || n_bad > 0) {
    log::info("{}: resuming at step {}: kept {} lines, dropped {} later lines and {} unreadable",
              path, resume_step, n_kept, n_later, n_bad);
  }
}

}  // namespace

torch::Tensor to_tracker_image(const std::string& tag, const torch::Tensor& image) {
  const bool ok =
      image.defined() && image.dim() == 3 && image.size(0) >= 1 && image.size(1) >= 1 &&
      image.size(2) >= 1 && image.size(2) <= 4 &&
      (image.scalar_type() == torch::kUInt8 || torch::isFloatingType(image.scalar_type()));
  if (!ok) {
    throw Error(
        fmt::format("log_image(\"{}\"): image is {}; expected uint8 [H, W, C] or float "
                    "[H, W, C] in [0, 1] with C 1 (grey), 2, 3 (RGB) or 4 (RGBA) "
                    "(permute(1, 2, 0) a [C, H, W] tensor)",
                    tag, describe(image)));
  }
  if (image.scalar_type() == torch::kUInt8) return image.to(torch::kCPU).contiguous();
  // [H, W, C] -> [1, C, H, W] for Diffusers' conversion, which returns [1, H, W, C].
  return io::to_uint8_images(image.permute({2, 0, 1}).unsqueeze(0))[0].contiguous();
}

// ------------------------------------------------------------------ JsonlTracker

JsonlTracker::JsonlTracker(const std::string& path, std::optional<int64_t> resume_step)
    : path_(path) {
  if (path.empty()) {
    throw Error("JsonlTracker: the log path is empty; pass a file such as <output_dir>/logs.jsonl");
  }
  const fs::path parent = fs::path(path).parent_path();
  std::error_code ec;
  if (!parent.empty()) fs::create_directories(parent, ec);
  if (ec) {
    throw Error(
        fmt::format("{}: cannot create the folder of the JSONL log ({}); choose a "
                    "writable path",
                    path, ec.message()));
  }
  const char* mode = "w";  // a new run replaces the old log
  if (resume_step && fs::exists(path)) {
    truncate_jsonl(path, *resume_step);
    mode = "a";
  }
  file_ = std::fopen(path.c_str(), mode);
  if (file_ == nullptr) {
    throw Error(
        fmt::format("{}: cannot open the JSONL log for writing ({}); choose a writable "
                    "path",
                    path, std::strerror(errno)));
  }
}

JsonlTracker::~JsonlTracker() {
  if (file_ != nullptr && std::fclose(file_) != 0) {
    log::warn("{}: closing the JSONL log failed ({}); its last lines may be lost", path_,
              std::strerror(errno));
  }
}

void JsonlTracker::log_scalars(const std::map<std::string, double>& values, int64_t step) {
  if (values.empty()) return;
  std::string line = fmt::format("{{\"step\": {}", step);
  for (const auto& [key, value] : values) {
    if (key.empty()) {
      throw Error(
          fmt::format("{}: empty scalar name; give every value a name such as \"loss\"", path_));
    }
    if (key == "step") {
      throw Error(
          fmt::format("{}: scalar name \"step\" is reserved for the step number; rename "
                      "it (e.g. \"train_step\")",
                      path_));
    }
    // Invalid UTF-8 in a name is replaced (U+FFFD) rather than failing the run.
    line +=
        ", " + nlohmann::json(key).dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
    line += ": " + (std::isfinite(value) ? nlohmann::json(value).dump() : std::string("null"));
  }
  line += "}\n";
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::fwrite(line.data(), 1, line.size(), file_) != line.size() || std::fflush(file_) != 0) {
    throw Error(
        fmt::format("{}: writing the JSONL log failed ({}); check free space and "
                    "permissions",
                    path_, std::strerror(errno)));
  }
}

void JsonlTracker::log_image(const std::string& tag, const torch::Tensor& image, int64_t) {
  to_tracker_image(tag, image);  // same errors as the other trackers; nothing is written
}

void JsonlTracker::flush() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (std::fflush(file_) != 0) {
    throw Error(fmt::format("{}: flushing the JSONL log failed ({}); check free space", path_,
                            std::strerror(errno)));
  }
}

// ------------------------------------------------------------------ Trackers

void Trackers::add(std::unique_ptr<Tracker> tracker) {
  if (!tracker) throw Error("Trackers::add: the tracker is null; pass a constructed tracker");
  trackers_.push_back(std::move(tracker));
}

Tracker* Trackers::get(const std::string& name) const {
  for (const auto& tracker : trackers_) {
    if (tracker->name() == name) return tracker.get();
  }
  return nullptr;
}

void Trackers::log_scalars(const std::map<std::string, double>& values, int64_t step) {
  call_each(trackers_, [&](Tracker& t) { t.log_scalars(values, step); });
}

void Trackers::log_image(const std::string& tag, const torch::Tensor& image, int64_t step) {
  call_each(trackers_, [&](Tracker& t) { t.log_image(tag, image, step); });
}

void Trackers::flush() {
  call_each(trackers_, [](Tracker& t) { t.flush(); });
}

std::string Trackers::name() const {
  if (trackers_.empty()) return "none";
  std::string names;
  for (const auto& tracker : trackers_) names += (names.empty() ? "" : ",") + tracker->name();
  return names;
}

std::unique_ptr<Trackers> make_trackers(const std::string& report_to,
                                        const std::string& logging_dir,
                                        const std::string& jsonl_path,
                                        std::optional<int64_t> resume_step) {
  const std::string spec = trim_lower(report_to);
  bool tensorboard = false, jsonl = false, none = false;
  int items = 0;
  size_t begin = 0;
  while (begin <= spec.size()) {
    size_t end = spec.find(',', begin);
    if (end == std::string::npos) end = spec.size();
    const std::string item = spec.substr(begin, end - begin);
    begin = end + 1;
    ++items;
    if (item == "tensorboard") {
      tensorboard = true;
    } else if (item == "jsonl") {
      jsonl = true;
    } else if (item == "all") {
      tensorboard = jsonl = true;
    } else if (item == "none") {
      none = true;
    } else {
      throw Error(fmt::format("report_to \"{}\": unknown tracker \"{}\"; {}", report_to, item,
                              kValidReportTo));
    }
  }
  if (none && items > 1) {
    throw Error(fmt::format("report_to \"{}\": \"none\" cannot be combined with trackers; {}",
                            report_to, kValidReportTo));
  }
  auto trackers = std::make_unique<Trackers>();
  if (tensorboard) {
    if (logging_dir.empty()) {
      throw Error(
          fmt::format("report_to \"{}\" needs a logging folder for TensorBoard; pass "
                      "--logging_dir",
                      report_to));
    }
    std::optional<int64_t> purge_step;
    if (resume_step) purge_step = *resume_step + 1;
    trackers->add(std::make_unique<TensorBoardTracker>(logging_dir, "", "", purge_step));
  }
  if (jsonl) trackers->add(std::make_unique<JsonlTracker>(jsonl_path, resume_step));
  return trackers;
}

}  // namespace difftrain::accel
