#include "difftrain/models/unets/unet_config.h"

#include "../json_fields.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include <algorithm>
#include <sstream>

namespace difftrain::models {
namespace {

using nlohmann::json;

using detail::JsonFields;
const auto join = &JsonFields::join;

// Reads config fields with one-line errors that name the file and the field.
using Reader = detail::JsonFields;

const std::vector<std::string> kDownBlocks = {"DownBlock2D", "AttnDownBlock2D",
                                              "CrossAttnDownBlock2D"};
const std::vector<std::string> kUpBlocks = {"UpBlock2D", "AttnUpBlock2D", "CrossAttnUpBlock2D"};
const std::vector<std::string> kActivations = {"silu", "swish", "mish", "gelu", "relu"};

// Diffusers' get_down_block/get_up_block accept a "UNetRes" prefix and drop it.
std::string strip_unetres(const std::string& type) {
  return type.rfind("UNetRes", 0) == 0 ? type.substr(7) : type;
}

// transformer_layers_per_block: an int, a list with an int per block, or a list of per-layer
// lists. Each entry is kept as a list; a one-element list means "every layer".
std::vector<std::vector<int64_t>> layer_lists(const Reader& r, const std::string& key, size_t n) {
  std::vector<std::vector<int64_t>> out;
  if (!r.has(key)) return std::vector<std::vector<int64_t>>(n, {1});
  const json& v = r.at(key);
  if (v.is_number()) return std::vector<std::vector<int64_t>>(n, {r.as_int(key, v)});
  if (!v.is_array() || v.size() != n) {
    r.fail(key, "must be an integer or a list with one entry per block (" + std::to_string(n) +
                    "), got " + v.dump());
  }
  for (const auto& e : v) {
    if (e.is_array()) {
      std::vector<int64_t> layers;
      for (const auto& x : e) layers.push_back(r.as_int(key, x));
      out.push_back(layers);
    } else {
      out.push_back({r.as_int(key, e)});
    }
  }
  return out;
}

}  // namespace

std::string UNetConfig::class_name() const {
  return kind == UNetKind::kUNet2D ? "UNet2DModel" : "UNet2DConditionModel";
}

UNetConfig UNetConfig::from_json(const nlohmann::json& j, const std::string& source) {
  if (!j.is_object()) throw Error(source + ": a UNet config must be a JSON object");
  Reader r(j, source);
  UNetConfig c;
  const std::string cls = r.string("_class_name", "UNet2DConditionModel");
  if (cls == "UNet2DModel") {
    c.kind = UNetKind::kUNet2D;
  } else if (cls == "UNet2DConditionModel") {
    c.kind = UNetKind::kUNet2DCondition;
  } else {
    r.fail("_class_name", "is \"" + cls + "\"; supported: UNet2DModel, UNet2DConditionModel");
  }
  const bool cond = c.kind == UNetKind::kUNet2DCondition;

  c.in_channels = r.integer("in_channels", cond ? 4 : 3);
  c.out_channels = r.integer("out_channels", cond ? 4 : 3);
  if (r.has("sample_size")) {
    const json& v = r.at("sample_size");
    if (v.is_number()) {
      int64_t s = r.as_int("sample_size", v);
      c.sample_size = {s, s};
    } else if (v.is_array() && v.size() == 2) {
      c.sample_size = {r.as_int("sample_size", v[0]), r.as_int("sample_size", v[1])};
    } else {
      r.fail("sample_size", "must be an integer or [height, width], got " + v.dump());
    }
  }
  c.center_input_sample = r.boolean("center_input_sample", false);
  c.flip_sin_to_cos = r.boolean("flip_sin_to_cos", true);
  c.freq_shift = r.number("freq_shift", 0);
  c.down_block_types =
      r.strings("down_block_types",
                cond ? std::vector<std::string>{"CrossAttnDownBlock2D", "CrossAttnDownBlock2D",
                                                "CrossAttnDownBlock2D", "DownBlock2D"}
                     : std::vector<std::string>{"DownBlock2D", "AttnDownBlock2D", "AttnDownBlock2D",
                                                "AttnDownBlock2D"});
  c.up_block_types = r.strings(
      "up_block_types", cond ? std::vector<std::string>{"UpBlock2D", "CrossAttnUpBlock2D",
                                                        "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"}
                             : std::vector<std::string>{"AttnUpBlock2D", "AttnUpBlock2D",
                                                        "AttnUpBlock2D", "UpBlock2D"});
  for (auto& t : c.down_block_types) {
    t = strip_unetres(t);
    if (std::find(kDownBlocks.begin(), kDownBlocks.end(), t) == kDownBlocks.end()) {
      r.fail("down_block_types", "has \"" + t + "\"; supported: " + join(kDownBlocks));
    }
    if (!cond && t == "CrossAttnDownBlock2D") {
      r.fail("down_block_types", "has CrossAttnDownBlock2D, which needs UNet2DConditionModel");
    }
  }
  for (auto& t : c.up_block_types) {
    t = strip_unetres(t);
    if (std::find(kUpBlocks.begin(), kUpBlocks.end(), t) == kUpBlocks.end()) {
      r.fail("up_block_types", "has \"" + t + "\"; supported: " + join(kUpBlocks));
    }
    if (!cond && t == "CrossAttnUpBlock2D") {
      r.fail("up_block_types", "has CrossAttnUpBlock2D, which needs UNet2DConditionModel");
    }
  }
  const size_t n = c.down_block_types.size();
  if (n == 0) r.fail("down_block_types", "must not be empty");
  if (c.up_block_types.size() != n) {
    r.fail("up_block_types", "must have as many entries as down_block_types (" + std::to_string(n) +
                                 "), got " + std::to_string(c.up_block_types.size()));
  }
  if (!r.has("block_out_channels")) {
    c.block_out_channels = cond ? std::vector<int64_t>{320, 640, 1280, 1280}
                                : std::vector<int64_t>{224, 448, 672, 896};
  } else {
    c.block_out_channels = r.per_block("block_out_channels", 0, r.at("block_out_channels").size());
  }
  if (c.block_out_channels.size() != n) {
    r.fail("block_out_channels", "must have one entry per down block (" + std::to_string(n) +
                                     "), got " + std::to_string(c.block_out_channels.size()));
  }
  for (int64_t ch : c.block_out_channels) {
    if (ch <= 0) r.fail("block_out_channels", "must be positive");
  }
  if (!cond && r.has("layers_per_block") && !r.at("layers_per_block").is_number()) {
    r.fail("layers_per_block", "must be an integer for UNet2DModel");
  }
  c.layers_per_block = r.per_block("layers_per_block", 2, n);
  for (int64_t l : c.layers_per_block) {
    if (l < 1) r.fail("layers_per_block", "must be >= 1");
  }
  c.downsample_padding = r.integer("downsample_padding", 1);
  c.mid_block_scale_factor = r.number("mid_block_scale_factor", 1);
  c.dropout = r.number("dropout", 0);
  c.act_fn = r.choice("act_fn", "silu", kActivations);
  c.norm_num_groups = r.opt_integer("norm_num_groups", 32);
  c.norm_eps = r.number("norm_eps", 1e-5);
  c.resnet_time_scale_shift =
      r.choice("resnet_time_scale_shift", "default", {"default", "scale_shift"});
  c.class_embed_type = r.opt_string("class_embed_type");
  c.num_class_embeds = r.opt_integer("num_class_embeds", std::nullopt);

  // attention_head_dim: int, null, or a per-block list (entries may be null).
  const json* ahd = j.contains("attention_head_dim") ? &j.at("attention_head_dim") : nullptr;
  if (ahd == nullptr) {
    c.attention_head_dim.assign(n, int64_t{8});
  } else if (ahd->is_null()) {
    c.attention_head_dim.assign(n, std::nullopt);
  } else if (ahd->is_number()) {
    c.attention_head_dim.assign(n, r.as_int("attention_head_dim", *ahd));
  } else if (ahd->is_array() && ahd->size() == n && cond) {
    for (const auto& e : *ahd) {
      c.attention_head_dim.push_back(
          e.is_null() ? std::nullopt : std::optional<int64_t>(r.as_int("attention_head_dim", e)));
    }
  } else {
    r.fail("attention_head_dim", cond ? "must be an integer or a list with one entry per block"
                                      : "must be an integer or null for UNet2DModel");
  }

  if (cond) {
    if (r.has("num_attention_heads")) {
      // Diffusers refuses it too: attention_head_dim carries the head count (a naming issue).
      r.fail("num_attention_heads",
             "is not supported by UNet2DConditionModel; set attention_head_dim (the number of "
             "heads, Diffusers' historical naming) instead");
    }
    for (size_t i = 0; i < n; ++i) {
      if (!c.attention_head_dim[i]) {
        r.fail("attention_head_dim", "must not be null for UNet2DConditionModel");
      }
      c.num_attention_heads.push_back(*c.attention_head_dim[i]);
      if (c.num_attention_heads.back() < 1) r.fail("attention_head_dim", "must be >= 1");
    }
    c.mid_block_type = j.contains("mid_block_type") && j.at("mid_block_type").is_null()
                           ? ""
                           : r.choice("mid_block_type", "UNetMidBlock2DCrossAttn",
                                      {"UNetMidBlock2DCrossAttn", "UNetMidBlock2D"});
    c.cross_attention_dim = r.per_block("cross_attention_dim", 1280, n);
    c.transformer_layers_per_block = layer_lists(r, "transformer_layers_per_block", n);
    if (r.has("reverse_transformer_layers_per_block")) {
      c.reverse_transformer_layers_per_block =
          layer_lists(r, "reverse_transformer_layers_per_block", n);
    } else {
      for (const auto& e : c.transformer_layers_per_block) {
        if (e.size() > 1 && r.has("transformer_layers_per_block") &&
            r.at("transformer_layers_per_block").is_array() &&
            r.at("transformer_layers_per_block")[0].is_array()) {
          r.fail("transformer_layers_per_block",
                 "is a list of lists; give reverse_transformer_layers_per_block too (as "
                 "Diffusers requires for asymmetric UNets)");
        }
      }
    }
    if (r.has("only_cross_attention") && r.at("only_cross_attention").is_array()) {
      const json& v = r.at("only_cross_attention");
      if (v.size() != n) r.fail("only_cross_attention", "must have one entry per down block");
      for (const auto& e : v) {
        if (!e.is_boolean()) r.fail("only_cross_attention", "must be true/false or a list of them");
        c.only_cross_attention.push_back(e.get<bool>());
      }
      c.mid_block_only_cross_attention = r.boolean("mid_block_only_cross_attention", false);
    } else {
      bool oca = r.boolean("only_cross_attention", false);
      c.only_cross_attention.assign(n, oca);
      c.mid_block_only_cross_attention = r.boolean("mid_block_only_cross_attention", oca);
    }
    c.use_linear_projection = r.boolean("use_linear_projection", false);
    c.upcast_attention = r.boolean("upcast_attention", false);
    c.resnet_skip_time_act = r.boolean("resnet_skip_time_act", false);
    c.resnet_out_scale_factor = r.number("resnet_out_scale_factor", 1.0);
    c.time_embedding_type =
        r.choice("time_embedding_type", "positional", {"positional", "fourier"});
    c.time_embedding_dim = r.opt_integer("time_embedding_dim", std::nullopt);
    c.time_embedding_act_fn = r.opt_string("time_embedding_act_fn");
    if (c.time_embedding_act_fn) r.choice("time_embedding_act_fn", "", kActivations);
    c.timestep_post_act = r.opt_string("timestep_post_act");
    if (c.timestep_post_act) r.choice("timestep_post_act", "", kActivations);
    c.time_cond_proj_dim = r.opt_integer("time_cond_proj_dim", std::nullopt);
    c.conv_in_kernel = r.integer("conv_in_kernel", 3);
    c.conv_out_kernel = r.integer("conv_out_kernel", 3);
    if (c.conv_in_kernel % 2 == 0 || c.conv_out_kernel % 2 == 0) {
      r.fail("conv_in_kernel", "and conv_out_kernel must be odd");
    }
    c.projection_class_embeddings_input_dim =
        r.opt_integer("projection_class_embeddings_input_dim", std::nullopt);
    c.class_embeddings_concat = r.boolean("class_embeddings_concat", false);
    if (c.class_embed_type) {
      r.choice("class_embed_type", "", {"timestep", "identity", "projection", "simple_projection"});
      if ((*c.class_embed_type == "projection" || *c.class_embed_type == "simple_projection") &&
          !c.projection_class_embeddings_input_dim) {
        r.fail("class_embed_type",
               "\"" + *c.class_embed_type + "\" needs projection_class_embeddings_input_dim");
      }
    }
    // SDXL's added conditioning; the other kinds (Kandinsky's "text", "image", ...) are not built.
    c.addition_embed_type = r.opt_string("addition_embed_type");
    if (c.addition_embed_type) {
      r.choice("addition_embed_type", "", {"text_time"});
      c.addition_time_embed_dim = r.opt_integer("addition_time_embed_dim", std::nullopt);
      if (!c.addition_time_embed_dim || *c.addition_time_embed_dim <= 0) {
        r.fail("addition_time_embed_dim",
               "must be a positive integer for addition_embed_type "
               "\"text_time\"");
      }
      if (*c.addition_time_embed_dim % 2 != 0) {
        r.fail("addition_time_embed_dim", "must be even (sinusoidal embedding)");
      }
      if (!c.projection_class_embeddings_input_dim ||
          *c.projection_class_embeddings_input_dim <= 0) {
        r.fail("projection_class_embeddings_input_dim",
               "must be a positive integer for addition_embed_type \"text_time\" (the width of "
               "cat(text_embeds, time_ids embedding), 2816 for SDXL)");
      }
    }
    if (r.has("encoder_hid_dim") || r.has("encoder_hid_dim_type")) {
      r.fail("encoder_hid_dim", "is set; supported: null (no encoder projection)");
    }
    if (r.boolean("dual_cross_attention", false)) {
      r.fail("dual_cross_attention", "is true; supported: false");
    }
    r.choice("attention_type", "default", {"default"});
    if (r.has("cross_attention_norm")) {
      r.fail("cross_attention_norm", "is set; supported: null");
    }
  } else {
    c.mid_block_type = "UNetMidBlock2D";
    c.downsample_type = r.choice("downsample_type", "conv", {"conv", "resnet"});
    c.upsample_type = r.choice("upsample_type", "conv", {"conv", "resnet"});
    c.add_attention = r.boolean("add_attention", true);
    c.attn_norm_num_groups = r.opt_integer("attn_norm_num_groups", std::nullopt);
    c.num_train_timesteps = r.opt_integer("num_train_timesteps", std::nullopt);
    c.time_embedding_type =
        r.choice("time_embedding_type", "positional", {"positional", "fourier", "learned"});
    if (c.time_embedding_type == "learned" && !c.num_train_timesteps) {
      r.fail("time_embedding_type", "\"learned\" needs num_train_timesteps");
    }
    if (c.class_embed_type) r.choice("class_embed_type", "", {"timestep", "identity"});
    if (r.boolean("attention_legacy_order", false)) {
      r.fail("attention_legacy_order", "is true; supported: false");
    }
  }
  if (c.norm_num_groups && *c.norm_num_groups <= 0) r.fail("norm_num_groups", "must be positive");
  if (c.norm_num_groups) {
    for (int64_t ch : c.block_out_channels) {
      if (ch % *c.norm_num_groups != 0) {
        r.fail("norm_num_groups", "(" + std::to_string(*c.norm_num_groups) +
                                      ") must divide every block_out_channels entry (" +
                                      std::to_string(ch) + ")");
      }
    }
  }
  if (c.num_class_embeds && *c.num_class_embeds <= 0)
    r.fail("num_class_embeds", "must be positive");

  c.raw = j;
  c.raw["_class_name"] = c.class_name();
  return c;
}

UNetConfig UNetConfig::load(const std::string& path) { return parse(io::read_file(path), path); }

UNetConfig UNetConfig::parse(const std::string& json_text, const std::string& source) {
  json j;
  try {
    j = json::parse(json_text);
  } catch (const json::exception& e) {  // parse_error, or out_of_range for 1e999
    throw Error(source + ": not valid JSON (" + std::string(e.what()) +
                "); expected a Diffusers UNet config.json");
  }
  return from_json(j, source);
}

nlohmann::json UNetConfig::to_json() const {
  json j = raw;
  j["_class_name"] = class_name();
  if (!j.contains("_diffusers_version")) j["_diffusers_version"] = "0.31.0";
  return j;
}

}  // namespace difftrain::models
