#include "difftrain/io/lora_format.h"

#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"

#include <torch/torch.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <sstream>
#include <unordered_map>

namespace difftrain::io {
namespace {

// Pipeline components a dotted key may start with; anything else is a UNet module path.
constexpr std::array<const char*, 5> kComponents = {"unet", "text_encoder", "text_encoder_2",
                                                    "text_encoder_3", "transformer"};

// kohya's key prefixes and the pipeline component each names.
struct KohyaPrefix {
  const char* prefix;
  const char* component;
};
constexpr std::array<KohyaPrefix, 6> kKohyaPrefixes = {{
    {"lora_unet_", "unet"},
    {"lora_te1_", "text_encoder"},
    {"lora_te2_", "text_encoder_2"},
    {"lora_te3_", "text_encoder_3"},
    {"lora_te_", "text_encoder"},
    {"lora_transformer_", "transformer"},
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
  for (const char* c : kComponents) {
    const std::string head = std::string(c) + ".";
    if (starts_with(rest, head)) {
      component = c;
      rest = rest.substr(head.size());
      break;
    }
  }
  if (starts_with(rest, kPeftWrap)) rest = rest.substr(kPeftWrap.size());
  if (component.empty()) component = starts_with(rest, "text_model.") ? "text_encoder" : "unet";
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
      const bool text = !processor && info.component != "unet";
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
      if (info.module.empty()) return std::nullopt;
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
    if (info.module.empty()) return std::nullopt;
    return info;
  }
  return std::nullopt;
}

std::optional<KeyInfo> classify(const std::string& key) {
  if (starts_with(key, "lora_")) return classify_kohya(key);
  return classify_dotted(key);
}

std::string shape_of(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes() << " " << c10::toString(t.scalar_type());
  return out.str();
}

[[noreturn]] void fail(const std::string& path, const std::string& what) {
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
    fail(path, "'" + key + "' is " + c10::toString(t.scalar_type()) +
                   ": LoRA weights must be floating point (F32, F16, BF16 or F64); the file is "
                   "not a LoRA or is quantized — re-export it in float");
  }
}

double read_alpha(const std::string& path, const std::string& key, const torch::Tensor& t) {
  if (t.numel() != 1 || t.scalar_type() == torch::kBool || t.is_complex()) {
    fail(path, "'" + key + "' is " + shape_of(t) +
                   ": a kohya alpha must be one real number (a scalar); re-export the file");
  }
  const double alpha = t.to(torch::kFloat64).item<double>();
  if (!std::isfinite(alpha)) {
    fail(path, "'" + key + "' is " + std::to_string(alpha) +
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
      fail(path, "'" + present + "' has no matching " + role_name(role) + " weight (expected '" +
                     counterpart_key(p.info, role) +
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
    fail(path, "'" + p.key[d] + "' is " + shape_of(down) + " and '" + p.key[u] + "' is " +
                   shape_of(up) +
                   ": a LoRA pair must be [r, in] and [out, r] (Linear) or [r, in, kh, kw] and "
                   "[out, r, 1, 1] (Conv2d); LyCORIS variants are not supported");
  }
  if (down.size(0) != up.size(1) || down.size(0) < 1) {
    fail(path, "'" + p.key[d] + "' has rank " + std::to_string(down.size(0)) + " (" +
                   shape_of(down) + ") but '" + p.key[u] + "' has rank " +
                   std::to_string(up.size(1)) + " (" + shape_of(up) +
                   "): down is [r, ...] and up is [out, r, ...] with the same r >= 1; the file is "
                   "corrupt — re-export it");
  }
  LoraTarget target;
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

}  // namespace

std::string to_string(LoraFormat format) {
  switch (format) {
    case LoraFormat::kDiffusers: return "diffusers";
    case LoraFormat::kPeft: return "peft";
    case LoraFormat::kKohya: return "kohya";
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
  return parse_lora(load_safetensors(path).tensors, path, options);
}

LoraWeights parse_lora(const std::map<std::string, torch::Tensor>& tensors, const std::string& path,
                       const LoraReadOptions& options) {
  if (options.alpha && !(std::isfinite(*options.alpha) && *options.alpha > 0)) {
    throw Error("LoraReadOptions::alpha is " + std::to_string(*options.alpha) +
                ": it must be a finite number > 0 (PEFT's lora_alpha), or unset for scale 1");
  }
  if (tensors.empty()) fail(path, "holds no tensors; it is not a LoRA file");

  LoraWeights out;
  out.path = path;
  std::string first_key;
  // component + '\n' + module → pieces, so each component's modules come out sorted.
  std::map<std::string, Pieces> groups;
  for (const auto& [key, tensor] : tensors) {
    auto info = classify(key);
    if (!info) {
      fail(path, "key '" + key +
                     "' is not a LoRA weight in a known format (Diffusers "
                     "'unet.<module>.lora.down.weight', PEFT 'unet.<module>.lora_A.weight', kohya "
                     "'lora_unet_<module>.lora_down.weight'); LyCORIS (LoHa, LoKr), DoRA and "
                     "bias-LoRA files are not supported");
    }
    if (first_key.empty()) {
      first_key = key;
      out.format = info->format;
    } else if (info->format != out.format) {
      fail(path, "mixes key formats: '" + first_key + "' is " + to_string(out.format) + " but '" +
                     key + "' is " + to_string(info->format) +
                     "; convert it to one format before loading");
    }
    auto& p = groups[info->component + '\n' + info->module];
    const int r = static_cast<int>(info->role);
    if (!p.key[r].empty()) {
      fail(path, "'" + p.key[r] + "' and '" + key + "' are both the " + role_name(info->role) +
                     " of " + info->component + " module '" + info->module +
                     "'; keep one (files with several PEFT adapters are not supported)");
    }
    if (p.key[0].empty() && p.key[1].empty() && p.key[2].empty()) p.info = *info;
    p.key[r] = key;
    p.tensor[r] = tensor;
  }
  for (const auto& [id, pieces] : groups) {
    out.components[pieces.info.component].push_back(make_target(path, pieces, options));
  }
  return out;
}

std::string kohya_name(const std::string& module) {
  std::string name = module;
  for (char& c : name) {
    if (c == '.') c = '_';
  }
  return name;
}

void resolve_kohya_names(LoraWeights& lora, const std::string& component,
                         const std::vector<std::string>& module_names) {
  auto it = lora.components.find(component);
  if (it == lora.components.end()) return;
  std::unordered_map<std::string, std::string> by_name;
  std::unordered_map<std::string, std::string> clash;  // kohya name → a second module
  for (const auto& m : module_names) {
    auto [pos, inserted] = by_name.emplace(kohya_name(m), m);
    if (!inserted && pos->second != m) clash.emplace(pos->first, m);
  }
  for (auto& target : it->second) {
    if (target.resolved) continue;
    const auto found = by_name.find(target.module);
    if (found == by_name.end()) {
      fail(lora.path, "kohya key '" + target.key + "' names no module of the " + component +
                          " (no module path becomes '" + target.module +
                          "' with '.' replaced by '_'); is this LoRA for a different model?");
    }
    if (const auto c = clash.find(target.module); c != clash.end()) {
      fail(lora.path, "kohya key '" + target.key + "' is ambiguous: modules '" + found->second +
                          "' and '" + c->second + "' of the " + component + " both become '" +
                          target.module + "'; use a Diffusers or PEFT file");
    }
    target.module = found->second;
    target.resolved = true;
  }
  std::sort(it->second.begin(), it->second.end(),
            [](const LoraTarget& a, const LoraTarget& b) { return a.module < b.module; });
}

}  // namespace difftrain::io
