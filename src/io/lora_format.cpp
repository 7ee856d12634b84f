#include "difftrain/io/lora_format.h"

#include "difftrain/io/lora_layout.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"
#include "difftrain/io/lora_adapter_config.h"
#include "difftrain/io/safetensors.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <sstream>
#include <unordered_map>

namespace difftrain::io {
namespace {

// kohya's prefixes of the text encoders' keys and the pipeline component each names; every other
// component's keys are lora_<component>_<module> (the denoiser's as the family registered it).
struct KohyaPrefix {
  const char* prefix;
  const char* component;
};
constexpr std::array<KohyaPrefix, 4> kKohyaPrefixes = {{
    {"lora_te1_", "text_encoder"},
    {"lora_te2_", "text_encoder_2"},
    {"lora_te3_", "text_encoder_3"},
    {"lora_te_", "text_encoder"},
}};

enum class Role { kDown, kUp, kAlpha };

const char* role_name(Role role) {
  switch (role) {
    case Role::kDown: return "down";
    case Role::kUp: return "up";
    case Role::kAlpha: return "alpha";
  }
  return "?";
}

// What one key of the file is. key == prefix + token(role) + suffix, so the key of the same
// module's other weight is prefix + token(other role) + suffix.
struct KeyInfo {
  LoraFormat format;
  std::string component;
  std::string module;
  bool resolved;
  Role role;
  std::string prefix, suffix;
};

bool starts_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(0, p.size(), p) == 0;
}
bool ends_with(const std::string& s, const std::string& p) {
  return s.size() >= p.size() && s.compare(s.size() - p.size(), p.size(), p) == 0;
}

std::string role_token(LoraFormat format, Role role) {
  switch (format) {
    case LoraFormat::kDiffusers: return role == Role::kDown ? "down" : "up";
    case LoraFormat::kPeft: return role == Role::kDown ? "lora_A" : "lora_B";
    case LoraFormat::kKohya:
    case LoraFormat::kComfyUI:  // never parsed as such: a family's layout rewrites it first
      return role == Role::kDown ? "lora_down" : role == Role::kUp ? "lora_up" : "alpha";
  }
  return "";
}

std::string counterpart_key(const KeyInfo& info, Role role) {
  // Down and up share the suffix, except that a kohya alpha has none.
  const std::string suffix = role == Role::kAlpha                ? ""
                             : info.format == LoraFormat::kKohya ? ".weight"
                                                                 : info.suffix;
  return info.prefix + role_token(info.format, role) + suffix;
}

// Splits "<component>.<module>" (with optional base_model.model. before or after the component).
void split_component(const std::string& path, std::string& component, std::string& module) {
  static const std::string kPeftWrap = "base_model.model.";
  std::string rest = starts_with(path, kPeftWrap) ? path.substr(kPeftWrap.size()) : path;
  component.clear();
  // The pipeline components the families registered (io/lora_layout.h); anything else is a
  // module path of Diffusers' oldest layout, which names one component's modules bare (the
  // component a family declared so; none: not a LoRA key).
  for (const auto& c : lora_components()) {
    const std::string head = c + ".";
    if (starts_with(rest, head)) {
      component = c;
      rest = rest.substr(head.size());
      break;
    }
  }
  if (starts_with(rest, kPeftWrap)) rest = rest.substr(kPeftWrap.size());
  if (component.empty()) {
    component = starts_with(rest, "text_model.") ? "text_encoder" : lora_bare_component();
  }
  module = rest;
}

std::optional<KeyInfo> classify_kohya(const std::string& key) {
  const auto dot = key.find('.');
  if (dot == std::string::npos) return std::nullopt;
  const std::string name = key.substr(0, dot);
  const std::string tail = key.substr(dot + 1);
  KeyInfo info{LoraFormat::kKohya, "", "", false, Role::kDown, name + ".", ""};
  if (tail == "lora_down.weight") {
    info.role = Role::kDown;
    info.suffix = ".weight";
  } else if (tail == "lora_up.weight") {
    info.role = Role::kUp;
    info.suffix = ".weight";
  } else if (tail == "alpha") {
    info.role = Role::kAlpha;
  } else {
    return std::nullopt;
  }
  for (const auto& p : kKohyaPrefixes) {
    if (starts_with(name, p.prefix) && name.size() > std::strlen(p.prefix)) {
      info.component = p.component;
      info.module = name.substr(std::strlen(p.prefix));
      return info;
    }
  }
  // Another registered component's, as the writer names it: lora_<component>_<module>.
  for (const auto& c : lora_components()) {
    const std::string prefix = "lora_" + c + "_";
    if (starts_with(name, prefix) && name.size() > prefix.size()) {
      info.component = c;
      info.module = name.substr(prefix.size());
      return info;
    }
  }
  return std::nullopt;
}

// The older Diffusers attention-processor keys: "<attn>.processor.to_q_lora.down.weight" (UNet)
// and "<attn>.to_q_lora.down.weight" (text encoder, whose projections are q_proj ... out_proj).
std::optional<KeyInfo> classify_legacy(const std::string& key) {
  static const std::array<std::pair<const char*, const char*>, 4> kProj = {
      {{"to_q", "q_proj"}, {"to_k", "k_proj"}, {"to_v", "v_proj"}, {"to_out", "out_proj"}}};
  for (const auto& [proj, te_proj] : kProj) {
    for (Role role : {Role::kDown, Role::kUp}) {
      const std::string tail =
          "." + std::string(proj) + "_lora." + role_token(LoraFormat::kDiffusers, role) + ".weight";
      if (!ends_with(key, tail) || key.size() == tail.size()) continue;
      std::string attn = key.substr(0, key.size() - tail.size());
      bool processor = false;
      if (ends_with(attn, ".processor")) {
        attn.resize(attn.size() - std::string(".processor").size());
        processor = true;
      }
      KeyInfo info{LoraFormat::kDiffusers,
                   "",
                   "",
                   true,
                   role,
                   key.substr(0, key.size() - tail.size()) + "." + proj + "_lora.",
                   ".weight"};
      std::string module_attn;
      split_component(attn, info.component, module_attn);
      if (info.component.empty()) return std::nullopt;
      // A text encoder's projections are q_proj ... out_proj; the processor keys are never one's.
      const bool text = !processor && starts_with(info.component, "text_encoder");
      const std::string leaf = text ? te_proj : std::string(proj) == "to_out" ? "to_out.0" : proj;
      info.module = module_attn.empty() ? leaf : module_attn + "." + leaf;
      return info;
    }
  }
  return std::nullopt;
}

std::optional<KeyInfo> classify_dotted(const std::string& key) {
  // Diffusers: "<path>.lora.down.weight" (lora_linear_layer in older text-encoder files).
  for (const char* layer : {".lora.", ".lora_linear_layer."}) {
    for (Role role : {Role::kDown, Role::kUp}) {
      const std::string tail = layer + role_token(LoraFormat::kDiffusers, role) + ".weight";
      if (!ends_with(key, tail) || key.size() == tail.size()) continue;
      const std::string path = key.substr(0, key.size() - tail.size());
      KeyInfo info{LoraFormat::kDiffusers, "", "", true, role, path + layer, ".weight"};
      split_component(path, info.component, info.module);
      if (info.module.empty() || info.component.empty()) return std::nullopt;
      return info;
    }
  }
  if (auto legacy = classify_legacy(key)) return legacy;
  // PEFT: "<path>.lora_A.weight" or "<path>.lora_A.<adapter>.weight".
  if (!ends_with(key, ".weight")) return std::nullopt;
  const std::string stem = key.substr(0, key.size() - std::string(".weight").size());
  for (Role role : {Role::kDown, Role::kUp}) {
    const std::string token = "." + role_token(LoraFormat::kPeft, role);
    std::string path, suffix = ".weight";
    if (ends_with(stem, token)) {
      path = stem.substr(0, stem.size() - token.size());
    } else {
      const auto last = stem.rfind('.');
      if (last == std::string::npos) continue;
      const std::string head = stem.substr(0, last);
      if (!ends_with(head, token)) continue;
      path = head.substr(0, head.size() - token.size());
      suffix = stem.substr(last) + ".weight";
    }
    if (path.empty()) continue;
    KeyInfo info{LoraFormat::kPeft, "", "", true, role, path + ".", suffix};
    split_component(path, info.component, info.module);
    if (info.module.empty() || info.component.empty()) return std::nullopt;
    return info;
  }
  return std::nullopt;
}

std::optional<KeyInfo> classify(const std::string& key) {
  if (starts_with(key, "lora_")) return classify_kohya(key);
  return classify_dotted(key);
}

[[noreturn]] void bad_lora_file(const std::string& path, const std::string& what) {
  throw Error("LoRA file '" + path + "': " + what);
}

// The pieces of one module's LoRA, gathered over the file's keys.
struct Pieces {
  KeyInfo info;  // of the first key seen
  std::string key[3];
  torch::Tensor tensor[3];
};

void check_weight(const std::string& path, const std::string& key, const torch::Tensor& t) {
  if (!torch::isFloatingType(t.scalar_type())) {
    bad_lora_file(path,
                  "'" + key + "' is " + c10::toString(t.scalar_type()) +
                      ": LoRA weights must be floating point (F32, F16, BF16 or F64); the file is "
                      "not a LoRA or is quantized — re-export it in float");
  }
}

double read_alpha(const std::string& path, const std::string& key, const torch::Tensor& t) {
  if (t.numel() != 1 || t.scalar_type() == torch::kBool || t.is_complex()) {
    bad_lora_file(path,
                  "'" + key + "' is " + shape_and_dtype(t) +
                      ": a kohya alpha must be one real number (a scalar); re-export the file");
  }
  const double alpha = t.to(torch::kFloat64).item<double>();
  if (!std::isfinite(alpha)) {
    bad_lora_file(path, "'" + key + "' is " + std::to_string(alpha) +
                            ": a kohya alpha must be finite; re-export the file");
  }
  return alpha;
}

LoraTarget make_target(const std::string& path, const Pieces& p, const LoraReadOptions& options) {
  const int d = static_cast<int>(Role::kDown), u = static_cast<int>(Role::kUp),
            a = static_cast<int>(Role::kAlpha);
  const std::string& present = !p.key[d].empty()   ? p.key[d]
                               : !p.key[u].empty() ? p.key[u]
                                                   : p.key[a];
  for (Role role : {Role::kDown, Role::kUp}) {
    if (p.key[static_cast<int>(role)].empty()) {
      bad_lora_file(path, "'" + present + "' has no matching " + role_name(role) +
                              " weight (expected '" + counterpart_key(p.info, role) +
                              "'); the file is incomplete — re-export or re-download it");
    }
  }
  const torch::Tensor& down = p.tensor[d];
  const torch::Tensor& up = p.tensor[u];
  check_weight(path, p.key[d], down);
  check_weight(path, p.key[u], up);
  const bool linear = down.dim() == 2 && up.dim() == 2;
  const bool conv = down.dim() == 4 && up.dim() == 4 && up.size(2) == 1 && up.size(3) == 1;
  if (!linear && !conv) {
    bad_lora_file(path,
                  "'" + p.key[d] + "' is " + shape_and_dtype(down) + " and '" + p.key[u] + "' is " +
                      shape_and_dtype(up) +
                      ": a LoRA pair must be [r, in] and [out, r] (Linear) or [r, in, kh, kw] and "
                      "[out, r, 1, 1] (Conv2d); LyCORIS variants are not supported");
  }
  if (down.size(0) != up.size(1) || down.size(0) < 1) {
    bad_lora_file(
        path, "'" + p.key[d] + "' has rank " + std::to_string(down.size(0)) + " (" +
                  shape_and_dtype(down) + ") but '" + p.key[u] + "' has rank " +
                  std::to_string(up.size(1)) + " (" + shape_and_dtype(up) +
                  "): down is [r, ...] and up is [out, r, ...] with the same r >= 1; the file is "
                  "corrupt — re-export it");
  }
  LoraTarget target;
  target.format = p.info.format;
  target.module = p.info.module;
  target.resolved = p.info.resolved;
  target.key = p.info.prefix.substr(0, p.info.prefix.size() - 1);
  target.down = down;
  target.up = up;
  if (!p.key[a].empty()) {
    target.alpha = read_alpha(path, p.key[a], p.tensor[a]);
  } else {
    target.alpha = options.alpha;
  }
  return target;
}

std::string two_conventions(const std::string& component, const std::string& module,
                            const std::string& key_a, LoraFormat a, const std::string& key_b,
                            LoraFormat b) {
  return "'" + key_a + "' (" + to_string(a) + ") and '" + key_b + "' (" + to_string(b) +
         ") both give " + component + " module '" + module +
         "': a module's LoRA must be in one key convention; keep one of them";
}

// Gives each Diffusers- or PEFT-keyed target without a kohya .alpha the alpha of `config`,
// checking that the config's rank for it is the rank of its weights.
void apply_config(const std::string& path, const LoraAdapterConfig& config,
                  const std::string& source, const std::string& component,
                  std::vector<LoraTarget>& targets, std::vector<bool>& done) {
  for (size_t i = 0; i < targets.size(); ++i) {
    LoraTarget& t = targets[i];
    if (done[i] || t.format == LoraFormat::kKohya) continue;
    const int64_t r = config.rank_for(t.module);
    if (r != t.rank()) {
      bad_lora_file(path,
                    component + " module '" + t.module + "' (key '" + t.key + "') has rank " +
                        std::to_string(t.rank()) + " but " + source +
                        " gives it r = " + std::to_string(r) +
                        "; that LoraConfig does not describe these weights — fix r / rank_pattern "
                        "or remove it");
    }
    t.alpha = config.target_alpha(t.module);
    done[i] = true;
  }
}

}  // namespace

