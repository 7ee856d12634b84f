// QwenImageDenoiser (denoiser.h).
#include "denoiser.h"

#include "difftrain/core/error.h"
#include "qwen_image_pipeline.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

namespace difftrain::families::qwen_image {

torch::Tensor QwenImageDenoiser::denoise(const torch::Tensor& x, const torch::Tensor& t,
                                         const diffusion::Conditioning& cond) {
  torch::Tensor text, mask;
  for (const auto& [name, tensor] : cond) {
    if (name == "encoder_hidden_states") {
      text = tensor;
    } else if (name == "encoder_attention_mask") {
      mask = tensor;
    } else {
      throw Error(fmt::format(
          "Qwen-Image's transformer takes no conditioning '{}'; it takes encoder_hidden_states "
          "and encoder_attention_mask",
          name));
    }
  }
  if (!text.defined()) {
    throw Error("Qwen-Image's transformer needs encoder_hidden_states (the text encoder's)");
  }
  if (x.dim() != 4 || x.size(2) % 2 != 0 || x.size(3) % 2 != 0 || text.dim() != 3 ||
      text.size(0) != x.size(0) ||
      (mask.defined() &&
       (mask.dim() != 2 || mask.size(0) != x.size(0) || mask.size(1) != text.size(1)))) {
    throw Error(fmt::format(
        "Qwen-Image's denoiser takes latents [B, C, h, w] with h and w even, "
        "encoder_hidden_states [B, L, D] and encoder_attention_mask [B, L]; got [{}], [{}]{}",
        fmt::join(x.sizes(), ", "), fmt::join(text.sizes(), ", "),
        mask.defined() ? fmt::format(", [{}]", fmt::join(mask.sizes(), ", ")) : std::string()));
  }
  const int64_t B = x.size(0), h = x.size(2), w = x.size(3);
  const auto dtype = transformer_->dtype();
  const std::vector<models::QwenImageGrids> shapes(static_cast<size_t>(B),
                                                   models::QwenImageGrids{{1, h / 2, w / 2}});
  const torch::Tensor out = transformer_->forward(pack_qwen_latents(x).to(dtype), text.to(dtype),
                                                  mask, t.to(torch::kFloat32) / 1000, shapes);
  return unpack_qwen_latents(out, h, w).to(x.scalar_type());
}

}  // namespace difftrain::families::qwen_image
