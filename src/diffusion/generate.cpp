#include "difftrain/diffusion/generate.h"

#include <fmt/format.h>
#include <torch/torch.h>

namespace difftrain::diffusion {

std::map<std::string, torch::Tensor> GenerateResult::tensors() const {
  std::map<std::string, torch::Tensor> out = {{"images", images}};
  if (latents.defined()) out["latents"] = latents;
  if (prompt_embeds.defined()) out["prompt_embeds"] = prompt_embeds;
  if (pooled_prompt_embeds.defined()) out["pooled_prompt_embeds"] = pooled_prompt_embeds;
  return out;
}

std::vector<std::string> prompt_labels(const std::vector<std::string>& prompts,
                                       int64_t images_per_prompt) {
  std::vector<std::string> labels;
  for (const auto& prompt : prompts) {
    std::string text = prompt.substr(0, 28);
    if (prompt.size() > 28) text += "...";
    for (int64_t j = 0; j < images_per_prompt; ++j) {
      labels.push_back(images_per_prompt > 1 ? fmt::format("{} #{}", text, j) : text);
    }
  }
  return labels;
}

}  // namespace difftrain::diffusion
