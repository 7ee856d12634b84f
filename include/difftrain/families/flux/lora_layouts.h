#pragma once
// FLUX.1 LoRA files in the layouts people trade them in, turned into Diffusers module targets of
// FluxTransformer2DModel (component "transformer") and CLIP (component "text_encoder"):
//   Diffusers / PEFT   transformer.<module>.lora_A/lora_B (+ optional <prefix>.<module>.alpha)
//   kohya / BFL        lora_unet_<BFL module with _>.lora_down/.lora_up/.alpha, lora_te1_ CLIP
//                      (sd-scripts' networks.lora_flux)
//   ComfyUI            diffusion_model.<BFL module>.lora_down/lora_up/alpha (or lora_A/lora_B)
//   XLabs              <double|single>_blocks.<i>.processor.{qkv,proj}_lora[12].down/up
// BFL fuses modules Diffusers keeps apart: a double block's img_attn.qkv is to_q/to_k/to_v, a
// single block's linear1 is to_q/to_k/to_v/proj_mlp. A fused LoRA is split by rows of its up;
// one whose up is block-diagonal (sd-scripts' split_qkv) becomes one LoRA per part, each with
// scale alpha / (stacked rank). The sizes come from the model (FluxLoraDims), so any width and
// depth converts, also linear1 (which Diffusers 0.31 converts at FLUX.1's width only).

#include "difftrain/io/lora_format.h"
#include "difftrain/io/lora_layout.h"

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace difftrain::families::flux {

/// The transformer's LoRA targets of Diffusers' train_dreambooth_lora_flux.py (HEAD) default
/// --lora_layers, matched by suffix (PEFT's rule): every attention projection of both block kinds
/// and the double blocks' feed-forwards. The trainer's default, and the benchmarks'.
inline const std::vector<std::string>& diffusers_flux_lora_targets() {
  static const std::vector<std::string> targets = {"attn.to_k",
                                                   "attn.to_q",
                                                   "attn.to_v",
                                                   "attn.to_out.0",
                                                   "attn.add_k_proj",
                                                   "attn.add_q_proj",
                                                   "attn.add_v_proj",
                                                   "attn.to_add_out",
                                                   "ff.net.0.proj",
                                                   "ff.net.2",
                                                   "ff_context.net.0.proj",
                                                   "ff_context.net.2"};
  return targets;
}

/// The sizes of the FluxTransformer2DModel a LoRA is for.
struct FluxLoraDims {
  int64_t double_blocks = 19;  ///< num_layers
  int64_t single_blocks = 38;  ///< num_single_layers
  int64_t inner_dim = 3072;    ///< D = num_attention_heads · attention_head_dim
  int64_t mlp_dim = 12288;     ///< the single blocks' proj_mlp width (4·D)
};

/// Whether `tensors` hold FLUX LoRA keys in a BFL layout (kohya lora_unet_double_blocks_ /
/// single_blocks_, ComfyUI diffusion_model.double_blocks., XLabs .processor.).
bool is_bfl_flux_lora(const std::map<std::string, torch::Tensor>& tensors);

/// Rewrites ComfyUI and XLabs keys into the kohya form (`lora_unet_<BFL name with _>.lora_down.
/// weight`, `.lora_up.weight`, `.alpha`) so parse_lora() reads them; other keys are kept. XLabs
/// files store no alpha: their targets get alpha = rank (scale 1), as Diffusers loads them.
std::map<std::string, torch::Tensor> normalize_flux_lora_keys(
    const std::map<std::string, torch::Tensor>& tensors);

/// Moves the "unet" component's kohya BFL targets (double_blocks_<i>_..., single_blocks_<i>_...,
/// final_layer_..., img_in, txt_in, time_in_..., vector_in_..., guidance_in_...) to component
/// "transformer" as Diffusers modules, splitting fused ones by rows (dense: every part keeps the
/// down and alpha; block-diagonal: one rank-r/n LoRA per part, alpha / n). BFL's final
/// adaLN_modulation (shift, scale) becomes norm_out.linear (scale, shift). A kohya target
/// without `.alpha` gets alpha = rank (scale 1; Diffusers 0.31 refuses such files). Throws
/// difftrain::Error naming the key for a block beyond `dims`, an up whose rows do not fit the
/// fused module, or a name that is no FLUX module.
void convert_flux_lora(io::LoraWeights& lora, const FluxLoraDims& dims);

/// read_lora() of a FLUX file in any of the layouts above, converted (convert_flux_lora).
io::LoraWeights read_flux_lora(const std::string& path, const FluxLoraDims& dims,
                               const io::LoraReadOptions& options = {});

/// The inverse of convert_flux_lora for writing kohya / BFL files: the "transformer" targets of
/// `lora` become kohya underscore BFL names of component "unet" (write_lora(kKohya) then writes
/// `lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight`...). Parts of one fused BFL module
/// (to_q/to_k/to_v, add_*_proj, a single block's to_q/to_k/to_v/proj_mlp) are stacked
/// block-diagonally as sd-scripts' split_qkv writes them: each part padded with zeros to the
/// largest rank c, a missing part all zeros, alpha = s · n·c when every part has scale s, else
/// each part's scale folded into its up and alpha = n·c. norm_out.linear gets BFL's (shift,
/// scale) order. Every module's delta is unchanged (up to rounding); convert_flux_lora reads it
/// back. Other components are kept. Throws difftrain::Error for a transformer module with no BFL
/// name. `mlp_dim` is the single blocks' proj_mlp width (FluxLoraDims::mlp_dim), which a
/// linear1 whose proj_mlp part is missing (Diffusers' default targets) needs for its zero rows;
/// 0 = unknown (such a LoRA is then refused, naming the module).
io::LoraWeights flux_lora_to_bfl(const io::LoraWeights& lora, int64_t mlp_dim = 0);

/// The ComfyUI and XLabs FLUX.1 key layouts as an io::LoraKeyLayout (is_bfl_flux_lora,
/// normalize_flux_lora_keys), which the FLUX.1 family registers so io::read_lora() takes them.
io::LoraKeyLayout flux_lora_key_layout();

}  // namespace difftrain::families::flux
