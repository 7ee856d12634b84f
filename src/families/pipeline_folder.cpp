// Pipeline folders' components (pipeline_folder.h).
#include "pipeline_folder.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <nlohmann/json.hpp>

#include <filesystem>

namespace difftrain::families {
namespace fs = std::filesystem;

PipelineComponents resolve_pipeline_components(const std::string& dir, const std::string& kind,
                                               const std::vector<std::string>& components,
                                               const std::string& listing) {
  PipelineComponents out;
  out.dir = dir;
  const fs::path index_path = fs::path(dir) / "model_index.json";
  std::error_code ec;
  if (!fs::is_regular_file(index_path, ec)) {
    throw Error(index_path.string() + ": no such file; expected a " + kind + " folder");
  }
  nlohmann::json index;
  try {
    index = nlohmann::json::parse(io::read_file(index_path.string()));
  } catch (const nlohmann::json::exception& e) {
    throw Error(index_path.string() + ": not valid JSON (" + e.what() + ")");
  }
  if (!index.is_object()) throw Error(index_path.string() + ": expected a JSON object");
  out.pipeline_class = index.value("_class_name", std::string());
  const auto component_dir = [&](const std::string& name) {
    const fs::path path = fs::path(dir) / name;
    if (!index.contains(name) || index[name].is_null() ||
        (index[name].is_array() && (index[name].empty() || index[name][0].is_null()))) {
      throw Error(dir + "/model_index.json: no " + name + " entry; a " + kind + " folder has " +
                  listing);
    }
    if (!fs::is_directory(path, ec)) {
      throw Error(path.string() + ": no such folder; model_index.json lists " + name +
                  ", so the pipeline folder is incomplete (copy the whole folder)");
    }
    return path.string();
  };
  for (const auto& name : components) out.paths[name] = component_dir(name);
  out.scheduler_config = (fs::path(component_dir("scheduler")) / "scheduler_config.json").string();
  if (!fs::is_regular_file(out.scheduler_config, ec)) {
    throw Error(out.scheduler_config + ": no such file; the scheduler folder needs it");
  }
  return out;
}

TransformerFolder resolve_transformer_folder(const std::string& dir, const std::string& kind) {
  const PipelineComponents c =
      resolve_pipeline_components(dir, kind, {"transformer", "vae", "text_encoder", "tokenizer"},
                                  "transformer, vae, text_encoder, tokenizer and scheduler");
  TransformerFolder f;
  f.dir = dir;
  f.pipeline_class = c.pipeline_class;
  f.transformer_dir = c.paths.at("transformer");
  f.vae_dir = c.paths.at("vae");
  f.text_encoder_dir = c.paths.at("text_encoder");
  f.tokenizer_dir = c.paths.at("tokenizer");
  f.scheduler_config = c.scheduler_config;
  return f;
}

std::string component_or_self(const std::string& dir, const std::string& component) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / "model_index.json", ec)
             ? (fs::path(dir) / component).string()
             : dir;
}

}  // namespace difftrain::families
