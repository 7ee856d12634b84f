#pragma once
// What model families add to the generic LoRA file machinery (lora_format.h: Diffusers, PEFT,
// kohya): the pipeline components a file's dotted keys may start with, and key layouts of their
// own (FLUX.1's ComfyUI and XLabs keys), rewritten into a generic layout before parse_lora()
// reads them. A family registers them once (families::register_family does it from
// ModelFamily::lora_components() and ModelFamily::lora_key_layouts()).
#include <torch/types.h>

#include <functional>
#include <map>
#include <string>
#include <vector>

namespace difftrain::io {

/// A family's own key layout of LoRA files.
struct LoraKeyLayout {
  std::string name;  ///< for messages, e.g. "ComfyUI"
  /// Whether a file's tensors are in this layout (from their keys).
  std::function<bool(const std::map<std::string, torch::Tensor>&)> matches;
  /// The same tensors under keys parse_lora() reads (Diffusers, PEFT or kohya form).
  std::function<std::map<std::string, torch::Tensor>(const std::map<std::string, torch::Tensor>&)>
      normalize;
};

/// Adds `layout` (read_lora() tries each registered layout in order; the first that matches
/// rewrites the keys).
void register_lora_key_layout(LoraKeyLayout layout);
/// The registered layouts.
std::vector<LoraKeyLayout> lora_key_layouts();
/// `tensors` rewritten by the first registered layout that matches them, else unchanged.
std::map<std::string, torch::Tensor> normalize_lora_keys(
    const std::map<std::string, torch::Tensor>& tensors);

/// Adds a pipeline component a LoRA file's dotted keys (`<component>.<module>...`) and its
/// metadata may name, e.g. "transformer" (Diffusers' component folder names). Registering one
/// twice is harmless.
void register_lora_component(const std::string& component);
/// The registered components. kohya keys `lora_<component>_<module>` name them (besides
/// kohya's numbered text encoders, `lora_te_` / `lora_te<N>_`).
std::vector<std::string> lora_components();
/// Declares the component whose modules Diffusers' oldest LoRA layout names bare (dotted keys
/// without a registered component ahead, and the attention-processor keys); the first one
/// declared wins (a family's ModelFamily::lora_bare_component()).
void register_lora_bare_component(const std::string& component);
/// That component ("" = none declared: such keys are not read as LoRA keys).
std::string lora_bare_component();
/// Whether `component` is registered.
bool is_lora_component(const std::string& component);

}  // namespace difftrain::io
