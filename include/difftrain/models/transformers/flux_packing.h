#pragma once
// FLUX.1's 2×2 latent packing (Diffusers' FluxPipeline._pack_latents / _unpack_latents /
// _prepare_latent_image_ids): the transformer sees a latent [B, C, H, W] as H/2·W/2 tokens of
// C·4 channels, each with a (0, row, col) RoPE id.

#include <torch/types.h>

#include <cstdint>

namespace difftrain::models {

/// z: [B, C, H, W] (H, W even) -> [B, (H/2)·(W/2), C·4] with
/// packed[b, i·(W/2) + j, c·4 + 2·dy + dx] = z[b, c, 2i + dy, 2j + dx].
/// Diffusers: `FluxPipeline._pack_latents`.
torch::Tensor pack_latents(const torch::Tensor& z);

/// The inverse of pack_latents: x [B, (H/2)·(W/2), C·4] -> [B, C, H, W], for the LATENT height
/// and width H, W (even). Diffusers: `FluxPipeline._unpack_latents` (which takes pixel sizes and
/// the VAE scale factor and derives the same H, W).
torch::Tensor unpack_latents(const torch::Tensor& x, int64_t height, int64_t width);

/// The image tokens' RoPE ids: [rows·cols, 3] with row i·cols + j = (0, i, j), for rows = H/2,
/// cols = W/2 of the latent. Diffusers: `FluxPipeline._prepare_latent_image_ids` (2-D, v0.31).
torch::Tensor latent_image_ids(int64_t rows, int64_t cols,
                               const torch::TensorOptions& options = torch::kFloat32);

}  // namespace difftrain::models