std::string shape_and_dtype(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes() << " " << c10::toString(t.scalar_type());
  return out.str();
}

std::string to_string(LoraFormat format) {
  switch (format) {
    case LoraFormat::kDiffusers: return "diffusers";
    case LoraFormat::kPeft: return "peft";
    case LoraFormat::kKohya: return "kohya";
    case LoraFormat::kComfyUI: return "comfyui";
  }
  return "?";
}

double LoraTarget::scale() const {
  if (!alpha || *alpha == 0.0) return 1.0;
  return *alpha / static_cast<double>(rank());
}

const std::vector<LoraTarget>& LoraWeights::targets(const std::string& component) const {
  static const std::vector<LoraTarget> kNone;
  const auto it = components.find(component);
  return it == components.end() ? kNone : it->second;
}

LoraWeights read_lora(const std::string& path, const LoraReadOptions& options) {
  namespace fs = std::filesystem;
  std::string file = path;
  if (fs::is_directory(path)) {
    for (const char* name : {"adapter_model.safetensors", "pytorch_lora_weights.safetensors"}) {
      if (fs::is_regular_file(fs::path(path) / name)) {
        file = (fs::path(path) / name).string();
        break;
      }
    }
    if (file == path) {
      throw Error(path +
                  ": a folder without adapter_model.safetensors (PEFT) or "
                  "pytorch_lora_weights.safetensors (Diffusers); give the LoRA file itself");
    }
  }
  LoraReadOptions opts = options;
  if (!opts.adapter_config) {
    const fs::path beside = fs::path(file).parent_path() / kPeftAdapterConfigName;
    if (fs::is_regular_file(beside)) opts.adapter_config = beside.string();
  }
  auto st = load_safetensors(file);
  // A family's own key layout (e.g. FLUX.1's ComfyUI / XLabs keys) read in a generic form
  // (io/lora_layout.h); the family resolves the module names.
  st.tensors = normalize_lora_keys(st.tensors);
  return parse_lora(st.tensors, file, opts, st.metadata);
}

