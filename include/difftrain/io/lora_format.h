#pragma once
// LoRA files: the three safetensors key layouts in use for Stable Diffusion LoRAs, read into one
// canonical form (a list of low-rank updates W += scale * up @ down per module), and written back
// in any of them. Applying them to a model is models/lora.h. See docs/LORA.md.
// Each module is read in the convention of its own keys, so one file may mix them (as Diffusers'
// loader allows); r and alpha kept beside the weights are io/lora_adapter_config.h.
//
//   Diffusers  unet.<module>.lora.down.weight / .lora.up.weight   (save_lora_weights; alpha in
//              unet.<attn>.processor.to_q_lora.down.weight         lora_adapter_metadata, >= 0.33)
//   PEFT       unet.<module>.lora_A.weight / .lora_B.weight       (also lora_A.<adapter>.weight,
//              base_model.model.<module>.lora_A.weight)            alpha in adapter_config.json)
//   kohya      lora_unet_<module_with_underscores>.lora_down.weight / .lora_up.weight / .alpha

#include <torch/types.h>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace difftrain::io {

/// The key layout of a LoRA file.
enum class LoraFormat {
  kDiffusers,  ///< `<component>.<module>.lora.down.weight` (and the older `processor.to_q_lora`)
  kPeft,       ///< `<component>.<module>.lora_A.weight` / `lora_B.weight`
  kKohya,      ///< `lora_unet_<module_underscored>.lora_down.weight` / `lora_up.weight` / `alpha`
  /// ComfyUI / musubi-tuner: the denoiser's targets as `diffusion_model.<module>.lora_down.weight`
  /// / `.lora_up.weight` / `.alpha` (the module paths as given: a family whose ComfyUI names
  /// differ from Diffusers' renames them first), text encoders' as kohya's. Written only; a
  /// family's key layout reads such files (io::LoraKeyLayout).
  kComfyUI,
};

/// "diffusers", "peft", "kohya" or "comfyui".
std::string to_string(LoraFormat format);

/// "[4, 8] Float": a tensor's shape and dtype, as LoRA errors name them.
std::string shape_and_dtype(const torch::Tensor& t);

/// One low-rank update of one module's weight: W += scale() * up @ down (see models::lora_delta).
struct LoraTarget {
  /// The module's path inside its component, in Diffusers' dotted form
  /// ("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_out.0"). For a kohya file before
  /// resolve_kohya_names(), the raw underscore name ("down_blocks_0_..._to_out_0") instead.
  std::string module;
  /// False only for kohya names not yet resolved against a model's module names.
  bool resolved = true;
  /// The file's key stem this target came from (e.g. "lora_unet_..._to_q" or
  /// "unet.down_blocks....to_q.lora"), for error messages.
  std::string key;
  /// [r, in] for a Linear, [r, in, kh, kw] for a Conv2d; floating point, as stored in the file.
  torch::Tensor down;
  /// [out, r] for a Linear, [out, r, 1, 1] for a Conv2d; floating point, as stored in the file.
  torch::Tensor up;
  /// The alpha: the file's kohya `.alpha`, else the LoraConfig in the file's metadata or in
  /// adapter_config.json (io/lora_adapter_config.h), else the caller's (LoraReadOptions::alpha);
  /// none: scale 1.
  std::optional<double> alpha;
  /// The key convention this target's keys use (a file may use several, one per module).
  LoraFormat format = LoraFormat::kDiffusers;

  /// r, the number of rows of `down`.
  int64_t rank() const { return down.size(0); }
  /// alpha / r; 1 without an alpha, or when alpha is 0 (kohya's rule: alpha 0 means alpha = r).
  double scale() const;
};

