// Sharded model weights by their index (weight_index.h).
#include "difftrain/io/weight_index.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <map>
#include <set>

namespace difftrain::io {
namespace fs = std::filesystem;

namespace {

// weight_map of an index file: tensor name -> file name.
std::map<std::string, std::string> read_weight_map(const std::string& index) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(read_file(index));
  } catch (const nlohmann::json::exception& e) {
    throw Error(index + ": not valid JSON (" + e.what() +
                "); expected a sharded-weights index with a \"weight_map\"");
  }
  if (!j.is_object() || !j.contains("weight_map") || !j["weight_map"].is_object()) {
    throw Error(index +
                ": no \"weight_map\" object; expected a sharded-weights index as "
                "save_pretrained writes it");
  }
  std::map<std::string, std::string> out;
  for (const auto& [name, file] : j["weight_map"].items()) {
    if (!file.is_string() || file.get<std::string>().empty() ||
        file.get<std::string>().find('/') != std::string::npos) {
      throw Error(index + ": weight_map[\"" + name +
                  "\"] is not a file name in the folder; the index is damaged");
    }
    out[name] = file.get<std::string>();
  }
  if (out.empty()) throw Error(index + ": the weight_map is empty; the index is damaged");
  return out;
}

}  // namespace

WeightFiles find_weight_files(const std::string& dir, const std::string& stem,
                              const std::string& variant) {
  const fs::path d(dir);
  std::error_code ec;
  const std::string base = variant.empty() ? stem : stem + "." + variant;
  WeightFiles out;
  if (fs::is_regular_file(d / (base + ".safetensors"), ec)) {
    out.files.push_back((d / (base + ".safetensors")).string());
    return out;
  }
  std::vector<fs::path> indexes = {d / (stem + ".safetensors.index.json")};
  if (!variant.empty()) {
    indexes = {d / (stem + ".safetensors.index." + variant + ".json"),
               d / (base + ".safetensors.index.json")};
  }
  for (const auto& index : indexes) {
    if (!fs::is_regular_file(index, ec)) continue;
    out.index = index.string();
    std::set<std::string> files;
    for (const auto& [name, file] : read_weight_map(out.index)) files.insert(file);
    for (const auto& file : files) {
      if (!fs::is_regular_file(d / file, ec)) {
        throw Error(index.string() + " names " + file + ", which is not in " + dir +
                    "; copy every shard of the model");
      }
      out.files.push_back((d / file).string());
    }
    return out;
  }
  if (fs::exists(d / (stem + ".bin"), ec) || fs::exists(d / "pytorch_model.bin", ec)) {
    throw Error(dir +
                ": only pickle weights (.bin) found; difftrain reads safetensors only — "
                "re-save the model with save_pretrained(dir, safe_serialization=True)");
  }
  throw Error(dir + ": neither " + base + ".safetensors nor its sharded index " +
              indexes.front().filename().string() + "; expected the weights save_pretrained " +
              "writes");
}

TensorMap load_weight_files(const WeightFiles& files, std::optional<torch::Dtype> dtype) {
  std::map<std::string, std::string> weight_map;
  if (!files.index.empty()) weight_map = read_weight_map(files.index);
  TensorMap out;
  for (const auto& file : files.files) {
    Safetensors st = load_safetensors(file);
    const std::string name_of_file = fs::path(file).filename().string();
    for (auto& [name, t] : st.tensors) {
      if (!files.index.empty()) {
        const auto it = weight_map.find(name);
        if (it == weight_map.end()) {
          throw Error(file + ": tensor " + name + " is not in " + files.index +
                      "'s weight_map; the index and the shards do not match");
        }
        if (it->second != name_of_file) {
          throw Error(file + ": tensor " + name + " belongs to " + it->second + " by " +
                      files.index + "; the index and the shards do not match");
        }
        weight_map.erase(it);
      }
      if (out.count(name) != 0) throw Error(file + ": tensor " + name + " is in two shard files");
      // A converted tensor owns its memory; the mapping goes away with `st`.
      out[name] = dtype && t.is_floating_point() && t.scalar_type() != *dtype
                      ? t.to(*dtype)
                      : (files.files.size() > 1 ? t.clone() : t);
    }
  }
  if (!weight_map.empty()) {
    throw Error(files.index + " names tensor " + weight_map.begin()->first + " in " +
                weight_map.begin()->second + ", which does not hold it; the shard is damaged");
  }
  return out;
}

}  // namespace difftrain::io