LoraWeights parse_lora(const std::map<std::string, torch::Tensor>& tensors, const std::string& path,
                       const LoraReadOptions& options,
                       const std::map<std::string, std::string>& metadata) {
  if (options.alpha && !(std::isfinite(*options.alpha) && *options.alpha > 0)) {
    throw Error("LoraReadOptions::alpha is " + std::to_string(*options.alpha) +
                ": it must be a finite number > 0 (PEFT's lora_alpha), or unset for scale 1");
  }
  if (tensors.empty()) bad_lora_file(path, "holds no tensors; it is not a LoRA file");

  LoraWeights out;
  out.path = path;
  // component + '\n' + module → pieces, so each component's modules come out sorted.
  std::map<std::string, Pieces> groups;
  // Diffusers / PEFT files may carry "<component>.<module>.alpha" (FLUX LoRAs exported with
  // alphas; Diffusers' lora_state_dict pops them as network alphas): the module's own alpha.
  std::map<std::string, std::pair<std::string, torch::Tensor>> dotted_alphas;
  for (const auto& [key, tensor] : tensors) {
    if (!starts_with(key, "lora_") && ends_with(key, ".alpha") && key.size() > 6) {
      std::string component, module;
      split_component(key.substr(0, key.size() - 6), component, module);
      dotted_alphas[component + '\n' + module] = {key, tensor};
    }
  }
  for (const auto& [key, tensor] : tensors) {
    if (!starts_with(key, "lora_") && ends_with(key, ".alpha") && key.size() > 6) continue;
    auto info = classify(key);
    if (!info) {
      bad_lora_file(path,
                    "key '" + key +
                        "' is not a LoRA weight in a known format (Diffusers "
                        "'<component>.<module>.lora.down.weight', PEFT "
                        "'<component>.<module>.lora_A.weight', kohya "
                        "'lora_<component>_<module>.lora_down.weight'); LyCORIS (LoHa, LoKr), DoRA "
                        "and bias-LoRA files are not supported");
    }
    auto& p = groups[info->component + '\n' + info->module];
    const int r = static_cast<int>(info->role);
    const bool seen = !(p.key[0].empty() && p.key[1].empty() && p.key[2].empty());
    if (seen && p.info.format != info->format) {
      const std::string& other = !p.key[0].empty()   ? p.key[0]
                                 : !p.key[1].empty() ? p.key[1]
                                                     : p.key[2];
      bad_lora_file(path, two_conventions(info->component, info->module, other, p.info.format, key,
                                          info->format));
    }
    if (!p.key[r].empty()) {
      bad_lora_file(path, "'" + p.key[r] + "' and '" + key + "' are both the " +
                              role_name(info->role) + " of " + info->component + " module '" +
                              info->module +
                              "'; keep one (files with several PEFT adapters are not supported)");
    }
    if (p.key[0].empty() && p.key[1].empty() && p.key[2].empty()) p.info = *info;
    p.key[r] = key;
    p.tensor[r] = tensor;
  }
  for (const auto& [id, pieces] : groups) {
    out.components[pieces.info.component].push_back(make_target(path, pieces, options));
  }

  // Alphas kept beside the weights: the file's own metadata first, then adapter_config.json.
  std::map<std::string, LoraAdapterConfig> from_metadata;
  if (const auto m = metadata.find(kLoraAdapterMetadataKey); m != metadata.end()) {
    from_metadata = parse_lora_adapter_metadata(
        m->second, "LoRA file '" + path + "': " + kLoraAdapterMetadataKey);
  }
  std::optional<LoraAdapterConfig> from_file;
  if (options.adapter_config && !options.adapter_config->empty()) {
    from_file = parse_lora_adapter_config(read_file(*options.adapter_config),
                                          "adapter config '" + *options.adapter_config + "'");
  }
  std::array<int, 3> per_format{};
  for (auto& [component, targets] : out.components) {
    std::vector<bool> done(targets.size(), false);
    for (size_t i = 0; i < targets.size(); ++i) {
      ++per_format[static_cast<int>(targets[i].format)];
      // A kohya .alpha wins over any config (it is the module's own); see docs/LORA.md.
      if (targets[i].format == LoraFormat::kKohya) done[i] = true;
    }
    auto it = from_metadata.find(component);
    if (it == from_metadata.end()) it = from_metadata.find("");
    if (it != from_metadata.end()) {
      apply_config(path, it->second, std::string("its ") + kLoraAdapterMetadataKey, component,
                   targets, done);
    }
    if (from_file) {
      apply_config(path, *from_file, "'" + *options.adapter_config + "'", component, targets, done);
    }
  }
  for (const auto& [id, entry] : dotted_alphas) {
    const auto& [key, tensor] = entry;
    const auto nl = id.find('\n');
    const std::string component = id.substr(0, nl), module = id.substr(nl + 1);
    LoraTarget* target = nullptr;
    for (auto& t : out.components[component]) {
      if (t.module == module) target = &t;
    }
    if (target == nullptr) {
      bad_lora_file(path, "'" + key + "' is the alpha of " + component + " module '" + module +
                              "', which has no LoRA weights in the file");
    }
    if (tensor.numel() != 1 || !tensor.is_floating_point() ||
        !std::isfinite(tensor.to(torch::kFloat64).item<double>())) {
      bad_lora_file(path, "'" + key + "' must be one finite number (the module's alpha), got " +
                              shape_and_dtype(tensor));
    }
    // The module's own alpha wins over any config, as a kohya .alpha does.
    target->alpha = tensor.to(torch::kFloat64).item<double>();
  }
  for (auto it = out.components.begin(); it != out.components.end();) {
    it = it->second.empty() ? out.components.erase(it) : std::next(it);
  }
  int formats_used = 0, most = -1;
  for (int f = 0; f < 3; ++f) {
    if (per_format[f] == 0) continue;
    ++formats_used;
    if (most < 0 || per_format[f] > per_format[most]) most = f;
  }
  out.format = static_cast<LoraFormat>(std::max(most, 0));
  out.mixed = formats_used > 1;
  return out;
}

