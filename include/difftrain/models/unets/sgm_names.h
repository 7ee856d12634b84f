#pragma once
// The module names of Stability's original ("SGM", generative-models) UNet layout, which kohya's
// sd-scripts uses for SDXL LoRA keys (`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`)
// and Diffusers' loader maps back (`_maybe_map_sgm_blocks_to_diffusers`, `_convert_unet_lora_key`).
// Both directions follow one table built from a UNet config:
//
//   Diffusers                                SGM (layers_per_block L_b of down block b)
//   conv_in                                  input_blocks.0.0
//   time_embedding.linear_1 / linear_2       time_embed.0 / time_embed.2
//   add_embedding.linear_1 / linear_2        label_emb.0.0 / label_emb.0.2
//   down_blocks.b.resnets.j.*                input_blocks.(s_b + j).0.*   s_b = 1 + sum_{c<b} (L_c
//   + 1) down_blocks.b.attentions.j.*             input_blocks.(s_b + j).1.*
//   down_blocks.b.downsamplers.0.conv        input_blocks.(s_b + L_b).0.op
//   mid_block.resnets.0 / attentions.0 / resnets.1   middle_block.0 / .1 / .2
//   up_blocks.b.resnets.j.*                  output_blocks.(u_b + j).0.*  u_b = sum_{c<b} (n_c),
//   n_c up_blocks.b.attentions.j.*               output_blocks.(u_b + j).1.*  the block's resnets
//   up_blocks.b.upsamplers.0.conv            output_blocks.(u_b + n_b - 1).(2 with attention, else
//   1).conv conv_norm_out / conv_out                 out.0 / out.2 inside a resnet: norm1
//   in_layers.0, conv1 in_layers.2, time_emb_proj emb_layers.1, norm2 out_layers.0, conv2
//   out_layers.3, conv_shortcut skip_connection; attention blocks keep their names (proj_in,
//   transformer_blocks.k.attn1.to_q, ff.net.0.proj, ...).

#include "difftrain/io/lora_format.h"
#include "difftrain/models/unets/unet_config.h"

#include <map>
#include <string>

namespace difftrain::models {

/// The SGM dotted path of the Diffusers module path `module` of a UNet2DConditionModel with
/// config `config`, or "" when the module has no SGM counterpart in the table above.
std::string sgm_module_name(const UNetConfig& config, const std::string& module);

/// SGM path -> Diffusers path for every module of `module_names` that has one (the aliases
/// io::resolve_kohya_names takes so kohya SDXL keys resolve).
std::map<std::string, std::string> sgm_aliases(const UNetConfig& config,
                                               const std::vector<std::string>& module_names);

/// A copy of `lora` whose "unet" targets name SGM paths (for writing kohya's SDXL layout with
/// io::write_lora); other components are unchanged. Throws difftrain::Error naming a target whose
/// module has no SGM counterpart.
io::LoraWeights with_sgm_unet_names(const io::LoraWeights& lora, const UNetConfig& config);

}  // namespace difftrain::models