/// A parsed LoRA file.
struct LoraWeights {
  /// The file it was read from (used in error messages).
  std::string path;
  /// The key convention of most targets (ties: Diffusers, then PEFT, then kohya); see `mixed`.
  LoraFormat format = LoraFormat::kDiffusers;
  /// True when the targets use more than one key convention (LoraTarget::format).
  bool mixed = false;
  /// Targets by pipeline component: "unet", "text_encoder", "text_encoder_2", ... (kohya
  /// lora_unet_ → "unet", lora_te_ / lora_te1_ → "text_encoder", lora_te2_ → "text_encoder_2").
  /// Targets of one component are sorted by module name. Keys with no component prefix are the
  /// UNet's, as Diffusers' load_attn_procs assumes (except PEFT `text_model.` ones).
  std::map<std::string, std::vector<LoraTarget>> components;
  /// Writing kohya keys: a lone CLIP text encoder as lora_te1_, not lora_te_ (sd-scripts'
  /// networks.lora_flux numbering, which Diffusers' FLUX loader requires). Set for FLUX.1 LoRAs
  /// (flux_lora_to_bfl); a file with a "transformer" component is written so too.
  bool kohya_numbered_text_encoders = false;

  /// The targets of `component`; empty if the file has none for it.
  const std::vector<LoraTarget>& targets(const std::string& component) const;
  /// Number of targets of `component`.
  size_t count(const std::string& component) const { return targets(component).size(); }
};

/// How a file's layout is named to users: "diffusers" for lora_A/lora_B keys under a component
/// prefix (transformer., unet., text_encoder.: what Diffusers' save_lora_weights writes today,
/// and difftrain's --lora_format diffusers export of FLUX.1), else to_string(lora.format), with
/// "mixed" appended when the targets use several conventions.
std::string format_label(const LoraWeights& lora);

/// Options of read_lora() / parse_lora().
struct LoraReadOptions {
  /// Alpha for targets the file gives none (no kohya `.alpha`, no `lora_adapter_metadata`, no
  /// adapter_config.json): scale = alpha / r. Must be finite and > 0. Whatever the file says
  /// wins. Default: none, scale 1 (Diffusers' behaviour for these files).
  std::optional<double> alpha;
  /// A PEFT adapter_config.json whose r / lora_alpha / rank_pattern / alpha_pattern apply to the
  /// Diffusers- and PEFT-keyed targets that the file's own metadata does not cover. Unset:
  /// read_lora() uses `adapter_config.json` in the LoRA file's folder when there is one, and
  /// parse_lora() none; "": none.
  std::optional<std::string> adapter_config;
};

/// Reads a LoRA safetensors file (io::load_safetensors) with its `__metadata__` and parses it
/// (parse_lora); `path` may also be a folder holding `adapter_model.safetensors` (PEFT's
/// save_pretrained) or `pytorch_lora_weights.safetensors`. Errors name the file and the
/// offending key; see docs/ERRORS.md, "LoRA files".
LoraWeights read_lora(const std::string& path, const LoraReadOptions& options = {});

/// Parses the tensors of a LoRA file already in memory; `path` is used in errors. Each key's
/// convention (Diffusers, PEFT, kohya) is detected from the key itself, so conventions may differ
/// from module to module. The alpha of each target: its kohya `.alpha`; else, for Diffusers and
/// PEFT keys, Diffusers' `lora_adapter_metadata` entry of `metadata` (the safetensors
/// `__metadata__`), else options.adapter_config, else options.alpha. Throws difftrain::Error when:
/// a key fits no known convention (LyCORIS LoHa/LoKr, DoRA, bias LoRA), the file holds no LoRA,
/// a down has no up (or the reverse, or an alpha has neither), a module's keys are in two
/// conventions or appear twice, down/up are not both 2-D or both 4-D with a 1x1 up, their ranks
/// differ, a weight is not floating point, an alpha is not a finite number of one element, or
/// the metadata / adapter config is not valid or gives a module another rank than its weights.
LoraWeights parse_lora(const std::map<std::string, torch::Tensor>& tensors, const std::string& path,
                       const LoraReadOptions& options = {},
                       const std::map<std::string, std::string>& metadata = {});

/// The kohya form of a dotted module path: "a.b_c.0" → "a_b_c_0".
std::string kohya_name(const std::string& module);