std::string format_label(const LoraWeights& lora) {
  std::string label = to_string(lora.format);
  if (lora.format == LoraFormat::kPeft) {
    bool prefixed = !lora.components.empty();
    for (const auto& [component, targets] : lora.components) {
      for (const auto& t : targets) {
        if (t.format == LoraFormat::kPeft && t.key.rfind(component + ".", 0) != 0) prefixed = false;
      }
    }
    if (prefixed) label = "diffusers";
  }
  return lora.mixed ? label + ", mixed" : label;
}

std::string kohya_name(const std::string& module) {
  std::string name = module;
  for (char& c : name) {
    if (c == '.') c = '_';
  }
  return name;
}

void resolve_kohya_names(LoraWeights& lora, const std::string& component,
                         const std::vector<std::string>& module_names,
                         const std::map<std::string, std::string>& aliases) {
  auto it = lora.components.find(component);
  if (it == lora.components.end()) return;
  std::unordered_map<std::string, std::string> by_name;
  std::unordered_map<std::string, std::string> clash;  // kohya name → a second module
  for (const auto& m : module_names) {
    auto [pos, inserted] = by_name.emplace(kohya_name(m), m);
    if (!inserted && pos->second != m) clash.emplace(pos->first, m);
  }
  for (const auto& [alias, m] : aliases) {
    auto [pos, inserted] = by_name.emplace(kohya_name(alias), m);
    if (!inserted && pos->second != m) clash.emplace(pos->first, m);
  }
  std::unordered_map<std::string, const LoraTarget*> dotted;  // module → its Diffusers/PEFT target
  for (const auto& target : it->second) {
    if (target.resolved) dotted.emplace(target.module, &target);
  }
  for (auto& target : it->second) {
    if (target.resolved) continue;
    const auto found = by_name.find(target.module);
    if (found == by_name.end()) {
      bad_lora_file(lora.path,
                    "kohya key '" + target.key + "' names no module of the " + component +
                        " (no module path becomes '" + target.module +
                        "' with '.' replaced by '_'); is this LoRA for a different model?");
    }
    if (const auto c = clash.find(target.module); c != clash.end()) {
      bad_lora_file(lora.path, "kohya key '" + target.key + "' is ambiguous: modules '" +
                                   found->second + "' and '" + c->second + "' of the " + component +
                                   " both become '" + target.module +
                                   "'; use a Diffusers or PEFT file");
    }
    if (const auto d = dotted.find(found->second); d != dotted.end()) {
      bad_lora_file(lora.path, two_conventions(component, found->second, d->second->key,
                                               d->second->format, target.key, target.format));
    }
    target.module = found->second;
    target.resolved = true;
  }
  std::sort(it->second.begin(), it->second.end(),
            [](const LoraTarget& a, const LoraTarget& b) { return a.module < b.module; });
}

}  // namespace difftrain::io
