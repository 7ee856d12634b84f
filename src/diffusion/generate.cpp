#include "difftrain/diffusion/generate.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

namespace difftrain::diffusion {

std::map<std::string, torch::Tensor> GenerateResult::tensors() const {
  std::map<std::string, torch::Tensor> out = {{"images", images}};
  // A video pipeline's clips also under Diffusers' name for them.
  if (images.defined() && images.dim() == 5) out["frames"] = images;
  if (latents.defined()) out["latents"] = latents;
  if (prompt_embeds.defined()) out["prompt_embeds"] = prompt_embeds;
  if (pooled_prompt_embeds.defined()) out["pooled_prompt_embeds"] = pooled_prompt_embeds;
  return out;
}

torch::Tensor media_frames(const torch::Tensor& media, const std::string& what) {
  if (media.defined() && media.dim() == 5) return media;
  if (media.defined() && media.dim() == 4) return media.unsqueeze(1);
  throw Error(fmt::format("{} are {}: expected images [K, H, W, C] or clips [K, F, H, W, C]", what,
                          media.defined() ? fmt::format("[{}]", fmt::join(media.sizes(), ", "))
                                          : std::string("undefined")));
}

int64_t GenerateResult::num_frames() const { return frames().size(1); }

torch::Tensor GenerateResult::frames() const { return media_frames(images, "generated media"); }

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
