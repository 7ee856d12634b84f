// `difftrain lora merge` file by file (families/lora_merge.h).
#include "difftrain/families/lora_merge.h"

#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/family.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/io/weight_index.h"
#include "difftrain/models/lora/lora.h"

#include <fmt/format.h>
#include <torch/torch.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <map>
#include <set>

namespace difftrain::families {
namespace fs = std::filesystem;

namespace {

// Adds the deltas of `targets` (scaled) to the weights in the component folder `dir`'s files,
// writing the changed files under `out_dir`. Returns the modules merged and the files written.
int64_t merge_into_files(const std::vector<io::LoraTarget>& targets, const fs::path& dir,
                         const fs::path& out_dir, const std::string& stem,
                         const std::string& variant, double scale, std::set<std::string>& written) {
  std::map<std::string, const io::LoraTarget*> pending;
  for (const auto& t : targets) pending[t.module + ".weight"] = &t;
  int64_t merged = 0;
  for (const auto& path : io::find_weight_files(dir.string(), stem, variant).files) {
    const std::string file = fs::path(path).filename().string();
    io::Safetensors f = io::load_safetensors(path);
    bool changed = false;
    torch::NoGradGuard no_grad;
    for (auto& [name, w] : f.tensors) {
      const auto it = pending.find(name);
      if (it == pending.end()) continue;
      torch::Tensor delta = models::lora_delta(*it->second, scale);
      if (delta.numel() != w.numel()) {
        throw Error(
            fmt::format("LoRA module {} ({}): its update is {} but {} in {} is {}; is "
                        "this LoRA for a different model?",
                        it->second->module, it->second->key, c10::str(delta.sizes()), name, path,
                        c10::str(w.sizes())));
      }
      const auto wide = w.scalar_type() == torch::kFloat64 ? torch::kFloat64 : torch::kFloat32;
      w = (w.to(wide) + delta.reshape(w.sizes()).to(wide)).to(w.scalar_type()).contiguous();
      pending.erase(it);
      changed = true;
      ++merged;
    }
    if (changed) {
      io::save_safetensors((out_dir / file).string(), f.tensors, f.metadata);
      written.insert(file);
    }
  }
  if (!pending.empty()) {
    const auto& t = *pending.begin()->second;
    throw Error(
        fmt::format("LoRA module {} ({}): {} has no weight {}; is this LoRA for a "
                    "different model?",
                    t.module, t.key, dir.string(), pending.begin()->first));
  }
  return merged;
}

}  // namespace

models::LoraFolderMergeSummary merge_lora_by_files(const std::string& model_dir,
                                                   const std::string& lora_path,
                                                   const std::string& output_dir,
                                                   const models::LoraFolderMergeOptions& options,
                                                   const FileMergePlan& plan) {
  if (!std::isfinite(options.lora_scale)) {
    throw Error("lora_scale is " + std::to_string(options.lora_scale) +
                ": it must be a finite number (1 applies the LoRA as trained)");
  }
  if (output_dir.empty()) throw Error("the output folder is empty; give --output DIR");
  fs::path from = fs::absolute(model_dir).lexically_normal();
  if (from.filename().empty()) from = from.parent_path();
  fs::path out = fs::absolute(output_dir).lexically_normal();
  if (out.filename().empty()) out = out.parent_path();
  std::error_code ec;
  if (fs::exists(out, ec) && !(fs::is_directory(out, ec) && fs::is_empty(out, ec))) {
    throw Error(output_dir + " exists and is not an empty folder; give a new output folder");
  }
  const auto [mismatch, rest] = std::mismatch(from.begin(), from.end(), out.begin(), out.end());
  (void)rest;
  if (mismatch == from.end()) {
    throw Error(output_dir + " lies inside the model folder " + model_dir +
                "; write the merged model elsewhere");
  }
  if (!fs::is_regular_file(lora_path, ec) && !fs::is_directory(lora_path, ec)) {
    throw Error(lora_path + ": no such LoRA file; give a .safetensors file in " + plan.layouts +
                " format");
  }
  const bool pipeline = fs::is_regular_file(from / "model_index.json", ec);
  const io::LoraWeights lora = plan.read(lora_path, model_dir, options.read);
  check_lora_fits_family(lora, lora_path, model_dir);
  const std::string& denoiser = plan.components.front().first;
  std::map<std::string, std::string> stems;  // the components merged here -> their file stem
  for (const auto& [component, stem] : plan.components) {
    if (pipeline || component == denoiser) stems[component] = stem;
  }
  bool any = false;
  std::string names;
  for (const auto& [component, stem] : stems) {
    (void)stem;
    any = any || lora.count(component) > 0;
    names += (names.empty() ? "" : " or the ") + component;
  }
  if (!any) {
    throw Error("LoRA file '" + lora_path + "' has no targets for the " + names +
                "; nothing to merge");
  }

  models::LoraFolderMergeSummary summary;
  summary.format = lora.format;
  summary.unet_dir = (pipeline ? from / denoiser : from).string();
  io::write_folder_atomic(out, "merged model", output_dir, [&](const fs::path& staging) {
    std::map<std::string, std::set<std::string>> written;  // component folder -> files written
    for (const auto& [component, targets] : lora.components) {
      if (targets.empty()) continue;
      const auto stem = stems.find(component);
      if (stem == stems.end()) {
        summary.skipped_components[component] = static_cast<int64_t>(targets.size());
        continue;
      }
      const std::string rel = pipeline ? component : "";
      fs::create_directories(staging / rel);
      const int64_t n = merge_into_files(targets, from / rel, staging / rel, stem->second,
                                         options.variant, options.lora_scale, written[rel]);
      (component == denoiser ? summary.modules_merged : summary.text_encoder_modules_merged) += n;
      // Every file written, in order, the denoiser's shards before the text encoders'.
      std::vector<std::string> paths;
      for (const auto& file : written[rel]) paths.push_back((out / rel / file).string());
      auto& listed = summary.weights_written;
      listed.insert(component == denoiser ? listed.begin() : listed.end(), paths.begin(),
                    paths.end());
    }
    // Everything else as it is (symlinks followed, Hugging Face cache style).
    for (auto it = fs::recursive_directory_iterator(
             from, fs::directory_options::follow_directory_symlink);
         it != fs::recursive_directory_iterator(); ++it) {
      const fs::path rel = it->path().lexically_relative(from);
      if (it->is_directory()) {
        fs::create_directories(staging / rel);
        continue;
      }
      if (!it->is_regular_file()) continue;
      const auto w = written.find(rel.parent_path().string());
      if (w != written.end() && w->second.count(rel.filename().string()) > 0) continue;
      fs::copy_file(it->path(), staging / rel);
      ++summary.files_copied;
    }
  });
  log::info(
      "LoRA {} ({} format): merged into {} {} and {} text encoder modules with lora_scale {}; "
      "wrote {}",
      lora_path, io::format_label(lora), summary.modules_merged, denoiser,
      summary.text_encoder_modules_merged, options.lora_scale, output_dir);
  for (const auto& [component, n] : summary.skipped_components) {
    log::warn("LoRA {}: {} targets for the {} were not merged", lora_path, n, component);
  }
  return summary;
}

}  // namespace difftrain::families
