#include "difftrain/models/unets/sgm_names.h"

#include "difftrain/core/error.h"

#include <sstream>
#include <vector>

namespace difftrain::models {

namespace {

std::vector<std::string> split_dots(const std::string& s) {
  std::vector<std::string> parts;
  std::stringstream ss(s);
  std::string item;
  while (std::getline(ss, item, '.')) parts.push_back(item);
  return parts;
}

std::string join_from(const std::vector<std::string>& parts, size_t from) {
  std::string out;
  for (size_t i = from; i < parts.size(); ++i) out += (out.empty() ? "" : ".") + parts[i];
  return out;
}

// A resnet's inner path in SGM names ("" when unknown).
std::string sgm_resnet_inner(const std::vector<std::string>& parts, size_t from) {
  if (from >= parts.size()) return "";
  static const std::map<std::string, std::string> kInner = {
      {"norm1", "in_layers.0"},  {"conv1", "in_layers.2"},  {"time_emb_proj", "emb_layers.1"},
      {"norm2", "out_layers.0"}, {"conv2", "out_layers.3"}, {"conv_shortcut", "skip_connection"}};
  auto it = kInner.find(parts[from]);
  if (it == kInner.end()) return "";
  const std::string rest = join_from(parts, from + 1);
  return it->second + (rest.empty() ? "" : "." + rest);
}

bool parse_index(const std::string& s, int64_t& out) {
  if (s.empty() || s.size() > 6) return false;
  for (char c : s) {
    if (c < '0' || c > '9') return false;
  }
  out = std::stoll(s);
  return true;
}

bool has_attention(const std::string& block_type) {
  return block_type.find("Attn") != std::string::npos;
}

}  // namespace

std::string sgm_module_name(const UNetConfig& c, const std::string& module) {
  static const std::map<std::string, std::string> kFixed = {
      {"conv_in", "input_blocks.0.0"},
      {"time_embedding.linear_1", "time_embed.0"},
      {"time_embedding.linear_2", "time_embed.2"},
      {"add_embedding.linear_1", "label_emb.0.0"},
      {"add_embedding.linear_2", "label_emb.0.2"},
      {"conv_norm_out", "out.0"},
      {"conv_out", "out.2"}};
  if (auto it = kFixed.find(module); it != kFixed.end()) return it->second;
  const auto parts = split_dots(module);
  if (parts.size() < 3) return "";
  const size_t levels = c.block_out_channels.size();
  auto with_inner = [&](const std::string& head, const std::string& kind, size_t from) {
    const std::string inner =
        kind == "resnets" ? sgm_resnet_inner(parts, from) : join_from(parts, from);
    return inner.empty() ? std::string() : head + "." + inner;
  };
  if (parts[0] == "mid_block") {
    int64_t j = 0;
    if (!parse_index(parts[2], j)) return "";
    if (parts[1] == "resnets" && (j == 0 || j == 1)) {
      return with_inner("middle_block." + std::to_string(2 * j), "resnets", 3);
    }
    if (parts[1] == "attentions" && j == 0) return with_inner("middle_block.1", "attentions", 3);
    return "";
  }
  if (parts.size() < 4) return "";
  int64_t b = 0, j = 0;
  if (!parse_index(parts[1], b) || !parse_index(parts[3], j)) return "";
  if (b < 0 || static_cast<size_t>(b) >= levels || c.layers_per_block.size() < levels) return "";
  const std::string& kind = parts[2];
  if (parts[0] == "down_blocks") {
    int64_t start = 1;
    for (int64_t i = 0; i < b; ++i) start += c.layers_per_block[static_cast<size_t>(i)] + 1;
    const int64_t layers = c.layers_per_block[static_cast<size_t>(b)];
    if (kind == "resnets" && j < layers) {
      return with_inner("input_blocks." + std::to_string(start + j) + ".0", kind, 4);
    }
    if (kind == "attentions" && j < layers) {
      return with_inner("input_blocks." + std::to_string(start + j) + ".1", kind, 4);
    }
    if (kind == "downsamplers" && j == 0 && join_from(parts, 4) == "conv") {
      return "input_blocks." + std::to_string(start + layers) + ".0.op";
    }
    return "";
  }
  if (parts[0] == "up_blocks") {
    // Up block b mirrors down block (levels - 1 - b) and has one resnet more.
    int64_t start = 0;
    for (int64_t i = 0; i < b; ++i) {
      start += c.layers_per_block[levels - 1 - static_cast<size_t>(i)] + 1;
    }
    const int64_t resnets = c.layers_per_block[levels - 1 - static_cast<size_t>(b)] + 1;
    if (kind == "resnets" && j < resnets) {
      return with_inner("output_blocks." + std::to_string(start + j) + ".0", kind, 4);
    }
    if (kind == "attentions" && j < resnets) {
      return with_inner("output_blocks." + std::to_string(start + j) + ".1", kind, 4);
    }
    if (kind == "upsamplers" && j == 0 && join_from(parts, 4) == "conv") {
      const bool attn = static_cast<size_t>(b) < c.up_block_types.size() &&
                        has_attention(c.up_block_types[static_cast<size_t>(b)]);
      return "output_blocks." + std::to_string(start + resnets - 1) + (attn ? ".2" : ".1") +
             ".conv";
    }
  }
  return "";
}

std::map<std::string, std::string> sgm_aliases(const UNetConfig& config,
                                               const std::vector<std::string>& module_names) {
  std::map<std::string, std::string> out;
  for (const auto& m : module_names) {
    const std::string sgm = sgm_module_name(config, m);
    if (!sgm.empty()) out.emplace(sgm, m);
  }
  return out;
}

io::LoraWeights with_sgm_unet_names(const io::LoraWeights& lora, const UNetConfig& config) {
  io::LoraWeights out = lora;
  auto it = out.components.find("unet");
  if (it == out.components.end()) return out;
  for (auto& t : it->second) {
    if (!t.resolved) {
      throw Error("LoRA '" + lora.path + "': unet key '" + t.key +
                  "' is an unresolved kohya name; resolve it against the UNet first");
    }
    const std::string sgm = sgm_module_name(config, t.module);
    if (sgm.empty()) {
      throw Error("LoRA '" + lora.path + "': unet module '" + t.module +
                  "' has no name in kohya's SDXL (SGM) layout; write a Diffusers or PEFT file");
    }
    t.module = sgm;
  }
  return out;
}

}  // namespace difftrain::models
