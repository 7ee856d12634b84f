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
  torch::Tensor text, mask, references, reference_shapes;
  for (const auto& [name, tensor] : cond) {
    if (name == "encoder_hidden_states") {
      text = tensor;
    } else if (name == "encoder_attention_mask") {
      mask = tensor;
    } else if (name == "reference_latents") {
      references = tensor;
    } else if (name == "reference_shapes") {
      reference_shapes = tensor;
    } else {
      throw Error(fmt::format(
          "Qwen-Image's transformer takes no conditioning '{}'; it takes encoder_hidden_states, "
          "encoder_attention_mask and (Edit) reference_latents with reference_shapes",
          name));
    }
  }
  if (references.defined() != reference_shapes.defined() ||
      (references.defined() &&
       (references.dim() != 3 || references.size(0) != x.size(0) ||
        references.size(2) != 4 * x.size(1) || reference_shapes.dim() != 3 ||
        reference_shapes.size(0) != x.size(0) || reference_shapes.size(2) != 3))) {
    throw Error(
        "Qwen-Image-Edit's denoiser takes reference_latents [B, Lr, 4C] (packed) with "
        "reference_shapes int64 [B, R, 3] (each reference's frames, rows, columns)");
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
  std::vector<models::QwenImageGrids> shapes(static_cast<size_t>(B),
                                             models::QwenImageGrids{{1, h / 2, w / 2}});
  torch::Tensor input = pack_qwen_latents(x).to(dtype);
  const int64_t noisy = input.size(1);
  if (references.defined()) {  // the Edit pipelines: references after the noisy tokens
    const auto grids = reference_shapes.to(torch::kCPU, torch::kInt64).contiguous();
    int64_t tokens = 0;
    for (int64_t r = 0; r < grids.size(1); ++r) tokens += grids[0][r].prod().item<int64_t>();
    if (tokens != references.size(1)) {
      throw Error(fmt::format(
          "Qwen-Image-Edit's denoiser: reference_shapes cover {} tokens, reference_latents has {}",
          tokens, references.size(1)));
    }
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t r = 0; r < grids.size(1); ++r) {
        shapes[static_cast<size_t>(b)].push_back({grids[b][r][0].item<int64_t>(),
                                                  grids[b][r][1].item<int64_t>(),
                                                  grids[b][r][2].item<int64_t>()});
      }
    }
    input = torch::cat({input, references.to(input.device(), dtype)}, 1);
  }
  const torch::Tensor out =
      transformer_->forward(input, text.to(dtype), mask, t.to(torch::kFloat32) / 1000, shapes)
          .narrow(1, 0, noisy);
  return unpack_qwen_latents(out, h, w).to(x.scalar_type());
}

}  // namespace difftrain::families::qwen_image
