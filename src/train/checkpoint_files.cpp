// The checkpoint folders of a run: latest, unfinished, rotation; the epoch saves beside them.
#include "checkpoint_files.h"

#include "difftrain/accel/checkpoint_manifest.h"
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/train/trainer.h"

#include <nlohmann/json.hpp>

#include <cstdio>

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
  // An epoch save's folder gets its name the same way (write_epoch_save).
  static const std::regex kTemp(R"((checkpoint|epoch)-\d+\.tmp)");
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return;
  std::vector<fs::path> stale;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    if (entry.is_directory() && std::regex_match(entry.path().filename().string(), kTemp))
      stale.push_back(entry.path());
  }
  for (const auto& path : stale) {
    log::warn("removing {}: an unfinished save left by an interrupted run", path.string());
    fs::remove_all(path, ec);
  }
}

void rotate_checkpoints(const std::string& output_dir, int64_t limit) {
  static const std::regex kName(R"(checkpoint-(\d+))");
  const std::set<std::string> epochs_own = epoch_owned_checkpoints(output_dir);
  std::vector<std::pair<int64_t, fs::path>> found;
  for (const auto& entry : fs::directory_iterator(output_dir)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, m, kName) && !epochs_own.count(name)) {
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

namespace {

// The epoch saves under `output_dir`: epoch number -> folder (complete ones: with epoch.json).
std::vector<std::pair<int64_t, fs::path>> epoch_saves(const std::string& output_dir) {
  static const std::regex kName(R"(epoch-(\d+))");
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  if (!fs::is_directory(output_dir, ec)) return found;
  for (const auto& entry : fs::directory_iterator(output_dir, ec)) {
    std::smatch m;
    const std::string name = entry.path().filename().string();
    if (entry.is_directory() && std::regex_match(name, m, kName) &&
        fs::exists(entry.path() / "epoch.json")) {
      found.emplace_back(std::stoll(m[1].str()), entry.path());
    }
  }
  std::sort(found.begin(), found.end());
  return found;
}

// The checkpoint an epoch save made, or "" (none, or the step cadence's).
std::string owned_checkpoint(const fs::path& epoch_dir) {
  const std::string path = (epoch_dir / "epoch.json").string();
  try {
    const auto meta = nlohmann::json::parse(io::read_file(path));
    if (meta.value("owns_checkpoint", false)) return meta.value("checkpoint", std::string());
  } catch (const std::exception& e) {
    log::warn("{}: unreadable ({}); its checkpoint is left to --checkpoints_total_limit", path,
              e.what());
  }
  return "";
}

}  // namespace

std::string epoch_save_name(int64_t epoch) {
  char name[32];
  std::snprintf(name, sizeof name, "epoch-%06lld", static_cast<long long>(epoch));
  return name;
}

void write_epoch_save(const std::string& output_dir, int64_t epoch, int64_t global_step,
                      bool owns_checkpoint, const std::function<void(const fs::path&)>& write) {
  const fs::path final_dir = fs::path(output_dir) / epoch_save_name(epoch);
  const fs::path temp = fs::path(final_dir.string() + ".tmp");
  std::error_code ec;
  fs::remove_all(temp, ec);
  fs::create_directories(temp);
  write(temp);
  const nlohmann::json meta = {{"epoch", epoch},
                               {"global_step", global_step},
                               {"checkpoint", "checkpoint-" + std::to_string(global_step)},
                               {"owns_checkpoint", owns_checkpoint}};
  // Written last: its presence marks a complete epoch save.
  io::write_file_atomic((temp / "epoch.json").string(), meta.dump(2) + "\n");
  fs::remove_all(final_dir, ec);
  fs::rename(temp, final_dir, ec);
  if (ec) {
    throw Error("cannot rename '" + temp.string() + "' to '" + final_dir.string() +
                "': " + ec.message() + "; check that --output_dir is writable");
  }
}

void prune_epoch_saves(const std::string& output_dir, int64_t epoch, int64_t every, int64_t keep) {
  const int64_t newest_removed = epoch - every * keep;
  for (const auto& [number, dir] : epoch_saves(output_dir)) {
    if (number > newest_removed) continue;
    const std::string checkpoint = owned_checkpoint(dir);
    std::error_code ec;
    log::info("save_last_n_epochs {}: removing {}{}", keep, dir.string(),
              checkpoint.empty() ? "" : " and " + checkpoint);
    if (!checkpoint.empty()) fs::remove_all(fs::path(output_dir) / checkpoint, ec);
    fs::remove_all(dir, ec);
  }
}

std::set<std::string> epoch_owned_checkpoints(const std::string& output_dir) {
  std::set<std::string> names;
  for (const auto& [number, dir] : epoch_saves(output_dir)) {
    const std::string checkpoint = owned_checkpoint(dir);
    if (!checkpoint.empty()) names.insert(checkpoint);
  }
  return names;
}

}  // namespace difftrain::train
