// `difftrain forward` for Z-Image: one ZImageTransformer2DModel forward on Diffusers' list
// arguments read by name (x.<i> [C, F, H, W], t [B], cap_feats.<i> [L_i, D]), giving out.<i>, to
// compare a checkpoint with Diffusers' `transformer(x, t, cap_feats)` number for number.
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/family.h"
#include "difftrain/models/lora/lora.h"
#include "z_image_pipeline.h"

#include <fmt/format.h>
#include <torch/torch.h>

namespace difftrain::families::z_image {

namespace {

constexpr const char* kInputs =
    "ZImageTransformer2DModel takes x.<i> [C, F, H, W] and cap_feats.<i> [L_i, cap_feat_dim] per "
    "sample (i from 0) and t [B]";

torch::Tensor float_input(const std::string& source, const std::string& name,
                          const torch::Tensor& t) {
  if (!t.is_floating_point()) {
    throw Error(fmt::format("{}: '{}' is {}; expected a floating-point tensor", source, name,
                            c10::toString(t.scalar_type())));
  }
  return t.to(torch::kFloat32);
}

}  // namespace

std::map<std::string, torch::Tensor> forward_z_image(
    const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
    const std::string& source, const std::string& lora, double lora_scale) {
  std::vector<torch::Tensor> x, caps;
  for (size_t i = 0;; ++i) {
    const auto xi = inputs.find("x." + std::to_string(i));
    const auto ci = inputs.find("cap_feats." + std::to_string(i));
    if (xi == inputs.end() && ci == inputs.end()) break;
    if (xi == inputs.end() || ci == inputs.end()) {
      throw Error(fmt::format(
          "{}: sample {} has {} but no {}; {}", source, i,
          xi == inputs.end() ? "cap_feats." + std::to_string(i) : "x." + std::to_string(i),
          xi == inputs.end() ? "x." + std::to_string(i) : "cap_feats." + std::to_string(i),
          kInputs));
    }
    x.push_back(float_input(source, xi->first, xi->second));
    caps.push_back(float_input(source, ci->first, ci->second));
  }
  const auto t = inputs.find("t");
  if (x.empty() || t == inputs.end()) {
    throw Error(
        fmt::format("{}: no {}; {}", source, x.empty() ? "x.0 / cap_feats.0" : "'t'", kInputs));
  }
  for (const auto& [name, value] : inputs) {
    (void)value;
    const bool known = name == "t" || (name.rfind("out", 0) == 0) ||
                       (name.rfind("x.", 0) == 0 && name.size() > 2) ||
                       name.rfind("cap_feats.", 0) == 0;
    if (!known)
      log::warn("{}: tensor '{}' is not an input of ZImageTransformer2DModel; ignored", source,
                name);
  }
  const torch::Tensor timestep = float_input(source, "t", t->second);
  if (timestep.dim() != 1 || timestep.size(0) != static_cast<int64_t>(x.size())) {
    throw Error(fmt::format("{}: 't' is {}; expected [{}], one per sample", source,
                            c10::str(timestep.sizes()), x.size()));
  }
  models::ZImageTransformer2DModel model =
      models::load_z_image_transformer(z_image_transformer_dir(dir), torch::kFloat32);
  if (!lora.empty()) {
    const io::LoraWeights weights = read_z_image_lora(lora, dir);
    check_lora_fits_family(weights, lora, dir);
    const auto s = models::merge_lora(*model, weights, lora_scale, "transformer");
    log::info("LoRA {}: merged into {} transformer modules, scale {}", lora, s.modules_merged,
              lora_scale);
  }
  model->eval();
  torch::NoGradGuard no_grad;
  const auto out = model->forward(x, timestep, caps);
  std::map<std::string, torch::Tensor> named;
  for (size_t i = 0; i < out.size(); ++i) named["out." + std::to_string(i)] = out[i];
  return named;
}

}  // namespace difftrain::families::z_image
