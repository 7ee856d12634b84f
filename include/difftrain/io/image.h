#pragma once
// Images: PNG writing, image reading (stb_image / stb_image_write), the float → uint8 conversion
// of Diffusers' pipelines, and a labelled grid of samples (captions drawn with stb_easy_font).
// Pixels are uint8 tensors [H, W, C] (HWC, as PIL and numpy hold them), C = 1 (grey), 3 (RGB)
// or 4 (RGBA).

#include <torch/types.h>

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace difftrain::io {

/// PNG bytes of `image`, uint8 [H, W, C] with C in 1..4 (grey, grey+alpha, RGB, RGBA), any device
/// and layout. Throws difftrain::Error for another dtype or shape.
std::string encode_png(const torch::Tensor& image);

/// Writes `image` (as encode_png) to `path` atomically (io::write_file_atomic): a reader sees the
/// old file or the whole new one. PIL: `Image.fromarray(image).save(path)`.
void save_png(const std::string& path, const torch::Tensor& image);

/// Reads a PNG, JPEG, WebP (libwebp; not animated), BMP, GIF (first frame), TGA, PSD, HDR, PIC or
/// PNM file as uint8 [H, W, C].
/// `channels` 1..4 converts (1 = grey, 3 = RGB like PIL's `.convert("RGB")`, 4 = RGBA); 0 keeps
/// the file's own count. 16-bit and HDR images are reduced to 8 bits. A missing, unreadable,
/// corrupt or unsupported file (e.g. 16-bit PNM), or one wider or taller than 16384 pixels,
/// throws a one-line difftrain::Error naming the path. A JPEG's EXIF Orientation (or a PNG's eXIf
/// chunk) is applied as PIL's `ImageOps.exif_transpose` does: a phone photo stored sideways comes
/// out upright.
torch::Tensor load_image(const std::string& path, int channels = 3);

/// {height, width} of the image file at `path` from its header, without decoding the pixels
/// (the size load_image would return). Throws a one-line difftrain::Error naming the path for a
/// missing, unreadable or unrecognised file.
std::array<int64_t, 2> image_size(const std::string& path);

/// Whether this build reads WebP files (it was built with libwebp-dev).
bool webp_supported();

/// Lossless WebP bytes of uint8 [H, W, 3 or 4] (libwebp's WebPEncodeLossless*); throws
/// difftrain::Error in a build without libwebp.
std::string encode_webp_lossless(const torch::Tensor& image);

/// JPEG bytes of uint8 [H, W, C] (C 1..4; stb_image_write, baseline, `quality` 1..100).
std::string encode_jpeg(const torch::Tensor& image, int quality = 95);

/// Decodes image bytes already in memory (as load_image); `name` is used in errors.
torch::Tensor decode_image(const std::string& bytes, const std::string& name, int channels = 3);

/// The resampling filters of PIL's Image.resize (Image.Resampling).
enum class Resample { kBilinear, kBicubic, kLanczos };

/// uint8 [H, W, C] resized to `height` x `width` as PIL's `Image.resize((width, height),
/// resample)` does for an RGB / L image, value for value: PIL's separable convolution (support
/// scaled by the reduction, coefficients normalised per output pixel then rounded to 22-bit fixed
/// point, the horizontal pass first and its result rounded to 8 bits, then the vertical pass),
/// bicubic with a = -0.5, lanczos 3 lobes. The same size returns a copy. Diffusers'
/// VaeImageProcessor.resize (lanczos) and Qwen2-VL's image processor (bicubic) resize with it.
/// Throws difftrain::Error for another dtype or shape, or a size below 1.
torch::Tensor resize_image(const torch::Tensor& image, int64_t height, int64_t width,
                           Resample filter);

/// float images [N, C, H, W] in [0, 1] → uint8 [N, H, W, C] on the CPU, as Diffusers'
/// `VaeImageProcessor.pt_to_numpy` + `numpy_to_pil` do: float32, (x * 255).round() (half to
/// even). Values are clamped to [0, 1] first (NaN → 0). Any floating dtype and device.
torch::Tensor to_uint8_images(const torch::Tensor& images);

/// Tiles uint8 images [N, H, W, C] (C 1, 3 or 4; grey is shown as grey, alpha is dropped) into
/// one uint8 RGB image [H', W', 3] on a white background, `columns` per row (0: ceil(sqrt(N)),
/// more than N: N) with `padding` pixels between cells and around the edge (torchvision's
/// make_grid layout). With `labels` (one per image, or empty for none), each cell gets a caption
/// strip under its image with the label in black (stb_easy_font; 2x for images 256 px wide or
/// more). A cell is as wide as its image or, for short captions on small images, as wide as the
/// caption up to 160 px (x font scale); the image is centred in it. Longer labels wrap at
/// spaces onto at most 3 lines, the last one ending in "..." if cut; characters outside
/// printable ASCII are drawn as '?'. So
///   H' = rows * (H + caption) + (rows + 1) * padding,  W' = cols * cell + (cols + 1) * padding.
torch::Tensor make_grid(const torch::Tensor& images, const std::vector<std::string>& labels = {},
                        int64_t columns = 0, int64_t padding = 2);

/// Writes float images [K, H, W, C] in [0, 1] (channels last, Diffusers' output_type "np", as
/// diffusion::generate() returns them) to `path` as one labelled PNG grid:
/// make_grid(to_uint8_images(images.permute({0, 3, 1, 2})), labels, columns, padding), then
/// save_png (atomic). Returns that grid, uint8 [H', W', 3], e.g. for a TensorBoard image
/// (Trackers::log_image). The one grid writer of `difftrain sample` and the trainer's
/// validation. Clips [K, F, H, W, C] (video pipelines' frames) are written one row per clip, its
/// label under the first frame and "frame f" under the others (`columns` does not apply).
torch::Tensor save_image_grid(const std::string& path, const torch::Tensor& images,
                              const std::vector<std::string>& labels = {}, int64_t columns = 0,
                              int64_t padding = 2);

}  // namespace difftrain::io
