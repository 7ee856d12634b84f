#pragma once
// The `config.json` of a Diffusers UNet (UNet2DModel or UNet2DConditionModel, Diffusers 0.31), read
// into one struct with every per-block list already expanded, Diffusers' default for each missing
// field, and the JSON kept so a saved model writes back what it read.

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::models {

/// Which Diffusers class a config describes (`_class_name`).
enum class UNetKind { kUNet2D, kUNet2DCondition };

/// A UNet's configuration. Field names and meanings are Diffusers' (see UNet2DModel /
/// UNet2DConditionModel __init__); lists that Diffusers accepts as "int or per-block list" are
/// stored expanded to one entry per down block, in down-block order.
struct UNetConfig {
  UNetKind kind = UNetKind::kUNet2DCondition;
  int64_t in_channels = 4;
  int64_t out_channels = 4;
  /// [H, W], empty when the config has null.
  std::vector<int64_t> sample_size;
  bool center_input_sample = false;
  bool flip_sin_to_cos = true;
  double freq_shift = 0;
  std::vector<std::string> down_block_types;
  std::vector<std::string> up_block_types;
  /// "UNetMidBlock2D", "UNetMidBlock2DCrossAttn", or "" for no middle block (null).
  std::string mid_block_type;
  std::vector<int64_t> block_out_channels;
  std::vector<int64_t> layers_per_block;
  int64_t downsample_padding = 1;
  double mid_block_scale_factor = 1;
  double dropout = 0;
  std::string act_fn = "silu";
  /// Groups of every GroupNorm; nullopt (null) means no output norm (condition model) or
  /// min(channels / 4, 32) (UNet2DModel's output norm).
  std::optional<int64_t> norm_num_groups = 32;
  double norm_eps = 1e-5;
  /// Per down block; nullopt means "the block's channel count" (one head).
  std::vector<std::optional<int64_t>> attention_head_dim;
  /// Per down block (condition model): the number of heads; Diffusers takes it from
  /// attention_head_dim (its historical naming).
  std::vector<int64_t> num_attention_heads;
  std::vector<int64_t> cross_attention_dim;
  /// Per down block, transformer layers of each resnet/attention pair.
  std::vector<std::vector<int64_t>> transformer_layers_per_block;
  /// Per up block, when the config gives reverse_transformer_layers_per_block.
  std::vector<std::vector<int64_t>> reverse_transformer_layers_per_block;
  std::vector<bool> only_cross_attention;
  bool mid_block_only_cross_attention = false;
  bool use_linear_projection = false;
  bool upcast_attention = false;
  /// "default" (add the time embedding) or "scale_shift" (FiLM after the second norm).
  std::string resnet_time_scale_shift = "default";
  bool resnet_skip_time_act = false;
  double resnet_out_scale_factor = 1.0;
  /// "positional", "fourier" (both models) or "learned" (UNet2DModel).
  std::string time_embedding_type = "positional";
  std::optional<int64_t> time_embedding_dim;
  std::optional<std::string> time_embedding_act_fn;
  std::optional<std::string> timestep_post_act;
  std::optional<int64_t> time_cond_proj_dim;
  int64_t conv_in_kernel = 3;
  int64_t conv_out_kernel = 3;
  /// null, "timestep", "identity", "projection" or "simple_projection".
  std::optional<std::string> class_embed_type;
  std::optional<int64_t> num_class_embeds;
  std::optional<int64_t> projection_class_embeddings_input_dim;
  bool class_embeddings_concat = false;
  /// null or "text_time" (SDXL: add_embedding(cat(text_embeds, sinusoid(time_ids))) is added to
  /// the timestep embedding).
  std::optional<std::string> addition_embed_type;
  /// Width of each time id's sinusoidal embedding (256 for SDXL).
  std::optional<int64_t> addition_time_embed_dim;
  // UNet2DModel only.
  std::string downsample_type = "conv";  ///< "conv" or "resnet"
  std::string upsample_type = "conv";    ///< "conv" or "resnet"
  bool add_attention = true;
  std::optional<int64_t> attn_norm_num_groups;
  std::optional<int64_t> num_train_timesteps;

  /// The JSON this config was read from, with `_class_name` set; to_json() returns it.
  nlohmann::json raw;

  /// Reads a Diffusers UNet config. Missing fields take Diffusers' defaults for the class named by
  /// `_class_name` (UNet2DModel or UNet2DConditionModel); unknown fields are ignored, as Diffusers
  /// does; unsupported values (a block type, an SDXL addition embedding, dual cross-attention...)
  /// throw difftrain::Error naming `source`, the field, the value and the supported values.
  static UNetConfig from_json(const nlohmann::json& json, const std::string& source);
  /// Reads and parses `path` (a config.json).
  static UNetConfig load(const std::string& path);
  /// from_json() of config.json text already in memory; `source` names it in errors.
  static UNetConfig parse(const std::string& json_text, const std::string& source);
  /// The config.json Diffusers' from_pretrained reads back (`_diffusers_version` included).
  nlohmann::json to_json() const;
  /// "UNet2DModel" or "UNet2DConditionModel".
  std::string class_name() const;
};

}  // namespace difftrain::models
