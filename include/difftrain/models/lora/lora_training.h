#pragma once
// Training LoRA adapters on a model (PEFT's `inject_adapter_in_model` / Diffusers'
// `unet.add_adapter(LoraConfig(...))`): trainable low-rank adapters attached to the model's
// models::Linear / models::Conv2d layers, held in one container module that is what gets
// prepared, optimised, synchronised and checkpointed — the base model stays frozen. Exporting
// gives io::LoraWeights for io::write_lora. See docs/LORA.md.
#include "difftrain/io/lora_format.h"
#include "difftrain/models/linear.h"

#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include <string>
#include <vector>

namespace difftrain::models {

/// Which layers get adapters, and how (PEFT's `LoraConfig`; Diffusers' train_text_to_image_lora.py
/// uses r = alpha = --rank, target_modules to_k, to_q, to_v, to_out.0, no dropout).
struct LoraConfig {
  /// r (PEFT `r`, the scripts' --rank).
  int64_t rank = 4;
  /// alpha (PEFT `lora_alpha`); the update is scaled by alpha / rank.
  double alpha = 4.0;
  /// PEFT `lora_dropout`.
  double dropout = 0.0;
  /// A layer is targeted when its dotted name equals an entry or ends with "." + entry (PEFT's
  /// rule for a list), e.g. "to_q" or "attn1.to_out.0".
  std::vector<std::string> target_modules = {"to_q", "to_k", "to_v", "to_out.0"};
  /// Layers under these dotted prefixes get no adapter even when targeted (e.g. the encoder
  /// layers after the one SDXL's prompt embedding is taken from, which the loss never reaches).
  std::vector<std::string> exclude_prefixes;
};

/// The adapters of one model. Construction freezes nothing and changes no weight: it attaches a
/// fresh adapter (B = 0) to every targeted layer, so the model's output is unchanged until
/// training moves B. Registered children are named by the layer's dotted path with "." replaced
/// by "/" (LibTorch forbids dots), so parameters read "<path with />.lora_A.weight".
/// Destruction does not detach: call detach() to return the model to its plain form.
class LoraLayersImpl : public torch::nn::Module {
 public:
  /// Throws difftrain::Error when the config is invalid, a target matches no layer (naming it and
  /// a few layer names), or a targeted layer is not a models::Linear / models::Conv2d.
  LoraLayersImpl(torch::nn::Module& model, const LoraConfig& config);

  /// Dotted names of the adapted layers, sorted.
  const std::vector<std::string>& module_names() const { return names_; }
  const LoraConfig& config() const { return config_; }
  /// The adapter of layer `name` (dotted); throws when there is none.
  LoraAdapter adapter(const std::string& name) const;

  /// The adapters as a LoRA file's contents (component -> targets with down, up and alpha =
  /// LoraConfig::alpha): float32 copies on the CPU, so io::write_lora can write them in any
  /// layout, keeping r and alpha (adapter_config.json / lora_adapter_metadata / kohya .alpha).
  io::LoraWeights to_lora_weights(const std::string& component = "unet") const;

  /// Removes the adapters from the model's layers.
  void detach();

 private:
  LoraConfig config_;
  std::vector<std::string> names_;
  std::vector<std::shared_ptr<torch::nn::Module>> layers_;
};
TORCH_MODULE(LoraLayers);

/// Whether `name` (a dotted layer name) is targeted by `targets` (PEFT's list rule).
bool lora_target_matches(const std::string& name, const std::vector<std::string>& targets);

}  // namespace difftrain::models