/// Resolves the kohya underscore names of `component`'s targets against `module_names` (the
/// target model's module paths in dotted form, e.g. every `<path>` of a `<path>.weight` parameter):
/// each unresolved target gets the one module whose kohya_name() equals its name. Resolved targets
/// are left alone, so this is a no-op for Diffusers and PEFT files. Throws difftrain::Error naming
/// the key when no module matches ("is this LoRA for a different model?"), when two modules
/// share the underscore form, or when the module also has Diffusers or PEFT keys in the file.
/// `aliases` maps other dotted names of modules (kohya SDXL's SGM paths, models/sgm_names.h) to
/// their paths in `module_names`; a kohya name matching an alias resolves to that module.
void resolve_kohya_names(LoraWeights& lora, const std::string& component,
                         const std::vector<std::string>& module_names,
                         const std::map<std::string, std::string>& aliases = {});

/// The tensors of a LoRA file in `format` holding `lora`, keyed as the tools of that format write
/// them; read back with parse_lora(), every target gives the same models::lora_delta() (up to one
/// rounding to the weights' dtype). Components are "unet", "text_encoder", "text_encoder_2",
/// "text_encoder_3" and "transformer".
///   kDiffusers  `<component>.<module>.lora.down.weight` / `.lora.up.weight` (Diffusers'
///               save_lora_weights; text encoders `.lora_linear_layer.down.weight`, as Diffusers).
///   kPeft       `<component>.<module>.lora_A.weight` / `.lora_B.weight`.
///   kKohya      `lora_unet_<kohya_name(module)>.lora_down.weight` / `.lora_up.weight` / `.alpha`
///               (a float32 scalar: the target's alpha, or r when it has none or 0, so
///               alpha / r is its scale()); text encoders `lora_te_`, or `lora_te1_` / `lora_te2_`
///               / `lora_te3_` when the LoRA has a second text encoder; transformer
///               `lora_transformer_`.
/// Diffusers and PEFT files store no alpha (PEFT keeps `lora_alpha` in adapter_config.json), so a
/// target whose scale() is not 1 is written with its scale folded into up: up * scale(), formed
/// in float64 and rounded once to up's dtype; it reads back with no alpha and scale 1.
/// Tensors keep their dtype and device and are made contiguous; unscaled ones share memory with
/// `lora`. Throws difftrain::Error naming the target when: `lora` has no targets, a component is
/// not one of the above, a target is an unresolved kohya name and `format` is not kKohya (resolve
/// it first with resolve_kohya_names), its module is empty, its down/up are not a LoRA pair that
/// parse_lora() accepts, its alpha is not finite (or, for kKohya, does not fit a float32), or two
/// targets would get the same key.
std::map<std::string, torch::Tensor> lora_to_tensors(const LoraWeights& lora, LoraFormat format);

/// Writes `lora` in `format` to the safetensors file `path`, atomically (io::save_safetensors),
/// with `metadata` plus {"format": "pt"} (safetensors' PyTorch tag, as Diffusers'
/// save_lora_weights writes; a "format" entry in `metadata` wins) as its `__metadata__`. The keys
/// are lora_to_tensors()'s, but r and alpha are kept as trained rather than folded into up:
///   kDiffusers  `__metadata__["lora_adapter_metadata"]`: each component's LoraConfig
///               (make_lora_adapter_config: r, lora_alpha, rank_pattern, alpha_pattern,
///               target_modules) under "<component>.<field>", as Diffusers >= 0.33 writes it.
///               Diffusers before 0.33 ignores it and applies scale 1.
///   kPeft       the same metadata entry, and `adapter_config.json` in the same folder (the
///               config of the "unet" or "transformer" targets, else of the first component;
///               replaced if present), as PEFT's save_pretrained writes it.
///   kKohya      `.alpha` per module (unchanged).
/// Read back with read_lora(), every target has its r and alpha. Diffusers:
/// `StableDiffusionPipeline.save_lora_weights(dir, unet_lora_layers=...,
/// unet_lora_adapter_metadata=...)` (kDiffusers), PEFT `save_pretrained` (kPeft), kohya
/// sd-scripts' `network.save_weights` (kKohya). Errors as lora_to_tensors, or the path's I/O
/// error.
void write_lora(const std::string& path, const LoraWeights& lora, LoraFormat format,
                const std::map<std::string, std::string>& metadata = {});

}  // namespace difftrain::io
