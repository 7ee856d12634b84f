#pragma once
// Applying a LoRA file to a model for inference: each target's low-rank update is folded into
// the module's weight (Diffusers' `pipe.load_lora_weights(...)` + `pipe.fuse_lora(lora_scale)`).
// Reading the files is io/lora_format.h; training LoRA adapters is not here. See docs/LORA.md.

#include "difftrain/io/lora_format.h"

#include <torch/nn/module.h>

#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::models {

/// The weight update of one target, float32 (float64 if the LoRA is float64):
/// lora_scale * target.scale() * up @ down, where target.scale() is alpha / r or 1.
/// Linear: down [r, in], up [out, r] → [out, in]. Conv2d: down [r, in, kh, kw], up [out, r, 1, 1]
/// → (up.flatten(1) @ down.flatten(1)) viewed as [out, in, kh, kw].
torch::Tensor lora_delta(const io::LoraTarget& target, double lora_scale = 1.0);

/// The module paths of `model` that own a parameter named `weight`, in dotted form
/// ("down_blocks.0.attentions.0.transformer_blocks.0.attn1.to_q"): what LoRA targets can name,
/// and what merge_lora resolves kohya names against.
std::vector<std::string> lora_module_names(const torch::nn::Module& model);

/// What merge_lora did.
struct LoraMergeSummary {
  /// Modules whose weight was changed (one per target of the component).
  int64_t modules_merged = 0;
  /// Targets in the file for other components (e.g. text encoders), not applied; warn about them.
  int64_t other_component_targets = 0;
};

/// Adds lora_delta(target, lora_scale) to `<target.module>.weight` of `model` for every target of
/// `component` in `lora` (Diffusers: `fuse_lora(lora_scale=...)`; lora_scale is the
/// `cross_attention_kwargs={"scale": s}` of unfused inference, 1 by default). kohya names are
/// resolved against lora_module_names(model) first. The sum is formed in float32 (or the weight's
/// dtype if wider) and cast back once, on the weight's device, under NoGradGuard. A Linear
/// weight [out, in] also takes a 1x1-conv delta [out, in, 1, 1] and vice versa.
/// Everything is checked before any weight changes, so on error the model is untouched: a target
/// naming a module the model lacks, or a delta whose shape differs from the weight's, throws a
/// difftrain::Error naming the file, the module and both shapes. A negative lora_scale undoes an
/// earlier merge (up to rounding).
LoraMergeSummary merge_lora(torch::nn::Module& model, const io::LoraWeights& lora,
                            double lora_scale = 1.0, const std::string& component = "unet");

}  // namespace difftrain::models
