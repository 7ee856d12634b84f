// The shared DiT LoRA layouts (dit_lora.h), as Diffusers' ZImageLoraLoaderMixin and
// QwenImageLoraLoaderMixin read them (_convert_non_diffusers_*_lora_to_diffusers).
#include "dit_lora.h"

#include "difftrain/core/error.h"
#include "difftrain/families/family.h"
#include "difftrain/io/weight_index.h"

#include <algorithm>
#include <regex>

namespace difftrain::families {

namespace {

bool dit_starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

bool dit_ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// A kohya name's top-level module in dotted form, as far as dit_module() looks:
// "noise_refiner_0_attention_to_q" -> "noise_refiner.".
std::string dotted_top(const DitLoraLayout& layout, const std::string& kohya) {
  for (const auto& top : layout.top_modules) {
    if (kohya == top || dit_starts_with(kohya, top + "_")) return top + ".";
  }
  return kohya;
}

const std::string kComfyPrefix = "diffusion_model.";

// `module` through each (regex, replacement) in order.
std::string rename_modules(const std::vector<std::pair<std::string, std::string>>& renames,
                           std::string module) {
  for (const auto& [from, to] : renames) module = std::regex_replace(module, std::regex(from), to);
  return module;
}

// The module names of the transformer's weights (every shard), read from the headers alone.
std::vector<std::string> transformer_modules(const DitLoraLayout& layout, const std::string& dir) {
  std::vector<std::string> names;
  const std::string transformer = layout.transformer_dir(dir);
  for (const auto& path : io::find_weight_files(transformer, "diffusion_pytorch_model", "").files) {
    for (auto& m : safetensors_module_names(path)) names.push_back(std::move(m));
  }
  return names;
}

// kohya's lora_unet_ targets named as the family's modules are the transformer's (musubi-tuner
// and Diffusers' converters name them so), and so are bare module paths of its modules: moved
// there and resolved against its weight names.
// Other lora_unet_ targets (a Stable Diffusion LoRA) stay, for check_lora_fits_family to name.
void resolve_dit_targets(const DitLoraLayout& layout, io::LoraWeights& lora,
                         const std::string& dir) {
  auto unet = lora.components.find("unet");
  if (unet != lora.components.end()) {
    auto& transformer = lora.components["transformer"];
    auto& rest = unet->second;
    for (auto it = rest.begin(); it != rest.end();) {
      // kohya names (not resolved yet), and bare module paths (PEFT's raw adapter keys,
      // `<module>.lora_A.default.weight`, which the oldest layout gives the UNet).
      const bool ours = it->resolved ? dit_module(layout, it->module)
                                     : dit_module(layout, dotted_top(layout, it->module));
      if (ours) {
        transformer.push_back(std::move(*it));
        it = rest.erase(it);
      } else {
        ++it;
      }
    }
    if (rest.empty()) lora.components.erase("unet");
    std::sort(transformer.begin(), transformer.end(),
              [](const io::LoraTarget& a, const io::LoraTarget& b) { return a.module < b.module; });
    if (transformer.empty()) lora.components.erase("transformer");
  }
  if (lora.count("transformer") == 0) return;
  std::vector<std::string> modules = transformer_modules(layout, dir);
  if (!layout.original_renames.empty()) {
    // kohya names may be the original checkpoint's (musubi-tuner's): resolve against both
    // namings, then name every target as Diffusers does.
    const size_t n = modules.size();
    for (size_t i = 0; i < n; ++i) {
      const std::string original = rename_modules(layout.original_renames, modules[i]);
      if (original != modules[i]) modules.push_back(original);
    }
  }
  io::resolve_kohya_names(lora, "transformer", modules);
  if (!layout.original_renames.empty()) {
    for (auto& t : lora.components["transformer"]) {
      t.module = rename_modules(layout.comfyui_renames, t.module);
    }
  }
}

}  // namespace

bool dit_module(const DitLoraLayout& layout, const std::string& module) {
  return std::any_of(
      layout.top_modules.begin(), layout.top_modules.end(),
      [&](const std::string& top) { return module == top || dit_starts_with(module, top + "."); });
}

io::LoraKeyLayout dit_comfyui_key_layout(const DitLoraLayout& layout) {
  io::LoraKeyLayout out;
  out.name = layout.name + " ComfyUI / musubi-tuner";
  out.matches = [layout](const std::map<std::string, torch::Tensor>& tensors) {
    return std::any_of(tensors.begin(), tensors.end(), [&](const auto& kv) {
      return dit_starts_with(kv.first, kComfyPrefix) &&
             dit_module(layout, kv.first.substr(kComfyPrefix.size()));
    });
  };
  out.normalize = [layout](const std::map<std::string, torch::Tensor>& tensors) {
    static const std::vector<std::pair<std::string, std::string>> kSuffixes = {
        {".lora_down.weight", ".lora_A.weight"},
        {".lora_up.weight", ".lora_B.weight"},
        {".lora_A.weight", ".lora_A.weight"},
        {".lora_B.weight", ".lora_B.weight"},
        {".alpha", ".alpha"}};
    std::vector<std::pair<std::regex, std::string>> renames;
    for (const auto& [from, to] : layout.comfyui_renames)
      renames.emplace_back(std::regex(from), to);
    std::map<std::string, torch::Tensor> result;
    for (const auto& [key, t] : tensors) {
      if (!dit_starts_with(key, kComfyPrefix)) {
        result[key] = t;
        continue;
      }
      const std::string rest = key.substr(kComfyPrefix.size());
      bool done = false;
      for (const auto& [from, to] : kSuffixes) {
        if (rest.size() <= from.size() || !dit_ends_with(rest, from)) continue;
        std::string module = rest.substr(0, rest.size() - from.size());
        for (const auto& [re, replacement] : renames) {
          module = std::regex_replace(module, re, replacement);
        }
        result["transformer." + module + to] = t;
        done = true;
        break;
      }
      if (!done) result[key] = t;  // parse_lora names what it cannot read
    }
    return result;
  };
  return out;
}

io::LoraWeights read_dit_lora(const DitLoraLayout& layout, const std::string& path,
                              const std::string& dir, const io::LoraReadOptions& options) {
  io::LoraWeights lora = io::read_lora(path, options);
  resolve_dit_targets(layout, lora, dir);
  return lora;
}

models::LoraFolderMergeSummary merge_dit_lora(const std::string& name,
                                              const decltype(FileMergePlan::read)& read,
                                              const std::string& dir, const std::string& lora,
                                              const std::string& output_dir,
                                              const models::LoraFolderMergeOptions& options) {
  FileMergePlan plan;
  plan.components = {{"transformer", "diffusion_pytorch_model"}};
  plan.read = read;
  plan.layouts = "Diffusers, PEFT, kohya or ComfyUI / musubi-tuner " + name;
  return merge_lora_by_files(dir, lora, output_dir, options, plan);
}

void adapt_dit_lora(const DitLoraLayout& layout, io::LoraWeights& lora, const std::string& dir,
                    io::LoraFormat format) {
  resolve_dit_targets(layout, lora, dir);
  if (format != io::LoraFormat::kKohya && format != io::LoraFormat::kComfyUI) return;
  auto it = lora.components.find("transformer");
  if (it == lora.components.end()) return;
  // kohya and ComfyUI files name the original checkpoint's modules where they differ.
  for (auto& t : it->second) t.module = rename_modules(layout.original_renames, t.module);
  if (format != io::LoraFormat::kKohya) return;
  auto& unet = lora.components["unet"];
  for (auto& t : it->second) unet.push_back(std::move(t));
  lora.components.erase("transformer");
}

}  // namespace difftrain::families
