// `difftrain forward` for Qwen-Image: one QwenImageTransformer2DModel forward on Diffusers'
// arguments read by name (hidden_states, encoder_hidden_states, encoder_hidden_states_mask,
// timestep, img_shapes int64 [B, N, 3], additional_t_cond), giving `out`, to compare a checkpoint
// with Diffusers' `transformer(...)` number for number.
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/families/family.h"
#include "difftrain/models/lora/lora.h"
#include "qwen_image_pipeline.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <set>

namespace difftrain::families::qwen_image {

namespace {

constexpr const char* kInputs =
    "QwenImageTransformer2DModel takes hidden_states [B, N, in_channels], encoder_hidden_states "
    "[B, S, joint_attention_dim], timestep [B], img_shapes int64 [B, K, 3] (each image's frame, "
    "height, width in 2x2 patches), and optionally encoder_hidden_states_mask [B, S] and "
    "additional_t_cond int64 [B]";

torch::Tensor required(const std::map<std::string, torch::Tensor>& inputs,
                       const std::string& source, const std::string& name) {
  const auto it = inputs.find(name);
  if (it == inputs.end()) throw Error(fmt::format("{}: no '{}'; {}", source, name, kInputs));
  return it->second;
}

torch::Tensor float_input(const std::string& source, const std::string& name,
                          const torch::Tensor& t) {
  if (!t.is_floating_point()) {
    throw Error(fmt::format("{}: '{}' is {}; expected a floating-point tensor", source, name,
                            c10::toString(t.scalar_type())));
  }
  return t.to(torch::kFloat32);
}

}  // namespace

std::map<std::string, torch::Tensor> forward_qwen_image(
    const std::string& dir, const std::map<std::string, torch::Tensor>& inputs,
    const std::string& source, const std::string& lora, double lora_scale) {
  static const std::set<std::string> kKnown = {
      "hidden_states", "encoder_hidden_states", "encoder_hidden_states_mask", "timestep",
      "img_shapes",    "additional_t_cond"};
  for (const auto& [name, value] : inputs) {
    (void)value;
    if (kKnown.count(name) == 0 && name.rfind("out", 0) != 0) {
      log::warn("{}: tensor '{}' is not an input of QwenImageTransformer2DModel; ignored", source,
                name);
    }
  }
  const auto hidden =
      float_input(source, "hidden_states", required(inputs, source, "hidden_states"));
  const auto text = float_input(source, "encoder_hidden_states",
                                required(inputs, source, "encoder_hidden_states"));
  const auto timestep = float_input(source, "timestep", required(inputs, source, "timestep"));
  const torch::Tensor shapes = required(inputs, source, "img_shapes");
  if (shapes.is_floating_point() || shapes.dim() != 3 || shapes.size(2) != 3 ||
      shapes.size(0) != hidden.size(0)) {
    throw Error(fmt::format("{}: 'img_shapes' is {} {}; expected int64 [{}, K, 3]", source,
                            c10::toString(shapes.scalar_type()), c10::str(shapes.sizes()),
                            hidden.dim() > 0 ? hidden.size(0) : 0));
  }
  std::vector<models::QwenImageGrids> grids;
  const auto s = shapes.to(torch::kInt64);
  for (int64_t b = 0; b < s.size(0); ++b) {
    models::QwenImageGrids g;
    for (int64_t j = 0; j < s.size(1); ++j) {
      g.push_back(
          {s[b][j][0].item<int64_t>(), s[b][j][1].item<int64_t>(), s[b][j][2].item<int64_t>()});
    }
    grids.push_back(std::move(g));
  }
  const auto mask_it = inputs.find("encoder_hidden_states_mask");
  const torch::Tensor mask = mask_it == inputs.end() ? torch::Tensor() : mask_it->second;
  const auto cond_it = inputs.find("additional_t_cond");
  const torch::Tensor cond = cond_it == inputs.end() ? torch::Tensor() : cond_it->second;
  models::QwenImageTransformer2DModel model =
      models::load_qwen_image_transformer(qwen_image_transformer_dir(dir), torch::kFloat32);
  if (!lora.empty()) {
    const io::LoraWeights weights = read_qwen_image_lora(lora, dir);
    check_lora_fits_family(weights, lora, dir);
    const auto merged = models::merge_lora(*model, weights, lora_scale, "transformer");
    log::info("LoRA {}: merged into {} transformer modules, scale {}", lora, merged.modules_merged,
              lora_scale);
  }
  model->eval();
  torch::NoGradGuard no_grad;
  try {
    return {{"out", model->forward(hidden, text, mask, timestep, grids, cond)}};
  } catch (const Error& e) {
    throw Error(source + ": " + e.what());
  }
}

}  // namespace difftrain::families::qwen_image
