#include "difftrain/models/lora/lora.h"

#include "difftrain/models/unets/sgm_names.h"
#include "difftrain/models/unets/unet.h"

#include "difftrain/core/error.h"

#include <torch/torch.h>

#include <cmath>
#include <sstream>

namespace difftrain::models {
namespace {

std::string shape_str(at::IntArrayRef sizes) {
  std::ostringstream out;
  out << sizes;
  return out.str();
}

// [out, in] or [out, in, kh, kw]: the shape lora_delta() returns, without computing it.
std::vector<int64_t> delta_shape(const io::LoraTarget& t) {
  if (t.down.dim() == 2) return {t.up.size(0), t.down.size(1)};
  return {t.up.size(0), t.down.size(1), t.down.size(2), t.down.size(3)};
}

// A Linear [out, in] and a 1x1 Conv2d [out, in, 1, 1] are the same map; LoRAs trained on one
// apply to the other (SD's proj_in / proj_out are either, by use_linear_projection).
bool same_up_to_1x1(at::IntArrayRef a, at::IntArrayRef b) {
  if (a.size() == 4 && b.size() == 2) std::swap(a, b);
  return a.size() == 2 && b.size() == 4 && b[2] == 1 && b[3] == 1 && a[0] == b[0] && a[1] == b[1];
}

}  // namespace

torch::Tensor lora_delta(const io::LoraTarget& target, double lora_scale) {
  const bool f64 =
      target.down.scalar_type() == torch::kFloat64 || target.up.scalar_type() == torch::kFloat64;
  const auto dtype = f64 ? torch::kFloat64 : torch::kFloat32;
  const auto down = target.down.to(dtype);
  const auto up = target.up.to(dtype).to(down.device());
  const double scale = lora_scale * target.scale();
  // up [out, r] @ down [r, in]; a conv's down [r, in, kh, kw] flattens to [r, in*kh*kw].
  auto delta = torch::mm(up.flatten(1), down.flatten(1)).mul_(scale);
  return delta.view(delta_shape(target));
}

std::vector<std::string> lora_module_names(const torch::nn::Module& model) {
  static const std::string kWeight = ".weight";
  std::vector<std::string> names;
  for (const auto& p : model.named_parameters(/*recurse=*/true)) {
    const std::string& key = p.key();
    if (key.size() > kWeight.size() &&
        key.compare(key.size() - kWeight.size(), kWeight.size(), kWeight) == 0) {
      names.push_back(key.substr(0, key.size() - kWeight.size()));
    }
  }
  return names;
}

LoraMergeSummary merge_lora(torch::nn::Module& model, const io::LoraWeights& lora,
                            double lora_scale, const std::string& component) {
  if (!std::isfinite(lora_scale)) {
    throw Error("merge_lora: lora_scale is " + std::to_string(lora_scale) +
                ": it must be a finite number (1 applies the LoRA as trained)");
  }
  LoraMergeSummary summary;
  for (const auto& [name, targets] : lora.components) {
    if (name != component) summary.other_component_targets += static_cast<int64_t>(targets.size());
  }

  // kohya names become module paths only against this model's names; resolve on a copy (the
  // tensors are shared, not copied).
  const io::LoraWeights* source = &lora;
  io::LoraWeights resolved;
  for (const auto& t : lora.targets(component)) {
    if (t.resolved) continue;
    resolved = lora;
    const auto names = lora_module_names(model);
    // kohya's SDXL files name UNet modules in Stability's SGM layout.
    const auto* unet = dynamic_cast<const UNetImpl*>(&model);
    io::resolve_kohya_names(resolved, component, names,
                            unet != nullptr ? sgm_aliases(unet->config(), names)
                                            : std::map<std::string, std::string>{});
    source = &resolved;
    break;
  }
  const auto& targets = source->targets(component);

  // Check every target before changing any weight, so a bad file leaves the model untouched.
  auto params = model.named_parameters(/*recurse=*/true);
  std::vector<torch::Tensor> weights;
  weights.reserve(targets.size());
  for (const auto& t : targets) {
    const std::string name = t.module + ".weight";
    const torch::Tensor* weight = params.find(name);
    if (weight == nullptr) {
      throw Error("LoRA file '" + lora.path + "': " + component + " module '" + t.module +
                  "' (key '" + t.key + "') is not in the model: it has no parameter '" + name +
                  "'; is this LoRA for a different model?");
    }
    const auto shape = delta_shape(t);
    if (weight->sizes() != at::IntArrayRef(shape) && !same_up_to_1x1(weight->sizes(), shape)) {
      throw Error("LoRA file '" + lora.path + "': the update of module '" + t.module + "' (key '" +
                  t.key + "') is " + shape_str(shape) + " but the model's '" + name + "' is " +
                  shape_str(weight->sizes()) +
                  "; is this LoRA for a different model configuration?");
    }
    if (!torch::isFloatingType(weight->scalar_type())) {
      throw Error("LoRA file '" + lora.path + "': the model's '" + name + "' is " +
                  c10::toString(weight->scalar_type()) +
                  ", not floating point; merge LoRAs into float weights before quantizing");
    }
    weights.push_back(*weight);
  }

  torch::NoGradGuard no_grad;
  for (size_t i = 0; i < targets.size(); ++i) {
    auto& w = weights[i];
    // One rounding to the weight's dtype: the sum is formed in float32 (or wider).
    const auto dtype = torch::promote_types(torch::kFloat32, w.scalar_type());
    const auto delta = lora_delta(targets[i], lora_scale).to(w.device(), dtype).view(w.sizes());
    if (w.scalar_type() == dtype) {
      w.add_(delta);
    } else {
      w.copy_(w.to(dtype).add_(delta));
    }
  }
  summary.modules_merged = static_cast<int64_t>(targets.size());
  return summary;
}

}  // namespace difftrain::models
