// The registry of model families: the one list of built-in families, folder recognition, and the
// training entry point that asks it.
#include "builtin.h"
#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <fmt/format.h>

#include <filesystem>

namespace difftrain::families {
namespace fs = std::filesystem;

const std::vector<const ModelFamily*>& families() {
  // Each built-in family, registered once. A folder is matched against them in this order.
  static const std::vector<const ModelFamily*> all = {&unet_family(), &stable_diffusion_family(),
                                                      &sdxl_family(), &flux_family()};
  return all;
}

const ModelFamily& default_family() { return unet_family(); }

FolderInfo inspect_folder(const std::string& dir) {
  FolderInfo info;
  info.dir = dir;
  std::error_code ec;
  info.exists = fs::is_directory(dir, ec);
  if (!info.exists) return info;
  const auto read_object = [](const fs::path& path, nlohmann::json& out) {
    std::error_code missing;
    if (!fs::is_regular_file(path, missing)) return false;
    try {
      out = nlohmann::json::parse(io::read_file(path.string()));
    } catch (const std::exception&) {
      return false;  // the family that reads it reports the problem
    }
    return out.is_object();
  };
  const auto class_of = [](const nlohmann::json& j) {
    return j.contains("_class_name") && j["_class_name"].is_string()
               ? j["_class_name"].get<std::string>()
               : std::string();
  };
  if (read_object(fs::path(dir) / "model_index.json", info.index)) {
    info.pipeline = true;
    info.class_name = class_of(info.index);
    return info;
  }
  nlohmann::json config;
  if (read_object(fs::path(dir) / "config.json", config)) info.class_name = class_of(config);
  return info;
}

const ModelFamily& family_of(const std::string& dir) {
  const FolderInfo info = inspect_folder(dir);
  if (!info.pipeline) {
    for (const auto* f : families()) {
      for (const auto& c : f->model_classes()) {
        if (c == info.class_name) return *f;
      }
    }
    return default_family();  // it reports a missing folder or a bad config in its own words
  }
  if (info.class_name.empty()) {
    // A hand-made model_index.json: by its components, the most specific family first.
    for (auto it = families().rbegin(); it != families().rend(); ++it) {
      if ((*it)->matches_components(info.index)) return **it;
    }
    return default_family();
  }
  std::string known;
  for (const auto* f : families()) {
    for (const auto& c : f->pipeline_classes()) {
      if (c == info.class_name) return *f;
      known += fmt::format("{}{} ({})", known.empty() ? "" : ", ", c, f->name());
    }
  }
  throw Error(fmt::format(
      "{}: _class_name \"{}\" is not a model family difftrain knows; it reads {}, and bare "
      "UNet folders (config.json)",
      (fs::path(dir) / "model_index.json").string(), info.class_name, known));
}

std::unique_ptr<train::TrainingTask> make_training_task(const train::TaskOptions& options) {
  const auto& pretrained = options.model.pretrained_model_name_or_path;
  const ModelFamily& family = pretrained.empty() ? default_family() : family_of(pretrained);
  return family.make_training_task(options);
}

train::TrainConfig parse_train_config(const std::vector<std::string>& args) {
  train::TrainConfig config = train::parse_train_config(args);
  if (config.pretrained_model_name_or_path.empty()) return config;
  if (auto defaults = family_of(config.pretrained_model_name_or_path).training_defaults(config)) {
    train::apply_script_defaults(config, *defaults);
  }
  return config;
}

train::TrainResult run_training(train::TrainConfig config) {
  auto trainer_options = train::trainer_options(config);
  auto task = make_training_task(train::task_options(config));
  train::Trainer trainer(std::move(trainer_options), std::move(task));
  return trainer.run();
}

}  // namespace difftrain::families
