#include "difftrain/models/transformers/flux_packing.h"

#include "difftrain/core/error.h"
#include "difftrain/models/transformers/patchify.h"

#include <string>

namespace difftrain::models {

namespace {

std::string flux_shape_text(c10::IntArrayRef sizes) {
  std::string s = "[";
  for (size_t i = 0; i < sizes.size(); ++i) s += (i ? ", " : "") + std::to_string(sizes[i]);
  return s + "]";
}

}  // namespace

torch::Tensor pack_latents(const torch::Tensor& z) {
  if (z.dim() != 4 || z.size(2) % 2 != 0 || z.size(3) % 2 != 0) {
    throw Error(
        "pack_latents: expected latents [B, C, H, W] with even H and W (FLUX packs 2x2 "
        "patches), got " +
        flux_shape_text(z.sizes()) +
        "; make the image size a multiple of 2x the VAE's downsampling factor");
  }
  // [B, C, H/2, dy, W/2, dx] -> [B, H/2, W/2, C, dy, dx]: 2x2 patches, channels first.
  return patchify(z, {2, 2}, PatchChannels::kFirst);
}

torch::Tensor unpack_latents(const torch::Tensor& x, int64_t height, int64_t width) {
  if (height <= 0 || width <= 0 || height % 2 != 0 || width % 2 != 0 || x.dim() != 3 ||
      x.size(1) != (height / 2) * (width / 2) || x.size(2) % 4 != 0) {
    throw Error(
        "unpack_latents: expected packed latents [B, (H/2)*(W/2), C*4] for an even latent "
        "size H x W = " +
        std::to_string(height) + " x " + std::to_string(width) + ", got " +
        flux_shape_text(x.sizes()) + "; pass the latent (not pixel) height and width");
  }
  return unpatchify(x, {height, width}, {2, 2}, PatchChannels::kFirst);
}

torch::Tensor latent_image_ids(int64_t rows, int64_t cols, const torch::TensorOptions& options) {
  if (rows <= 0 || cols <= 0) {
    throw Error("latent_image_ids: rows and cols must be positive, got " + std::to_string(rows) +
                " x " + std::to_string(cols));
  }
  return grid_ids({rows, cols}, /*lead=*/1, options);
}

}  // namespace difftrain::models
