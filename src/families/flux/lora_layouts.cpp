// FLUX.1 LoRA layouts <-> Diffusers module targets (families/flux/lora_layouts.h).
#include "difftrain/families/flux/lora_layouts.h"

#include "difftrain/core/error.h"
#include "difftrain/io/safetensors.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <optional>
#include <regex>

namespace difftrain::families::flux {
using io::LoraFormat;
using io::LoraReadOptions;
using io::LoraTarget;
using io::LoraWeights;
namespace {

bool flux_starts_with(const std::string& s, const std::string& p) { return s.rfind(p, 0) == 0; }

std::string flux_underscored(std::string s) {
  for (char& c : s) {
    if (c == '.') c = '_';
  }
  return s;
}

// One Diffusers module a BFL module (or a row range of it) becomes.
struct FluxPart {
  std::string module;
  int64_t rows;  // 0: the rest of the up's rows
};

// A BFL module in kohya underscore form, e.g. "double_blocks_3_img_attn_qkv".
struct FluxBflName {
  std::vector<FluxPart> parts;
  bool swap_halves = false;  // final_layer_adaLN_modulation_1: (shift, scale) -> (scale, shift)
};

std::optional<FluxBflName> flux_parse_bfl(const std::string& name, const FluxLoraDims& d,
                                          const std::string& key) {
  static const std::regex kDouble(
      R"(double_blocks_(\d+)_(img|txt)_(attn_qkv|attn_proj|mlp_0|mlp_2|mod_lin))");
  static const std::regex kSingle(R"(single_blocks_(\d+)_(linear1|linear2|modulation_lin))");
  std::smatch m;
  const int64_t D = d.inner_dim;
  FluxBflName out;
  if (std::regex_match(name, m, kDouble)) {
    const int64_t i = std::stoll(m[1]);
    if (i >= d.double_blocks) {
      throw Error(
          fmt::format("LoRA key {}: double block {} is beyond the model's {} double "
                      "blocks; is this LoRA for a different model?",
                      key, i, d.double_blocks));
    }
    const std::string b = fmt::format("transformer_blocks.{}.", i);
    const bool img = m[2] == "img";
    const std::string what = m[3];
    if (what == "attn_qkv") {
      for (const char* q : {"q", "k", "v"}) {
        out.parts.push_back(
            {b + (img ? fmt::format("attn.to_{}", q) : fmt::format("attn.add_{}_proj", q)), D});
      }
    } else if (what == "attn_proj") {
      out.parts.push_back({b + (img ? "attn.to_out.0" : "attn.to_add_out"), 0});
    } else if (what == "mlp_0") {
      out.parts.push_back({b + (img ? "ff.net.0.proj" : "ff_context.net.0.proj"), 0});
    } else if (what == "mlp_2") {
      out.parts.push_back({b + (img ? "ff.net.2" : "ff_context.net.2"), 0});
    } else {
      out.parts.push_back({b + (img ? "norm1.linear" : "norm1_context.linear"), 0});
    }
    return out;
  }
  if (std::regex_match(name, m, kSingle)) {
    const int64_t i = std::stoll(m[1]);
    if (i >= d.single_blocks) {
      throw Error(
          fmt::format("LoRA key {}: single block {} is beyond the model's {} single "
                      "blocks; is this LoRA for a different model?",
                      key, i, d.single_blocks));
    }
    const std::string b = fmt::format("single_transformer_blocks.{}.", i);
    if (m[2] == "linear1") {
      out.parts = {
          {b + "attn.to_q", D}, {b + "attn.to_k", D}, {b + "attn.to_v", D}, {b + "proj_mlp", 0}};
    } else if (m[2] == "linear2") {
      out.parts = {{b + "proj_out", 0}};
    } else {
      out.parts = {{b + "norm.linear", 0}};
    }
    return out;
  }
  static const std::map<std::string, std::string> kTop = {
      {"img_in", "x_embedder"},
      {"txt_in", "context_embedder"},
      {"time_in_in_layer", "time_text_embed.timestep_embedder.linear_1"},
      {"time_in_out_layer", "time_text_embed.timestep_embedder.linear_2"},
      {"vector_in_in_layer", "time_text_embed.text_embedder.linear_1"},
      {"vector_in_out_layer", "time_text_embed.text_embedder.linear_2"},
      {"guidance_in_in_layer", "time_text_embed.guidance_embedder.linear_1"},
      {"guidance_in_out_layer", "time_text_embed.guidance_embedder.linear_2"},
      {"final_layer_linear", "proj_out"},
      {"final_layer_adaLN_modulation_1", "norm_out.linear"}};
  const auto it = kTop.find(name);
  if (it == kTop.end()) return std::nullopt;
  out.parts = {{it->second, 0}};
  out.swap_halves = name == "final_layer_adaLN_modulation_1";
  return out;
}

// up's rows [begin, end) x columns outside [c0, c1) are all zero.
bool flux_off_block_zero(const torch::Tensor& up, int64_t begin, int64_t end, int64_t c0,
                         int64_t c1) {
  const torch::Tensor rows = up.narrow(0, begin, end - begin);
  const bool left = c0 == 0 || rows.narrow(1, 0, c0).abs().max().item<double>() == 0.0;
  const bool right =
      c1 == up.size(1) || rows.narrow(1, c1, up.size(1) - c1).abs().max().item<double>() == 0.0;
  return left && right;
}

}  // namespace

bool is_bfl_flux_lora(const std::map<std::string, torch::Tensor>& tensors) {
  for (const auto& [key, t] : tensors) {
    (void)t;
    if (flux_starts_with(key, "lora_unet_double_blocks_") ||
        flux_starts_with(key, "lora_unet_single_blocks_") ||
        flux_starts_with(key, "diffusion_model.double_blocks.") ||
        flux_starts_with(key, "diffusion_model.single_blocks.") ||
        key.find(".processor.qkv_lora") != std::string::npos ||
        key.find(".processor.proj_lora") != std::string::npos) {
      return true;
    }
  }
  return false;
}

std::map<std::string, torch::Tensor> normalize_flux_lora_keys(
    const std::map<std::string, torch::Tensor>& tensors) {
  static const std::regex kXlabs(
      R"((double_blocks|single_blocks)\.(\d+)\.processor\.(qkv|proj)_lora(1|2)?\.(down|up)\.weight)");
  static const std::vector<std::pair<std::string, std::string>> kSuffixes = {
      {".lora_down.weight", ".lora_down.weight"},
      {".lora_up.weight", ".lora_up.weight"},
      {".lora_A.weight", ".lora_down.weight"},
      {".lora_B.weight", ".lora_up.weight"},
      {".alpha", ".alpha"}};
  std::map<std::string, torch::Tensor> out;
  for (const auto& [key, t] : tensors) {
    std::smatch m;
    if (flux_starts_with(key, "diffusion_model.")) {
      const std::string rest = key.substr(std::string("diffusion_model.").size());
      bool done = false;
      for (const auto& [from, to] : kSuffixes) {
        if (rest.size() > from.size() &&
            rest.compare(rest.size() - from.size(), from.size(), from) == 0) {
          out["lora_unet_" + flux_underscored(rest.substr(0, rest.size() - from.size())) + to] = t;
          done = true;
          break;
        }
      }
      if (!done) out[key] = t;  // parse_lora names it
    } else if (std::regex_match(key, m, kXlabs)) {
      const bool dbl = m[1] == "double_blocks";
      std::string module;
      if (dbl) {
        const std::string stream = m[4] == "2" ? "txt" : "img";
        module = fmt::format("double_blocks_{}_{}_attn_{}", m[2].str(), stream,
                             m[3] == "qkv" ? "qkv" : "proj");
      } else {
        module =
            fmt::format("single_blocks_{}_{}", m[2].str(), m[3] == "qkv" ? "linear1" : "linear2");
      }
      const bool down = m[5] == "down";
      out["lora_unet_" + module + (down ? ".lora_down.weight" : ".lora_up.weight")] = t;
      // XLabs stores no alpha; Diffusers applies these at scale 1.
      if (down)
        out["lora_unet_" + module + ".alpha"] = torch::tensor(static_cast<float>(t.size(0)));
    } else {
      out[key] = t;
    }
  }
  return out;
}

namespace {

// The BFL module (kohya underscore form) and the part index of a Diffusers transformer module.
struct FluxBflPart {
  std::string bfl;
  int64_t part = 0;
  int64_t parts = 1;
  bool swap_halves = false;
};

std::optional<FluxBflPart> flux_bfl_of(const std::string& module) {
  static const std::regex kDouble(R"(transformer_blocks\.(\d+)\.(.+))");
  static const std::regex kSingle(R"(single_transformer_blocks\.(\d+)\.(.+))");
  std::smatch m;
  if (std::regex_match(module, m, kDouble)) {
    static const std::map<std::string, std::pair<std::string, int64_t>> kParts = {
        {"attn.to_q", {"img_attn_qkv", 0}},
        {"attn.to_k", {"img_attn_qkv", 1}},
        {"attn.to_v", {"img_attn_qkv", 2}},
        {"attn.add_q_proj", {"txt_attn_qkv", 0}},
        {"attn.add_k_proj", {"txt_attn_qkv", 1}},
        {"attn.add_v_proj", {"txt_attn_qkv", 2}},
        {"attn.to_out.0", {"img_attn_proj", -1}},
        {"attn.to_add_out", {"txt_attn_proj", -1}},
        {"ff.net.0.proj", {"img_mlp_0", -1}},
        {"ff.net.2", {"img_mlp_2", -1}},
        {"ff_context.net.0.proj", {"txt_mlp_0", -1}},
        {"ff_context.net.2", {"txt_mlp_2", -1}},
        {"norm1.linear", {"img_mod_lin", -1}},
        {"norm1_context.linear", {"txt_mod_lin", -1}}};
    const auto it = kParts.find(m[2]);
    if (it == kParts.end()) return std::nullopt;
    FluxBflPart p;
    p.bfl = "double_blocks_" + m[1].str() + "_" + it->second.first;
    if (it->second.second >= 0) {
      p.part = it->second.second;
      p.parts = 3;
    }
    return p;
  }
  if (std::regex_match(module, m, kSingle)) {
    static const std::map<std::string, std::pair<std::string, int64_t>> kParts = {
        {"attn.to_q", {"linear1", 0}}, {"attn.to_k", {"linear1", 1}},
        {"attn.to_v", {"linear1", 2}}, {"proj_mlp", {"linear1", 3}},
        {"proj_out", {"linear2", -1}}, {"norm.linear", {"modulation_lin", -1}}};
    const auto it = kParts.find(m[2]);
    if (it == kParts.end()) return std::nullopt;
    FluxBflPart p;
    p.bfl = "single_blocks_" + m[1].str() + "_" + it->second.first;
    if (it->second.second >= 0) {
      p.part = it->second.second;
      p.parts = 4;
    }
    return p;
  }
  static const std::map<std::string, std::string> kTop = {
      {"x_embedder", "img_in"},
      {"context_embedder", "txt_in"},
      {"time_text_embed.timestep_embedder.linear_1", "time_in_in_layer"},
      {"time_text_embed.timestep_embedder.linear_2", "time_in_out_layer"},
      {"time_text_embed.text_embedder.linear_1", "vector_in_in_layer"},
      {"time_text_embed.text_embedder.linear_2", "vector_in_out_layer"},
      {"time_text_embed.guidance_embedder.linear_1", "guidance_in_in_layer"},
      {"time_text_embed.guidance_embedder.linear_2", "guidance_in_out_layer"},
      {"proj_out", "final_layer_linear"},
      {"norm_out.linear", "final_layer_adaLN_modulation_1"}};
  const auto it = kTop.find(module);
  if (it == kTop.end()) return std::nullopt;
  FluxBflPart p;
  p.bfl = it->second;
  p.swap_halves = module == "norm_out.linear";
  return p;
}

}  // namespace

void convert_flux_lora(LoraWeights& lora, const FluxLoraDims& dims) {
  auto it = lora.components.find("unet");
  if (it == lora.components.end()) return;
  std::vector<LoraTarget> keep, converted;
  for (auto& t : it->second) {
    const std::string key = t.key.empty() ? t.module : t.key;
    if (t.resolved) {
      // Diffusers / PEFT keys without the "transformer." prefix (a bare PEFT adapter of the
      // transformer) name its modules directly.
      const bool transformer_module = flux_starts_with(t.module, "transformer_blocks.") ||
                                      flux_starts_with(t.module, "single_transformer_blocks.") ||
                                      flux_bfl_of(t.module).has_value();
      if (transformer_module) {
        converted.push_back(std::move(t));
      } else {
        keep.push_back(std::move(t));
      }
      continue;
    }
    const auto bfl = flux_parse_bfl(t.module, dims, key);
    if (!bfl) {
      keep.push_back(std::move(t));
      continue;
    }
    const int64_t total = t.up.size(0);
    int64_t fixed = 0;
    for (const auto& p : bfl->parts) fixed += p.rows;
    std::vector<int64_t> rows;
    for (const auto& p : bfl->parts) rows.push_back(p.rows == 0 ? total - fixed : p.rows);
    // linear1 without the mlp rows (XLabs' single-block qkv_lora): q, k, v only.
    auto parts = bfl->parts;
    if (parts.size() == 4 && total == fixed) {
      parts.pop_back();
      rows.pop_back();
    }
    if (total < fixed || (parts.size() > 1 && rows.back() <= 0 && bfl->parts.back().rows == 0)) {
      throw Error(fmt::format(
          "LoRA key {}: lora_up has {} rows, but the fused module needs {}{} "
          "(model width {}); is this LoRA for a different model?",
          key, total, fixed, parts.back().rows == 0 ? " plus the MLP" : "", dims.inner_dim));
    }
    int64_t sum = 0;
    for (int64_t r : rows) sum += r;
    if (sum != total) {
      throw Error(
          fmt::format("LoRA key {}: lora_up has {} rows; the fused module's parts need {} "
                      "(model width {}); is this LoRA for a different model?",
                      key, total, sum, dims.inner_dim));
    }
    torch::Tensor up = t.up;
    if (bfl->swap_halves) {
      const int64_t h = total / 2;
      up = torch::cat({up.narrow(0, h, total - h), up.narrow(0, 0, h)});
    }
    const int64_t n = static_cast<int64_t>(parts.size());
    const int64_t r = t.rank();
    bool sparse = n > 1 && r % n == 0;
    for (int64_t i = 0, begin = 0; sparse && i < n; begin += rows[static_cast<size_t>(i)], ++i) {
      sparse = flux_off_block_zero(up, begin, begin + rows[static_cast<size_t>(i)], i * (r / n),
                                   (i + 1) * (r / n));
    }
    for (int64_t i = 0, begin = 0; i < n; begin += rows[static_cast<size_t>(i)], ++i) {
      LoraTarget p;
      p.module = parts[static_cast<size_t>(i)].module;
      p.resolved = true;
      p.key = t.key;
      p.format = t.format;
      const int64_t count = rows[static_cast<size_t>(i)];
      if (sparse) {
        const int64_t c = r / n;
        p.down = t.down.narrow(0, i * c, c).contiguous();
        p.up = up.narrow(0, begin, count).narrow(1, i * c, c).contiguous();
        // The stacked rank's scale alpha / r, kept: alpha_part / c = alpha / r.
        if (t.alpha) p.alpha = t.scale() * static_cast<double>(c);
      } else {
        p.down = t.down;
        p.up = up.narrow(0, begin, count).contiguous();
        p.alpha = t.alpha;
      }
      converted.push_back(std::move(p));
    }
  }
  if (converted.empty()) return;
  if (keep.empty()) {
    lora.components.erase(it);
  } else {
    it->second = std::move(keep);
  }
  auto& transformer = lora.components["transformer"];
  for (auto& p : converted) {
    for (const auto& existing : transformer) {
      if (existing.module == p.module) {
        throw Error(fmt::format("LoRA {}: module transformer.{} comes twice (from {} and {})",
                                lora.path, p.module, existing.key, p.key));
      }
    }
    transformer.push_back(std::move(p));
  }
  std::sort(transformer.begin(), transformer.end(),
            [](const LoraTarget& a, const LoraTarget& b) { return a.module < b.module; });
}

LoraWeights flux_lora_to_bfl(const LoraWeights& lora, int64_t mlp_dim) {
  LoraWeights out = lora;
  out.kohya_numbered_text_encoders = true;  // CLIP is lora_te1_ in sd-scripts' FLUX files
  const auto it = out.components.find("transformer");
  if (it == out.components.end()) return out;
  // BFL module -> its parts (index -> target).
  std::map<std::string, std::map<int64_t, const LoraTarget*>> fused;
  std::map<std::string, int64_t> part_count;
  std::vector<LoraTarget> plain;
  for (const auto& t : it->second) {
    const auto b = flux_bfl_of(t.module);
    if (!b) {
      throw Error(
          fmt::format("LoRA {}: transformer module {} has no BFL (kohya FLUX) name; "
                      "write this LoRA in the Diffusers or PEFT layout",
                      lora.path, t.module));
    }
    if (t.down.dim() != 2) {
      throw Error(
          fmt::format("LoRA {}: transformer module {} is not a Linear LoRA", lora.path, t.module));
    }
    if (b->parts == 1) {
      LoraTarget p = t;
      p.module = b->bfl;
      p.resolved = false;
      p.format = LoraFormat::kKohya;
      if (b->swap_halves) {
        const int64_t h = p.up.size(0) / 2;
        p.up = torch::cat({p.up.narrow(0, h, p.up.size(0) - h), p.up.narrow(0, 0, h)});
      }
      plain.push_back(std::move(p));
      continue;
    }
    fused[b->bfl][b->part] = &t;
    part_count[b->bfl] = b->parts;
  }
  for (const auto& [bfl, parts] : fused) {
    const int64_t n = part_count[bfl];
    int64_t c = 0;
    std::optional<double> common;
    bool same = true;
    const LoraTarget* any = parts.begin()->second;
    for (const auto& [i, t] : parts) {
      (void)i;
      c = std::max(c, t->rank());
      if (common && *common != t->scale()) same = false;
      common = t->scale();
    }
    // Rows of a missing part: the model's width (q/k/v share the first part's rows).
    const int64_t in = any->down.size(1);
    const int64_t part_rows = any->up.size(0);
    auto opts = any->up.options().dtype(torch::kFloat32);
    std::vector<torch::Tensor> downs, ups;
    int64_t total_rows = 0;
    std::vector<int64_t> rows(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) {
      const auto p = parts.find(i);
      rows[static_cast<size_t>(i)] = p != parts.end() ? p->second->up.size(0) : part_rows;
      if (p == parts.end() && i == 3 && mlp_dim > 0) rows[3] = mlp_dim;
      if (p == parts.end() && i == 3 && mlp_dim <= 0) {
        throw Error(
            fmt::format("LoRA {}: {} has LoRAs for the attention of a single block but "
                        "not for proj_mlp; its width is unknown here: write this LoRA in "
                        "the Diffusers or PEFT layout",
                        lora.path, bfl));
      }
      total_rows += rows[static_cast<size_t>(i)];
    }
    torch::Tensor down = torch::zeros({n * c, in}, opts);
    torch::Tensor up = torch::zeros({total_rows, n * c}, opts);
    for (int64_t i = 0, begin = 0; i < n; begin += rows[static_cast<size_t>(i)], ++i) {
      const auto p = parts.find(i);
      if (p == parts.end()) continue;
      const LoraTarget& t = *p->second;
      const double fold = same ? 1.0 : t.scale();
      down.narrow(0, i * c, t.rank()).copy_(t.down.to(torch::kFloat32));
      up.narrow(0, begin, t.up.size(0))
          .narrow(1, i * c, t.rank())
          .copy_(t.up.to(torch::kFloat64).mul(fold).to(torch::kFloat32));
    }
    LoraTarget f;
    f.module = bfl;
    f.resolved = false;
    f.key = "lora_unet_" + bfl;
    f.format = LoraFormat::kKohya;
    f.down = down.to(any->down.scalar_type());
    f.up = up.to(any->up.scalar_type());
    f.alpha = (same ? *common : 1.0) * static_cast<double>(n * c);
    plain.push_back(std::move(f));
  }
  out.components.erase("transformer");
  auto& unet = out.components["unet"];
  for (auto& p : plain) unet.push_back(std::move(p));
  std::sort(unet.begin(), unet.end(),
            [](const LoraTarget& a, const LoraTarget& b) { return a.module < b.module; });
  out.format = LoraFormat::kKohya;
  return out;
}

LoraWeights read_flux_lora(const std::string& path, const FluxLoraDims& dims,
                           const LoraReadOptions& options) {
  LoraWeights lora = io::read_lora(path, options);
  convert_flux_lora(lora, dims);
  return lora;
}

io::LoraKeyLayout flux_lora_key_layout() {
  return {"FLUX.1 ComfyUI / XLabs", is_bfl_flux_lora, normalize_flux_lora_keys};
}

}  // namespace difftrain::families::flux
