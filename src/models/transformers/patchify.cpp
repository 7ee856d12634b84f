// Latents as tokens and back (patchify.h).
#include "difftrain/models/transformers/patchify.h"

#include "difftrain/core/error.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

namespace difftrain::models {
namespace {

int64_t product(const std::vector<int64_t>& v) {
  int64_t p = 1;
  for (const int64_t x : v) p *= x;
  return p;
}

void check_patch(const std::vector<int64_t>& patch, const char* what) {
  if (patch.empty()) throw Error(std::string(what) + ": give one patch size per spatial axis");
  for (const int64_t p : patch) {
    if (p < 1)
      throw Error(
          fmt::format("{}: patch sizes must be >= 1, got [{}]", what, fmt::join(patch, ", ")));
  }
}

}  // namespace

torch::Tensor patchify(const torch::Tensor& x, const std::vector<int64_t>& patch,
                       PatchChannels channels) {
  check_patch(patch, "patchify");
  const int64_t k = static_cast<int64_t>(patch.size());
  bool fits = x.dim() == 2 + k;
  for (int64_t i = 0; fits && i < k; ++i) fits = x.size(2 + i) % patch[i] == 0;
  if (!fits) {
    throw Error(fmt::format(
        "patchify: expected latents [B, C, {} axes] each a multiple of the patch [{}], got [{}]", k,
        fmt::join(patch, ", "), fmt::join(x.sizes(), ", ")));
  }
  const int64_t B = x.size(0), C = x.size(1);
  // [B, C, g_1, p_1, ..., g_k, p_k]
  std::vector<int64_t> split = {B, C}, grid;
  for (int64_t i = 0; i < k; ++i) {
    grid.push_back(x.size(2 + i) / patch[i]);
    split.insert(split.end(), {grid.back(), patch[i]});
  }
  // -> [B, g_1..g_k, C, p_1..p_k] (channels first) or [B, g_1..g_k, p_1..p_k, C].
  std::vector<int64_t> order = {0};
  for (int64_t i = 0; i < k; ++i) order.push_back(2 + 2 * i);
  if (channels == PatchChannels::kFirst) order.push_back(1);
  for (int64_t i = 0; i < k; ++i) order.push_back(3 + 2 * i);
  if (channels == PatchChannels::kLast) order.push_back(1);
  return x.reshape(split).permute(order).reshape({B, product(grid), C * product(patch)});
}

torch::Tensor unpatchify(const torch::Tensor& tokens, const std::vector<int64_t>& sizes,
                         const std::vector<int64_t>& patch, PatchChannels channels) {
  check_patch(patch, "unpatchify");
  const int64_t k = static_cast<int64_t>(patch.size());
  std::vector<int64_t> grid;
  bool fits = static_cast<int64_t>(sizes.size()) == k && tokens.dim() == 3;
  for (int64_t i = 0; fits && i < k; ++i) {
    fits = sizes[i] > 0 && sizes[i] % patch[i] == 0;
    grid.push_back(fits ? sizes[i] / patch[i] : 0);
  }
  fits = fits && tokens.size(1) == product(grid) && tokens.size(2) % product(patch) == 0;
  if (!fits) {
    throw Error(fmt::format(
        "unpatchify: expected tokens [B, prod(sizes / patch), C * prod(patch)] for latent sizes "
        "[{}] and patch [{}], got [{}]",
        fmt::join(sizes, ", "), fmt::join(patch, ", "), fmt::join(tokens.sizes(), ", ")));
  }
  const int64_t B = tokens.size(0), C = tokens.size(2) / product(patch);
  std::vector<int64_t> split = {B};
  split.insert(split.end(), grid.begin(), grid.end());
  if (channels == PatchChannels::kFirst) split.push_back(C);
  split.insert(split.end(), patch.begin(), patch.end());
  if (channels == PatchChannels::kLast) split.push_back(C);
  // Back to [B, C, g_1, p_1, ..., g_k, p_k].
  const int64_t c_axis = channels == PatchChannels::kFirst ? 1 + k : 1 + 2 * k;
  const int64_t p_axis = channels == PatchChannels::kFirst ? 2 + k : 1 + k;
  std::vector<int64_t> order = {0, c_axis};
  for (int64_t i = 0; i < k; ++i) order.insert(order.end(), {1 + i, p_axis + i});
  std::vector<int64_t> out = {B, C};
  out.insert(out.end(), sizes.begin(), sizes.end());
  return tokens.reshape(split).permute(order).reshape(out);
}

torch::Tensor grid_ids(const std::vector<int64_t>& grid, int64_t lead,
                       const torch::TensorOptions& options) {
  const int64_t k = static_cast<int64_t>(grid.size());
  if (k == 0 || lead < 0) throw Error("grid_ids: give at least one axis and lead >= 0");
  for (const int64_t g : grid) {
    if (g <= 0) {
      throw Error(fmt::format("grid_ids: the grid's sizes must be positive, got [{}]",
                              fmt::join(grid, ", ")));
    }
  }
  std::vector<int64_t> shape = grid;
  shape.push_back(lead + k);
  torch::Tensor ids = torch::zeros(shape, options);
  for (int64_t i = 0; i < k; ++i) {
    std::vector<int64_t> view(static_cast<size_t>(k), 1);
    view[static_cast<size_t>(i)] = grid[static_cast<size_t>(i)];
    ids.select(k, lead + i).add_(torch::arange(grid[static_cast<size_t>(i)], options).view(view));
  }
  return ids.reshape({product(grid), lead + k});
}

}  // namespace difftrain::models
