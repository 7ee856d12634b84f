// `difftrain lora convert` (families/family.h: convert_lora), the check that a LoRA fits a
// family, and the text-encoder name resolution families' adapt_lora share.
#include "difftrain/core/error.h"
#include "difftrain/families/family.h"
#include "difftrain/io/safetensors.h"
#include "difftrain/models/pretrained.h"

#include <fmt/format.h>

#include <algorithm>
#include <filesystem>

namespace difftrain::families {
namespace fs = std::filesystem;
std::vector<std::string> safetensors_module_names(const std::string& path) {
  std::vector<std::string> names;
  for (const auto& [key, entry] : io::read_safetensors_header(path).tensors) {
    (void)entry;
    if (key.size() > 7 && key.compare(key.size() - 7, 7, ".weight") == 0) {
      names.push_back(key.substr(0, key.size() - 7));
    }
  }
  return names;
}

void adapt_text_encoder_lora(io::LoraWeights& lora, const std::string& dir,
                             const std::string& component) {
  const fs::path folder = fs::path(dir) / component;
  if (lora.count(component) == 0 || !fs::is_directory(folder)) return;
  io::resolve_kohya_names(lora, component,
                          safetensors_module_names((folder / "model.safetensors").string()));
}

void check_lora_fits_family(const io::LoraWeights& lora, const std::string& lora_path,
                            const std::string& model) {
  const ModelFamily& family = family_of(model);
  const auto own = family.lora_components();
  if (own.empty() || lora.count(own.front()) > 0) return;
  std::string foreign, counts;
  for (const auto& [component, targets] : lora.components) {
    if (targets.empty()) continue;
    counts += fmt::format("{}{} {}", counts.empty() ? "" : ", ", targets.size(), component);
    if (std::find(own.begin(), own.end(), component) == own.end()) foreign = component;
  }
  if (foreign.empty()) return;
  // The families whose denoiser it adapts, those that have every component it names first.
  std::vector<std::pair<size_t, std::string>> likely;
  for (const auto* f : families()) {
    const auto parts = f->lora_components();
    if (parts.empty() || lora.count(parts.front()) == 0) continue;
    size_t missing = 0;
    for (const auto& [component, targets] : lora.components) {
      if (!targets.empty() && std::find(parts.begin(), parts.end(), component) == parts.end()) {
        ++missing;
      }
    }
    likely.emplace_back(missing, f->name());
  }
  std::stable_sort(likely.begin(), likely.end(),
                   [](const auto& a, const auto& b) { return a.first < b.first; });
  std::string names;
  for (size_t i = 0; i < likely.size(); ++i) {
    if (likely[i].first != likely.front().first) break;
    names += (i == 0 ? "" : " or ") + likely[i].second;
  }
  throw Error(fmt::format(
      "LoRA {} has no {} targets ({}): it is {} LoRA, not one for {} ({} family); give a LoRA "
      "trained on this model's family",
      lora_path, own.front(), counts, names.empty() ? "another model's" : "a " + names, model,
      family.name()));
}

LoraConversion convert_lora(const std::string& input, const std::string& output,
                            io::LoraFormat format, const std::string& model) {
  {
    std::error_code ec;
    const auto a = fs::weakly_canonical(fs::absolute(input), ec);
    const auto b = fs::weakly_canonical(fs::absolute(output), ec);
    if (a == b) {
      throw Error("--output " + output + " is the --input file; write the converted LoRA to a " +
                  "new file (the input is not overwritten)");
    }
  }
  io::LoraWeights lora = io::read_lora(input);
  LoraConversion out;
  out.read_format = lora.format;
  out.read_label = io::format_label(lora);
  // Counted as read, by the component they adapt (a FLUX.1 file's "transformer" targets, which a
  // kohya file then writes fused under lora_unet_).
  for (const auto& [component, targets] : lora.components) out.targets[component] = targets.size();
  if (!model.empty()) family_of(model).adapt_lora(lora, model, format);
  io::write_lora(output, lora, format);
  if (format == io::LoraFormat::kComfyUI) {
    // ComfyUI keys are a family's own layout: the file must read back as what was written.
    size_t written = 0, read = 0;
    for (const auto& [component, targets] : lora.components) written += targets.size();
    try {
      for (const auto& [component, targets] : io::read_lora(output).components) {
        read += targets.size();
      }
    } catch (const Error&) {
      read = 0;
    }
    // ... and as the model's own family's layout: another family's may read diffusion_model.
    // keys of the same module names (Qwen-Image's are Diffusers' names, as a FLUX.1 LoRA's are).
    if (read == written && !model.empty()) {
      const auto layouts = family_of(model).lora_key_layouts();
      const auto tensors = io::load_safetensors(output).tensors;
      if (!std::any_of(layouts.begin(), layouts.end(),
                       [&](const io::LoraKeyLayout& l) { return l.matches(tensors); })) {
        read = 0;
      }
    }
    if (read != written) {
      std::error_code ec;
      fs::remove(output, ec);
      throw Error(
          "--to comfyui: no registered family reads these modules back from diffusion_model. "
          "keys as this family's (ComfyUI names them per model family; Z-Image's and Qwen-Image's "
          "are "
          "Diffusers' own): write "
          "--to kohya instead" +
          std::string(model.empty() ? ", or give --model so the family names the modules" : ""));
    }
  }
  return out;
}

}  // namespace difftrain::families
