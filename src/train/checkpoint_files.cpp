// The checkpoint folders of a run: latest, unfinished, rotation.
#include "checkpoint_files.h"

#include "difftrain/accel/checkpoint_manifest.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/train/trainer.h"

#include <algorithm>
#include <filesystem>
#include <regex>
#include <utility>
#include <vector>

namespace difftrain::train {
namespace fs = std::filesystem;

std::string latest_checkpoint(const std::string& output_dir) {
  static const std::regex kName(R"(checkpoint-(\d+))");
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return "";
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    // `checkpoint-<n>.tmp` (an unfinished save) never matches: a folder only gets its final name
    // once complete (save_state renames it into place).
    if (!entry.is_directory() || !std::regex_match(name, m, kName)) continue;
    if (!fs::exists(entry.path() / "trainer_state.json")) continue;
    found.emplace_back(std::stoll(m[1].str()), entry.path());
  }
  std::sort(found.begin(), found.end(),
            [](const auto& a, const auto& b) { return a.first > b.first; });
  for (const auto& [step, path] : found) {
    try {
      accel::verify_checkpoint(path.string());
      return path.string();
    } catch (const Error& e) {
      log::warn("resume_from_checkpoint latest: skipping {}: {}", path.string(), e.what());
    }
  }
  return "";
}

void remove_unfinished_checkpoints(const std::string& output_dir) {
  static const std::regex kTemp(R"(checkpoint-\d+\.tmp)");
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    if (entry.is_directory() && std::regex_match(entry.path().filename().string(), kTemp))
      stale.push_back(entry.path());
  }
  for (const auto& path : stale) {
    log::warn("removing {}: an unfinished checkpoint left by an interrupted save", path.string());
    fs::remove_all(path, ec);
  }
}

void rotate_checkpoints(const std::string& output_dir, int64_t limit) {
  static const std::regex kName(R"(checkpoint-(\d+))");
  std::vector<std::pair<int64_t, fs::path>> found;
  for (const auto& entry : fs::directory_iterator(output_dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, m, kName)) {
      found.emplace_back(std::stoll(m[1].str()), entry.path());
    }
  }
  std::sort(found.begin(), found.end());
  const auto keep = static_cast<size_t>(limit);
  for (size_t i = 0; i + keep < found.size(); ++i) {
    log::info("checkpoints_total_limit {}: removing {}", keep, found[i].second.string());
    std::error_code ec;
    fs::remove_all(found[i].second, ec);
  }
}

}  // namespace difftrain::train
