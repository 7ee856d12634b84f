// FluxDenoiser: pack, call the transformer with the training script's ids and timestep, unpack.
#include "difftrain/families/flux/denoiser.h"

#include "difftrain/core/error.h"
#include "difftrain/models/transformers/flux_packing.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

namespace difftrain::families::flux {

torch::Tensor FluxDenoiser::denoise(const torch::Tensor& x, const torch::Tensor& t,
                                    const diffusion::Conditioning& cond) {
  torch::Tensor text, pooled, guidance, txt_ids, img_ids;
  for (const auto& [name, tensor] : cond) {
    if (name == "encoder_hidden_states") {
      text = tensor;
    } else if (name == "pooled_projections") {
      pooled = tensor;
    } else if (name == "guidance") {
      guidance = tensor;
    } else if (name == "txt_ids") {
      txt_ids = tensor;
    } else if (name == "img_ids") {
      img_ids = tensor;
    } else {
      throw Error(fmt::format(
          "FLUX.1's transformer takes no conditioning '{}'; it takes encoder_hidden_states, "
          "pooled_projections, guidance, txt_ids and img_ids",
          name));
    }
  }
  if (!text.defined() || !pooled.defined()) {
    throw Error(
        "FLUX.1's transformer needs encoder_hidden_states (T5) and pooled_projections (CLIP)");
  }
  if (x.dim() != 4 || x.size(2) % 2 != 0 || x.size(3) % 2 != 0) {
    throw Error(fmt::format("FLUX.1 latents must be [B, C, H, W] with H and W even, got [{}]",
                            fmt::join(x.sizes(), ", ")));
  }
  const int64_t h = x.size(2), w = x.size(3);
  const auto ids_options = torch::TensorOptions().dtype(x.scalar_type()).device(x.device());
  if (!img_ids.defined()) img_ids = models::latent_image_ids(h / 2, w / 2, ids_options);
  if (!txt_ids.defined()) txt_ids = torch::zeros({text.size(1), 3}, ids_options);
  const auto packed = models::pack_latents(x);
  const auto out = transformer_->forward(packed, text, pooled, t.to(torch::kFloat32) / 1000,
                                         guidance, img_ids, txt_ids);
  return models::unpack_latents(out, h, w);
}

}  // namespace difftrain::families::flux
