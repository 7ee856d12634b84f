// Z-Image LoRA files: Diffusers / PEFT (`transformer.<module>.lora_A.weight`, alphas in the
// metadata or beside the weights), the ComfyUI / musubi-tuner form (`diffusion_model.<module>`
// with lora_down / lora_up / .alpha, read as `transformer.` keys) and kohya names
// (`lora_unet_layers_0_attention_to_q`, resolved against the transformer's weight names), as
// Diffusers' ZImageLoraLoaderMixin reads them (_convert_non_diffusers_z_image_lora_to_diffusers).
#include "difftrain/core/error.h"
#include "difftrain/families/family.h"
#include "difftrain/io/weight_index.h"
#include "z_image_pipeline.h"

#include <algorithm>
#include <filesystem>
#include <regex>

namespace difftrain::families::z_image {
namespace fs = std::filesystem;

namespace {

bool z_starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

bool z_ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

// ZImageTransformer2DModel's top-level modules, as the transformer's keys begin.
bool z_image_module(const std::string& module) {
  static const char* const kTop[] = {"layers.",          "noise_refiner.",  "context_refiner.",
                                     "all_final_layer.", "all_x_embedder.", "cap_embedder.",
                                     "t_embedder."};
  return std::any_of(std::begin(kTop), std::end(kTop),
                     [&](const char* p) { return z_starts_with(module, p); });
}

// A kohya name's top-level module in dotted form, as far as z_image_module() looks:
// "noise_refiner_0_attention_to_q" -> "noise_refiner.".
std::string dotted_top(const std::string& kohya) {
  static const char* const kTop[] = {"layers",          "noise_refiner",  "context_refiner",
                                     "all_final_layer", "all_x_embedder", "cap_embedder",
                                     "t_embedder"};
  for (const char* top : kTop) {
    const std::string p = std::string(top) + "_";
    if (z_starts_with(kohya, p)) return std::string(top) + ".";
  }
  return kohya;
}

bool is_comfyui_z_image_lora(const std::map<std::string, torch::Tensor>& tensors) {
  return std::any_of(tensors.begin(), tensors.end(), [](const auto& kv) {
    return z_starts_with(kv.first, "diffusion_model.") &&
           z_image_module(kv.first.substr(std::string("diffusion_model.").size()));
  });
}

std::map<std::string, torch::Tensor> normalize_comfyui_z_image_lora(
    const std::map<std::string, torch::Tensor>& tensors) {
  static const std::vector<std::pair<std::string, std::string>> kSuffixes = {
      {".lora_down.weight", ".lora_A.weight"},
      {".lora_up.weight", ".lora_B.weight"},
      {".lora_A.weight", ".lora_A.weight"},
      {".lora_B.weight", ".lora_B.weight"},
      {".alpha", ".alpha"}};
  // The original checkpoint's attention output `out` is Diffusers' `to_out.0`.
  static const std::regex kOut(R"(\.attention\.out$)");
  std::map<std::string, torch::Tensor> out;
  for (const auto& [key, t] : tensors) {
    if (!z_starts_with(key, "diffusion_model.")) {
      out[key] = t;
      continue;
    }
    std::string rest = key.substr(std::string("diffusion_model.").size());
    bool done = false;
    for (const auto& [from, to] : kSuffixes) {
      if (rest.size() <= from.size() || !z_ends_with(rest, from)) continue;
      std::string module = rest.substr(0, rest.size() - from.size());
      module = std::regex_replace(module, kOut, ".attention.to_out.0");
      out["transformer." + module + to] = t;
      done = true;
      break;
    }
    if (!done) out[key] = t;  // parse_lora names what it cannot read
  }
  return out;
}

// The module names of the transformer's weights (every shard), read from the headers alone.
std::vector<std::string> transformer_modules(const std::string& dir) {
  std::vector<std::string> names;
  const std::string transformer = z_image_transformer_dir(dir);
  for (const auto& path : io::find_weight_files(transformer, "diffusion_pytorch_model", "").files) {
    for (auto& m : safetensors_module_names(path)) names.push_back(std::move(m));
  }
  return names;
}

// kohya's lora_unet_ targets named as Z-Image's modules are the transformer's (musubi-tuner and
// Diffusers' converter name them so): moved there and resolved against its weight names. Other
// lora_unet_ targets (a Stable Diffusion LoRA) stay, for check_lora_fits_family to name.
void resolve_z_image_targets(io::LoraWeights& lora, const std::string& dir) {
  auto unet = lora.components.find("unet");
  if (unet != lora.components.end()) {
    auto& transformer = lora.components["transformer"];
    auto& rest = unet->second;
    for (auto it = rest.begin(); it != rest.end();) {
      if (!it->resolved && z_image_module(dotted_top(it->module))) {
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
  io::resolve_kohya_names(lora, "transformer", transformer_modules(dir));
}

}  // namespace

io::LoraWeights read_z_image_lora(const std::string& path, const std::string& dir,
                                  const io::LoraReadOptions& options) {
  io::LoraWeights lora = io::read_lora(path, options);
  resolve_z_image_targets(lora, dir);
  return lora;
}

void adapt_z_image_lora(io::LoraWeights& lora, const std::string& dir, io::LoraFormat format) {
  resolve_z_image_targets(lora, dir);
  if (format != io::LoraFormat::kKohya) return;
  // kohya keys name the transformer lora_unet_ (sd-scripts, musubi-tuner, Diffusers' converter).
  auto it = lora.components.find("transformer");
  if (it == lora.components.end()) return;
  auto& unet = lora.components["unet"];
  for (auto& t : it->second) unet.push_back(std::move(t));
  lora.components.erase("transformer");
}

io::LoraKeyLayout z_image_lora_key_layout() {
  return {"Z-Image ComfyUI / musubi-tuner", is_comfyui_z_image_lora,
          normalize_comfyui_z_image_lora};
}

}  // namespace difftrain::families::z_image
