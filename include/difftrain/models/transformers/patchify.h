#pragma once
// Latents as a transformer's tokens and back: non-overlapping patches of an image [B, C, H, W]
// or a clip [B, C, F, H, W] flattened into tokens, in either channel order the Diffusers
// transformers use (FLUX.1's packing puts the channels first in a token, the DiTs that embed
// patches with a Linear over (patch..., channel) put them last), and the RoPE ids of the patch
// grid.

#include <torch/types.h>

#include <cstdint>
#include <vector>

namespace difftrain::models {

/// Where a patch's channels go in its token.
enum class PatchChannels {
  kFirst,  ///< token feature index c·(p0·p1...) + offset in the patch (FLUX.1's _pack_latents)
  kLast,   ///< (offset in the patch)·C + c ("(pf ph pw c)")
};

/// x: [B, C, S_1, ..., S_k] (k = patch.size(), 2 for images, 3 for clips; each S_i a multiple of
/// patch[i]) -> tokens [B, prod(S_i / patch[i]), C · prod(patch)], the patches in row-major order
/// of the patch grid. Throws difftrain::Error for other shapes.
torch::Tensor patchify(const torch::Tensor& x, const std::vector<int64_t>& patch,
                       PatchChannels channels = PatchChannels::kFirst);

/// The inverse of patchify(): tokens [B, prod(grid), C · prod(patch)] -> [B, C, S_1, ..., S_k]
/// for the latent sizes `sizes` (S_i). Throws difftrain::Error when the tokens do not fit them.
torch::Tensor unpatchify(const torch::Tensor& tokens, const std::vector<int64_t>& sizes,
                         const std::vector<int64_t>& patch,
                         PatchChannels channels = PatchChannels::kFirst);

/// The RoPE ids of a patch grid `grid` (k axes): [prod(grid), lead + k] with the lead columns
/// zero (FLUX.1's text/frame axis: lead 1) and column lead + i the index along axis i, in
/// row-major order (patchify's token order).
torch::Tensor grid_ids(const std::vector<int64_t>& grid, int64_t lead = 0,
                       const torch::TensorOptions& options = torch::kFloat32);

}  // namespace difftrain::models
