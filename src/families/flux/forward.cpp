// `difftrain forward` for FLUX.1: one FluxTransformer2DModel forward on named tensors, to compare a
// checkpoint with Diffusers' `transformer(...)` number for number.
#include "difftrain/core/error.h"
#include "difftrain/core/log.h"
#include "difftrain/models/lora/lora.h"
#include "difftrain/models/transformers/flux_transformer.h"
#include "flux_family.h"

#include <fmt/format.h>
#include <torch/torch.h>

#include <algorithm>
#include <filesystem>

namespace difftrain::families::flux {
namespace fs = std::filesystem;

std::string flux_transformer_dir(const std::string& dir) {
  std::error_code ec;
  return fs::is_regular_file(fs::path(dir) / "model_index.json", ec)
             ? (fs::path(dir) / "transformer").string()
             : dir;
}

torch::Tensor forward_flux(const std::string& dir,
                           const std::map<std::string, torch::Tensor>& inputs,
                           const std::string& source, const std::string& lora, double lora_scale) {
  models::FluxTransformer2DModel model =
      models::load_flux_transformer(flux_transformer_dir(dir), torch::kFloat32);
  if (!lora.empty()) {
    const io::LoraWeights weights = read_flux_lora(lora, dir);
    check_lora_fits_family(weights, lora, dir);
    const auto s = models::merge_lora(*model, weights, lora_scale, "transformer");
    log::info("LoRA {}: merged into {} transformer modules, scale {}", lora, s.modules_merged,
              lora_scale);
  }
  static const char* const kNames[] = {"hidden_states",
                                       "encoder_hidden_states",
                                       "pooled_projections",
                                       "timestep",
                                       "guidance",
                                       "img_ids",
                                       "txt_ids"};
  for (const auto& [name, t] : inputs) {
    (void)t;
    if (name == "out") continue;
    if (std::find(std::begin(kNames), std::end(kNames), name) == std::end(kNames)) {
      log::warn("{}: tensor '{}' is not an input of FluxTransformer2DModel; ignored", source, name);
    }
  }
  auto take = [&](const char* name, bool required) -> torch::Tensor {
    const auto it = inputs.find(name);
    if (it == inputs.end()) {
      if (required) {
        throw Error(fmt::format(
            "{}: no tensor '{}'; FluxTransformer2DModel takes hidden_states [B,L,C], "
            "encoder_hidden_states [B,S,J], pooled_projections [B,P], timestep [B], guidance [B] "
            "(guidance-distilled models), img_ids [L,3] and txt_ids [S,3]",
            source, name));
      }
      return {};
    }
    if (!it->second.is_floating_point()) {
      throw Error(fmt::format("{}: '{}' is {}; expected a floating-point tensor", source, name,
                              c10::toString(it->second.scalar_type())));
    }
    return it->second.to(torch::kFloat32);
  };
  const torch::Tensor guidance = take("guidance", model->options().guidance_embeds());
  model->eval();
  torch::NoGradGuard no_grad;
  return model->forward(take("hidden_states", true), take("encoder_hidden_states", true),
                        take("pooled_projections", true), take("timestep", true), guidance,
                        take("img_ids", true), take("txt_ids", true));
}

}  // namespace difftrain::families::flux
