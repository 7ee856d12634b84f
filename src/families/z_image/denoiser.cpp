// ZImageDenoiser: per-sample lists, the real caption tokens, t = (1000 - t) / 1000, the negated
// output (families/z_image/denoiser.h).
#include "difftrain/families/z_image/denoiser.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

namespace difftrain::families::z_image {

torch::Tensor ZImageDenoiser::denoise(const torch::Tensor& x, const torch::Tensor& t,
                                      const diffusion::Conditioning& cond) {
  torch::Tensor text, mask;
  for (const auto& [name, tensor] : cond) {
    if (name == "encoder_hidden_states") {
      text = tensor;
    } else if (name == "encoder_attention_mask") {
      mask = tensor;
    } else {
      throw Error(fmt::format(
          "Z-Image's transformer takes no conditioning '{}'; it takes encoder_hidden_states and "
          "encoder_attention_mask",
          name));
    }
  }
  if (!text.defined()) {
    throw Error("Z-Image's transformer needs encoder_hidden_states (the text encoder's)");
  }
  const bool clip = x.dim() == 5;
  if ((x.dim() != 4 && !clip) || text.dim() != 3 || text.size(0) != x.size(0) ||
      (mask.defined() &&
       (mask.dim() != 2 || mask.size(0) != x.size(0) || mask.size(1) != text.size(1)))) {
    throw Error(fmt::format(
        "Z-Image's denoiser takes latents [B, C, H, W] (or [B, C, F, H, W]), "
        "encoder_hidden_states [B, L, D] and encoder_attention_mask [B, L]; got [{}], [{}]{}",
        fmt::join(x.sizes(), ", "), fmt::join(text.sizes(), ", "),
        mask.defined() ? fmt::format(", [{}]", fmt::join(mask.sizes(), ", ")) : std::string()));
  }
  const auto dtype = transformer_->dtype();
  std::vector<torch::Tensor> xs, caps;
  for (int64_t b = 0; b < x.size(0); ++b) {
    xs.push_back(clip ? x[b].to(dtype) : x[b].unsqueeze(1).to(dtype));
    torch::Tensor cap = text[b];
    if (mask.defined()) cap = cap.index({mask[b].to(torch::kBool)});
    caps.push_back(cap.to(dtype));
  }
  const torch::Tensor t_model = (1000 - t.to(torch::kFloat32)) / 1000;
  const auto out = transformer_->forward(xs, t_model, caps);
  torch::Tensor pred = torch::stack(out);
  if (!clip) pred = pred.squeeze(2);
  return -pred.to(x.scalar_type());
}

}  // namespace difftrain::families::z_image
