#pragma once
// The latent and text-embedding caches of text-to-image training (--cache_latents), components a
// model family composes: every rank encodes its share, the main rank joins the parts into one
// safetensors file, every rank loads it. A file's name carries a hash of what its contents depend
// on (cache_key), so a changed VAE, image or caption gives a new file instead of stale numbers.

#include "difftrain/accel/accelerator.h"
#include "difftrain/data/image_folder.h"
#include "difftrain/models/autoencoders/autoencoder_kl.h"

#include <torch/types.h>

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <string>
#include <utility>
#include <vector>

namespace difftrain::train {

/// What identifies a file's contents cheaply: its path, size and modification time.
std::string file_stamp(const std::filesystem::path& path);
/// file_stamp of every regular file under `dir` (recursively), sorted.
std::string folder_stamp(const std::filesystem::path& dir);
/// 16 hex digits of a 64-bit FNV-1a hash of `key`: the part of a cache file's name that changes
/// with what it depends on.
std::string cache_key(const std::string& key);

/// The VAE posterior of every image of `images` ({mean, logvar} [C, h, w] float32 on the CPU per
/// image), read from `file` when it exists, else encoded (each rank its share, `batch` images of
/// one size per VAE call, under acc.autocast()) and written there ("mean.<i>", "logvar.<i>").
/// Throws difftrain::Error when `file` is not a latent cache of these images.
/// `encode` takes pixel values [B, 3, H, W] (float32, on the CPU) and returns the posterior over
/// [B, C, h, w] (it moves them to its VAE's device and dtype).
using PixelEncoder = std::function<models::DiagonalGaussian(const torch::Tensor& pixels)>;
std::pair<std::vector<torch::Tensor>, std::vector<torch::Tensor>> cached_latents(
    accel::Accelerator& acc, const data::ImageFolderDataset& images,
    const std::filesystem::path& file, const PixelEncoder& encode, int64_t batch);

/// [N, 4] int64: each image's original height, width and centre-crop top, left at its target
/// size (what a cached latent stands for: centre crops without flips).
torch::Tensor centre_crop_geometry(const data::ImageFolderDataset& images);

/// Encodes the captions into the text-embedding cache `file`: one row per caption (in order) for
/// each tensor `encode` returns, and the captions as metadata. Every rank encodes its contiguous
/// range (64 captions at a time) into a part file and the main rank joins the parts.
void build_text_embedding_cache(
    accel::Accelerator& acc, const std::vector<std::string>& captions,
    const std::filesystem::path& file,
    const std::function<std::map<std::string, torch::Tensor>(const std::vector<std::string>&)>&
        encode);

/// The text-embedding cache `file` by caption: each caption's row of every tensor.
std::map<std::string, std::map<std::string, torch::Tensor>> load_text_embedding_cache(
    const std::filesystem::path& file);

}  // namespace difftrain::train
