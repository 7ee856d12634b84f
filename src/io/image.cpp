#include "difftrain/io/image.h"

#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#ifndef DIFFTRAIN_HAVE_WEBP
#define DIFFTRAIN_HAVE_WEBP 0
#endif

#include <torch/torch.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <climits>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <sstream>
#include <string_view>

// The stb single-file libraries (Debian's libstb-dev headers), compiled here and only here.
// Their code is not ours: its warnings are silenced for these includes only.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wimplicit-fallthrough"
#pragma GCC diagnostic ignored "-Wtype-limits"
#pragma GCC diagnostic ignored "-Wdouble-promotion"
#define STB_IMAGE_STATIC
#define STB_IMAGE_IMPLEMENTATION
#define STBI_NO_STDIO
// Images wider or taller than this are refused before any pixel memory is allocated (stb's
// default, 2^24, lets a 100-byte header ask for terabytes).
#define STBI_MAX_DIMENSIONS (1 << 14)
#include <stb/stb_image.h>
#define STB_IMAGE_WRITE_IMPLEMENTATION
#define STBI_WRITE_NO_STDIO
#include <stb/stb_easy_font.h>
#include <stb/stb_image_write.h>
#pragma GCC diagnostic pop

#if DIFFTRAIN_HAVE_WEBP
#include <webp/decode.h>
#include <webp/encode.h>
#endif

namespace difftrain::io {
namespace {

// "RIFF" <size> "WEBP": the container every WebP file starts with.
bool is_webp(std::string_view b) {
  return b.size() >= 12 && b.substr(0, 4) == "RIFF" && b.substr(8, 4) == "WEBP";
}

#if DIFFTRAIN_HAVE_WEBP
// A WebP file (lossy, lossless, with or without alpha; an animation's first frame is refused by
// libwebp's simple API) as uint8 [H, W, channels], converted as stb_image converts: 1 = grey
// ((77 R + 150 G + 29 B) >> 8), 2 = grey + alpha, 3 = RGB (alpha dropped, PIL's
// `.convert("RGB")`), 4 = RGBA, 0 = as stored (RGB, or RGBA with alpha).
torch::Tensor decode_webp(const std::string& bytes, const std::string& name, int channels) {
  const auto* data = reinterpret_cast<const uint8_t*>(bytes.data());
  WebPBitstreamFeatures features;
  if (WebPGetFeatures(data, bytes.size(), &features) != VP8_STATUS_OK) {
    throw Error("cannot load image '" + name + "': not a valid WebP file (" +
                std::to_string(bytes.size()) + " bytes); re-create it or convert it to PNG");
  }
  if (features.has_animation) {
    throw Error("cannot load image '" + name +
                "': an animated WebP; extract one frame (e.g. as PNG) to train on it");
  }
  if (features.width > (1 << 14) || features.height > (1 << 14)) {
    throw Error("cannot load image '" + name + "': " + std::to_string(features.width) + "x" +
                std::to_string(features.height) + " pixels, more than 16384 on a side");
  }
  int w = 0, h = 0;
  std::unique_ptr<uint8_t, void (*)(void*)> rgba(WebPDecodeRGBA(data, bytes.size(), &w, &h),
                                                 WebPFree);
  if (!rgba) {
    throw Error("cannot load image '" + name +
                "': the WebP data is damaged or truncated; re-create it or convert it to PNG");
  }
  auto image = torch::from_blob(rgba.get(), {h, w, 4}, torch::kUInt8).clone();
  const int c = channels != 0 ? channels : (features.has_alpha ? 4 : 3);
  if (c == 4) return image;
  if (c == 3) return image.narrow(2, 0, 3).contiguous();
  const auto px = image.to(torch::kInt32);
  auto grey = (px.select(2, 0) * 77 + px.select(2, 1) * 150 + px.select(2, 2) * 29)
                  .div(256, "floor")
                  .to(torch::kUInt8);
  if (c == 1) return grey.unsqueeze(2).contiguous();
  return torch::stack(std::vector<torch::Tensor>{grey, image.select(2, 3)}, 2).contiguous();
}
#endif

std::string shape_str(const torch::Tensor& t) {
  std::ostringstream out;
  out << t.sizes() << " " << c10::toString(t.scalar_type());
  return out.str();
}

// stb_image 2.27 (Debian's libstb-dev, the one we build against) trusts a JPEG DHT segment's 16
// code counts: when they sum past 256 it writes past its Huffman tables (a heap overflow; fixed
// upstream in 2.28). Such a segment is never valid, so the markers are walked as stb reads them
// (segments by length, entropy-coded data up to the next marker) and the file is refused first.
// ---------------------------------------------------------------- EXIF orientation

// The Orientation tag (0x0112) of a TIFF structure (an EXIF block), 1 when absent or malformed.
int tiff_orientation(const unsigned char* p, size_t n) {
  if (n < 8) return 1;
  const bool little = p[0] == 'I' && p[1] == 'I';
  if (!little && !(p[0] == 'M' && p[1] == 'M')) return 1;
  auto u16 = [&](size_t at) -> uint32_t {
    return little ? p[at] | (p[at + 1] << 8) : (p[at] << 8) | p[at + 1];
  };
  auto u32 = [&](size_t at) -> uint32_t {
    return little ? u16(at) | (u16(at + 2) << 16) : (u16(at) << 16) | u16(at + 2);
  };
  if (u16(2) != 42) return 1;
  const size_t ifd = u32(4);
  if (ifd > n - 2) return 1;
  const size_t count = u16(ifd);
  for (size_t i = 0; i < count; ++i) {
    const size_t entry = ifd + 2 + 12 * i;
    if (entry + 12 > n) break;
    if (u16(entry) == 0x0112 && u16(entry + 2) == 3) {  // Orientation, SHORT
      const uint32_t v = u16(entry + 8);
      return v >= 1 && v <= 8 ? static_cast<int>(v) : 1;
    }
  }
  return 1;
}

// EXIF orientation 1..8 of a JPEG (APP1 "Exif" segment) or PNG (eXIf chunk); 1 = as stored.
int exif_orientation(std::string_view b) {
  const auto* u = reinterpret_cast<const unsigned char*>(b.data());
  if (b.size() > 4 && u[0] == 0xFF && u[1] == 0xD8) {
    size_t pos = 2;
    while (pos + 4 <= b.size() && u[pos] == 0xFF) {
      const unsigned char marker = u[pos + 1];
      if (marker == 0xFF) {  // fill byte
        ++pos;
        continue;
      }
      if (marker == 0xDA || marker == 0xD9) break;  // image data: no EXIF after it
      const size_t len = (size_t{u[pos + 2]} << 8) | u[pos + 3];
      if (len < 2 || pos + 2 + len > b.size()) break;
      if (marker == 0xE1 && len >= 8 && b.substr(pos + 4, 6) == std::string_view("Exif\0\0", 6)) {
        return tiff_orientation(u + pos + 10, len - 8);
      }
      pos += 2 + len;
    }
    return 1;
  }
  static constexpr std::string_view kPng("\x89PNG\r\n\x1a\n", 8);
  if (b.substr(0, 8) == kPng) {
    size_t pos = 8;
    while (pos + 12 <= b.size()) {
      const size_t len = (size_t{u[pos]} << 24) | (size_t{u[pos + 1]} << 16) |
                         (size_t{u[pos + 2]} << 8) | u[pos + 3];
      if (len > b.size() - pos - 12) break;
      const std::string_view type = b.substr(pos + 4, 4);
      if (type == "eXIf") return tiff_orientation(u + pos + 8, len);
      if (type == "IEND") break;
      pos += 12 + len;
    }
  }
  return 1;
}

// PIL's ImageOps.exif_transpose on uint8 [H, W, C]: 2 FLIP_LEFT_RIGHT, 3 ROTATE_180,
// 4 FLIP_TOP_BOTTOM, 5 TRANSPOSE, 6 ROTATE_270, 7 TRANSVERSE, 8 ROTATE_90.
torch::Tensor apply_exif_orientation(const torch::Tensor& image, int orientation) {
  switch (orientation) {
    case 2: return image.flip({1}).contiguous();
    case 3: return image.flip({0, 1}).contiguous();
    case 4: return image.flip({0}).contiguous();
    case 5: return image.transpose(0, 1).contiguous();
    case 6: return image.rot90(-1, {0, 1}).contiguous();  // 90 degrees clockwise
    case 7: return image.transpose(0, 1).flip({0, 1}).contiguous();
    case 8: return image.rot90(1, {0, 1}).contiguous();  // 90 degrees counter-clockwise
    default: return image;
  }
}

bool jpeg_has_oversized_huffman_table(std::string_view b) {
  auto at = [&](size_t i) -> unsigned {
    return i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
  };
  // SOI, after any number of 0xFF fill bytes (stb accepts them there too).
  size_t pos = 0;
  while (pos < b.size() && at(pos) == 0xFF) ++pos;
  if (pos == 0 || at(pos) != 0xD8) return false;
  ++pos;
  while (pos < b.size()) {
    if (at(pos) != 0xFF) {  // entropy-coded data (or junk stb skips): on to the next marker
      ++pos;
      continue;
    }
    while (at(pos) == 0xFF && pos < b.size()) ++pos;  // fill bytes
    const unsigned marker = at(pos++);
    if (marker == 0x00 || (marker >= 0xD0 && marker <= 0xD8) || marker == 0x01) continue;
    if (marker == 0xD9) break;
    const size_t length = at(pos) << 8 | at(pos + 1);
    if (marker == 0xC4) {
      size_t q = pos + 2;
      for (long left = static_cast<long>(length) - 2; left > 0;) {
        unsigned n = 0;
        for (size_t i = 0; i < 16; ++i) n += at(q + 1 + i);
        if (n > 256) return true;
        q += 17 + n;
        left -= 17 + static_cast<long>(n);
      }
    }
    pos += length;  // SOS: its header, then the scan's entropy-coded data is skipped above
  }
  return false;
}

// stb_image 2.27 also reads a binary PNM (P5/P6) with maxval > 255 as 16-bit samples but then
// converts them as 8-bit ones, writing past its buffer (fixed upstream in 2.28), and parses the
// header integers with no overflow check. Returns why such a file is refused, or "".
std::string unsupported_pnm(std::string_view b) {
  if (b.size() < 2 || b[0] != 'P' || (b[1] != '5' && b[1] != '6')) return "";
  size_t pos = 2;
  int64_t value = 0;
  for (int field = 0; field < 3; ++field) {  // width, height, maxval
    for (;;) {                               // whitespace and # comments, as stb skips them
      while (pos < b.size() && std::isspace(static_cast<unsigned char>(b[pos]))) ++pos;
      if (pos >= b.size() || b[pos] != '#') break;
      while (pos < b.size() && b[pos] != '\n' && b[pos] != '\r') ++pos;
    }
    value = 0;
    while (pos < b.size() && std::isdigit(static_cast<unsigned char>(b[pos]))) {
      value = value * 10 + (b[pos++] - '0');
      if (value > (int64_t{1} << 24)) return "a PNM header value is larger than 2^24";
    }
  }
  if (value > 255) return "16-bit PNM (maxval " + std::to_string(value) + ") is not supported";
  return "";
}

void append_bytes(void* context, void* data, int size) {
  static_cast<std::string*>(context)->append(static_cast<const char*>(data),
                                             static_cast<size_t>(size));
}

// ---------------------------------------------------------------- captions
// stb_easy_font draws ASCII 32..126 as quads in a 12-pixel line; we fill the quads ourselves.
constexpr int kLineHeight = 12;
constexpr int kMargin = 2;             // pixels above a caption and beside it (unscaled)
constexpr int kMaxCaptionWidth = 160;  // a caption widens a cell up to this (unscaled)
constexpr int kMaxLines = 3;

// Printable ASCII only: whitespace becomes ' ', anything else '?' (one per UTF-8 character).
// Capped in length, as at most kMaxLines lines of it can show.
std::string printable(const std::string& label) {
  std::string out;
  for (const char c : label) {
    if (out.size() >= 512) break;
    const auto byte = static_cast<unsigned char>(c);
    if ((byte & 0xC0) == 0x80) continue;  // a UTF-8 continuation byte
    out += c == '\t' || c == '\n' || c == '\r' ? ' ' : byte < 32 || byte > 126 ? '?' : c;
  }
  return out;
}

int text_width(const std::string& text) {
  std::string copy = text;  // stb_easy_font takes char*
  return stb_easy_font_width(copy.data());
}

// The longest prefix of `text` (at least one character) no wider than `max_width`.
size_t fitting_prefix(const std::string& text, int max_width) {
  size_t n = text.size();
  while (n > 1 && text_width(text.substr(0, n)) > max_width) --n;
  return n;
}

// Greedy word wrap into lines of at most `max_width` pixels; at most kMaxLines, the last one
// ending in "..." when text was cut.
std::vector<std::string> wrap(const std::string& text, int max_width) {
  std::vector<std::string> lines;
  std::string line;
  std::istringstream words(text);
  std::string word;
  while (words >> word) {
    const std::string candidate = line.empty() ? word : line + " " + word;
    if (text_width(candidate) <= max_width) {
      line = candidate;
      continue;
    }
    if (!line.empty()) lines.push_back(line);
    line = word;
    while (line.size() > 1 && text_width(line) > max_width) {  // a word wider than the cell
      const size_t n = fitting_prefix(line, max_width);
      lines.push_back(line.substr(0, n));
      line = line.substr(n);
    }
  }
  if (!line.empty() || lines.empty()) lines.push_back(line);
  if (lines.size() > static_cast<size_t>(kMaxLines)) {
    lines.resize(kMaxLines);
    std::string& last = lines.back();
    while (!last.empty() && text_width(last + "...") > max_width) last.pop_back();
    last += "...";
  }
  return lines;
}

// A rectangle of an RGB uint8 image [H, W, 3] (contiguous), for clipping.
struct Rect {
  int64_t x0, y0, x1, y1;
};

// Draws `text` in black with its top-left corner at (x, y), each font pixel as scale x scale,
// clipped to `clip`.
void draw_text(uint8_t* rgb, int64_t width, const std::string& text, int64_t x, int64_t y,
               int scale, const Rect& clip) {
  std::string copy = text;
  std::vector<char> quads(copy.size() * 1024 + 64);  // 64 bytes a quad, ~270 bytes a character
  const int n =
      stb_easy_font_print(0, 0, copy.data(), nullptr, quads.data(), static_cast<int>(quads.size()));
  for (int q = 0; q < n; ++q) {
    float qx0 = 1e9f, qy0 = 1e9f, qx1 = -1e9f, qy1 = -1e9f;
    for (int v = 0; v < 4; ++v) {
      const float* p = reinterpret_cast<const float*>(quads.data() + q * 64 + v * 16);
      qx0 = std::min(qx0, p[0]);
      qx1 = std::max(qx1, p[0]);
      qy0 = std::min(qy0, p[1]);
      qy1 = std::max(qy1, p[1]);
    }
    const int64_t px0 = std::max(clip.x0, x + scale * static_cast<int64_t>(std::lround(qx0)));
    const int64_t px1 = std::min(clip.x1, x + scale * static_cast<int64_t>(std::lround(qx1)));
    const int64_t py0 = std::max(clip.y0, y + scale * static_cast<int64_t>(std::lround(qy0)));
    const int64_t py1 = std::min(clip.y1, y + scale * static_cast<int64_t>(std::lround(qy1)));
    for (int64_t py = py0; py < py1; ++py) {
      std::fill(rgb + (py * width + px0) * 3, rgb + (py * width + std::max(px0, px1)) * 3, 0);
    }
  }
}

}  // namespace

// ---------------------------------------------------------------- PNG and loading

std::string encode_png(const torch::Tensor& image) {
  if (!image.defined() || image.dim() != 3 || image.scalar_type() != torch::kUInt8 ||
      image.size(2) < 1 || image.size(2) > 4 || image.size(0) < 1 || image.size(1) < 1 ||
      image.size(0) > INT_MAX / 4 || image.size(1) > INT_MAX / 4) {
    throw Error("encode_png: the image is " + (image.defined() ? shape_str(image) : "undefined") +
                ": expected uint8 [H, W, C] with H, W >= 1 and C 1..4 (to_uint8_images "
                "converts float [N, C, H, W] images)");
  }
  const auto pixels = image.to(torch::kCPU).contiguous();
  const int h = static_cast<int>(pixels.size(0)), w = static_cast<int>(pixels.size(1)),
            c = static_cast<int>(pixels.size(2));
  std::string png;
  if (stbi_write_png_to_func(append_bytes, &png, w, h, c, pixels.data_ptr<uint8_t>(), w * c) == 0) {
    throw Error("encode_png: stb_image_write could not encode the " + shape_str(image) +
                " image (out of memory?)");
  }
  return png;
}

void save_png(const std::string& path, const torch::Tensor& image) {
  write_file_atomic(path, encode_png(image));
}

torch::Tensor decode_image(const std::string& bytes, const std::string& name, int channels) {
  if (channels < 0 || channels > 4) {
    throw Error("cannot load image '" + name + "': channels is " + std::to_string(channels) +
                ": use 1 (grey), 3 (RGB), 4 (RGBA), 2 (grey+alpha) or 0 (as stored)");
  }
  if (bytes.size() > static_cast<size_t>(INT_MAX)) {
    throw Error("cannot load image '" + name + "': the file is larger than 2 GiB");
  }
  if (is_webp(bytes)) {
#if DIFFTRAIN_HAVE_WEBP
    return decode_webp(bytes, name, channels);
#else
    throw Error("cannot load image '" + name +
                "': a WebP file, and this difftrain was built without libwebp (install "
                "libwebp-dev and rebuild), or convert it to PNG");
#endif
  }
  if (jpeg_has_oversized_huffman_table(bytes)) {
    throw Error("cannot load image '" + name +
                "': a JPEG Huffman table declares more than 256 codes; the file is corrupt — "
                "re-create it or convert it to PNG");
  }
  if (const std::string why = unsupported_pnm(bytes); !why.empty()) {
    throw Error("cannot load image '" + name + "': " + why + "; convert it to PNG");
  }
  // A header may declare far more pixels than its file can hold: stb_image reads missing bytes
  // as zeros, so a 50-byte TGA or BMP header can make it allocate a 16384 x 16384 image. No
  // format here packs more than 8 pixels per byte (1-bit PNG) times zlib's 1032:1, so a header
  // that claims more than that (plus a small allowance) is refused before anything is allocated.
  int info_w = 0, info_h = 0, info_c = 0;
  if (stbi_info_from_memory(reinterpret_cast<const stbi_uc*>(bytes.data()),
                            static_cast<int>(bytes.size()), &info_w, &info_h, &info_c) != 0) {
    constexpr int64_t kMaxPixelsPerByte = 8 * 1032;
    constexpr int64_t kAllowance = 1 << 16;
    const int64_t pixels = int64_t{info_w} * int64_t{info_h};
    if (pixels > kMaxPixelsPerByte * static_cast<int64_t>(bytes.size()) + kAllowance) {
      throw Error("cannot load image '" + name + "': its header declares " +
                  std::to_string(info_w) + "x" + std::to_string(info_h) +
                  " pixels, more than a file of " + std::to_string(bytes.size()) +
                  " bytes can hold; the file is truncated or corrupt — re-create it or convert it "
                  "to PNG");
    }
  }
  int w = 0, h = 0, stored = 0;
  std::unique_ptr<stbi_uc, void (*)(void*)> data(
      stbi_load_from_memory(reinterpret_cast<const stbi_uc*>(bytes.data()),
                            static_cast<int>(bytes.size()), &w, &h, &stored, channels),
      stbi_image_free);
  if (!data) {
    // stb_image's reasons are terse tags. A PNG cut inside a chunk header is reported as an
    // unknown chunk named by its type bytes, which are then partial or zero ("IDA", ""): both
    // mean the data ends early or is damaged.
    std::string reason = stbi_failure_reason() ? stbi_failure_reason() : "unknown error";
    if (reason == "outofdata" || reason.size() < 4) reason = "the data ends early or is damaged";
    throw Error("cannot load image '" + name + "': " + reason + " (" +
                std::to_string(bytes.size()) +
                " bytes); the file is corrupt, truncated or not a PNG, JPEG, BMP, GIF, TGA, PSD, "
                "HDR, PIC or PNM image — re-create it or convert it to PNG");
  }
  const int c = channels != 0 ? channels : stored;
  // Phone photos store the sensor's rows and say how to turn them: applied as PIL's
  // exif_transpose, which Diffusers' DreamBooth scripts call on every image.
  return apply_exif_orientation(torch::from_blob(data.get(), {h, w, c}, torch::kUInt8).clone(),
                                exif_orientation(bytes));
}

std::string encode_jpeg(const torch::Tensor& image, int quality) {
  if (!image.defined() || image.dim() != 3 || image.scalar_type() != torch::kUInt8 ||
      image.size(2) < 1 || image.size(2) > 4 || image.size(0) < 1 || image.size(1) < 1 ||
      image.size(0) > 65535 || image.size(1) > 65535 || quality < 1 || quality > 100) {
    throw Error("encode_jpeg: the image is " + (image.defined() ? shape_str(image) : "undefined") +
                " at quality " + std::to_string(quality) +
                ": expected uint8 [H, W, C] with 1 <= H, W <= 65535, C 1..4 and quality 1..100");
  }
  const auto pixels = image.to(torch::kCPU).contiguous();
  std::string jpeg;
  if (stbi_write_jpg_to_func(append_bytes, &jpeg, static_cast<int>(pixels.size(1)),
                             static_cast<int>(pixels.size(0)), static_cast<int>(pixels.size(2)),
                             pixels.data_ptr<uint8_t>(), quality) == 0) {
    throw Error("encode_jpeg: stb_image_write could not encode the " + shape_str(image) + " image");
  }
  return jpeg;
}

bool webp_supported() { return DIFFTRAIN_HAVE_WEBP != 0; }

std::string encode_webp_lossless(const torch::Tensor& image) {
  if (!image.defined() || image.dim() != 3 || image.scalar_type() != torch::kUInt8 ||
      (image.size(2) != 3 && image.size(2) != 4) || image.size(0) < 1 || image.size(1) < 1 ||
      image.size(0) > 16383 || image.size(1) > 16383) {
    throw Error("encode_webp_lossless: the image is " +
                (image.defined() ? shape_str(image) : std::string("undefined")) +
                ": expected uint8 [H, W, 3 or 4] with 1 <= H, W <= 16383");
  }
#if DIFFTRAIN_HAVE_WEBP
  const auto pixels = image.to(torch::kCPU).contiguous();
  const int w = static_cast<int>(pixels.size(1)), h = static_cast<int>(pixels.size(0));
  uint8_t* out = nullptr;
  const size_t n = pixels.size(2) == 4
                       ? WebPEncodeLosslessRGBA(pixels.data_ptr<uint8_t>(), w, h, w * 4, &out)
                       : WebPEncodeLosslessRGB(pixels.data_ptr<uint8_t>(), w, h, w * 3, &out);
  std::unique_ptr<uint8_t, void (*)(void*)> owned(out, WebPFree);
  if (n == 0) throw Error("encode_webp_lossless: libwebp could not encode the image");
  return std::string(reinterpret_cast<const char*>(out), n);
#else
  throw Error("encode_webp_lossless: this difftrain was built without libwebp (libwebp-dev)");
#endif
}

torch::Tensor load_image(const std::string& path, int channels) {
  std::error_code ec;
  const auto status = std::filesystem::status(path, ec);
  if (!std::filesystem::exists(status)) {
    throw Error("cannot load image '" + path + "': no such file; check the path");
  }
  if (std::filesystem::is_directory(status)) {
    throw Error("cannot load image '" + path + "': it is a folder, not an image file");
  }
  return decode_image(read_file(path), path, channels);
}

torch::Tensor to_uint8_images(const torch::Tensor& images) {
  if (!images.defined() || images.dim() != 4 || !torch::isFloatingType(images.scalar_type())) {
    throw Error("to_uint8_images: images are " +
                (images.defined() ? shape_str(images) : std::string("undefined")) +
                ": expected floating point [N, C, H, W] in [0, 1] (decode latents and map "
                "(x / 2 + 0.5).clamp(0, 1) first)");
  }
  // Diffusers: images.cpu().permute(0, 2, 3, 1).float().numpy(); (images * 255).round().
  auto x = images.detach().to(torch::kCPU, torch::kFloat32).permute({0, 2, 3, 1});
  x = torch::nan_to_num(x, 0.0).clamp(0.0, 1.0);
  return x.mul(255.0f).round().to(torch::kUInt8).contiguous();
}

// ---------------------------------------------------------------- grid

torch::Tensor make_grid(const torch::Tensor& images, const std::vector<std::string>& labels,
                        int64_t columns, int64_t padding) {
  if (!images.defined() || images.dim() != 4 || images.scalar_type() != torch::kUInt8 ||
      images.size(0) < 1 || images.size(1) < 1 || images.size(2) < 1 ||
      (images.size(3) != 1 && images.size(3) != 3 && images.size(3) != 4)) {
    throw Error("make_grid: images are " +
                (images.defined() ? shape_str(images) : std::string("undefined")) +
                ": expected uint8 [N, H, W, C] with N, H, W >= 1 and C 1, 3 or 4 "
                "(to_uint8_images converts float [N, C, H, W] images)");
  }
  const int64_t n = images.size(0), h = images.size(1), w = images.size(2);
  if (!labels.empty() && static_cast<int64_t>(labels.size()) != n) {
    throw Error("make_grid: got " + std::to_string(labels.size()) + " labels for " +
                std::to_string(n) + " images: give one label per image, or none");
  }
  if (columns < 0 || padding < 0) {
    throw Error("make_grid: columns is " + std::to_string(columns) + " and padding " +
                std::to_string(padding) + ": both must be >= 0 (columns 0: a near-square grid)");
  }
  const int64_t cols = columns == 0
                           ? static_cast<int64_t>(std::ceil(std::sqrt(static_cast<double>(n))))
                           : std::min(columns, n);
  const int64_t rows = (n + cols - 1) / cols;

  // Cell size: the image, widened for short captions on small images, plus the caption strip.
  const int scale = w >= 256 ? 2 : 1;
  std::vector<std::string> text(labels.size());
  int widest = 0;
  for (size_t i = 0; i < labels.size(); ++i) {
    text[i] = printable(labels[i]);
    widest = std::max(widest, text_width(text[i]));
  }
  int64_t cell_w = w;
  std::vector<std::vector<std::string>> lines(labels.size());
  int64_t caption_h = 0;
  if (!labels.empty()) {
    cell_w = std::max<int64_t>(w, scale * std::min(widest + 2 * kMargin, kMaxCaptionWidth));
    const int max_text = static_cast<int>(cell_w / scale) - 2 * kMargin;
    size_t most_lines = 1;
    for (size_t i = 0; i < text.size(); ++i) {
      lines[i] = wrap(text[i], std::max(max_text, 1));
      most_lines = std::max(most_lines, lines[i].size());
    }
    caption_h = scale * (kMargin + static_cast<int64_t>(most_lines) * kLineHeight);
  }
  const int64_t cell_h = h + caption_h;
  const int64_t out_h = rows * cell_h + (rows + 1) * padding;
  const int64_t out_w = cols * cell_w + (cols + 1) * padding;

  auto rgb = images.to(torch::kCPU);
  if (rgb.size(3) == 1) rgb = rgb.expand({n, h, w, 3});
  if (rgb.size(3) == 4) rgb = rgb.narrow(3, 0, 3);
  auto grid = torch::full({out_h, out_w, 3}, 255, torch::kUInt8);
  uint8_t* pixels = grid.data_ptr<uint8_t>();
  for (int64_t i = 0; i < n; ++i) {
    const int64_t x0 = padding + (i % cols) * (cell_w + padding);
    const int64_t y0 = padding + (i / cols) * (cell_h + padding);
    grid.narrow(0, y0, h).narrow(1, x0 + (cell_w - w) / 2, w).copy_(rgb[i]);
    if (labels.empty()) continue;
    const Rect strip{x0, y0 + h, x0 + cell_w, y0 + cell_h};
    for (size_t l = 0; l < lines[i].size(); ++l) {
      const int64_t line_w = scale * static_cast<int64_t>(text_width(lines[i][l]));
      const int64_t x = x0 + std::max<int64_t>(0, (cell_w - line_w) / 2);
      const int64_t y = y0 + h + scale * (kMargin + static_cast<int64_t>(l) * kLineHeight);
      draw_text(pixels, out_w, lines[i][l], x, y, scale, strip);
    }
  }
  return grid;
}

torch::Tensor save_image_grid(const std::string& path, const torch::Tensor& images,
                              const std::vector<std::string>& labels, int64_t columns,
                              int64_t padding) {
  if (!images.defined() || (images.dim() != 4 && images.dim() != 5)) {
    throw Error("save_image_grid(" + path + "): images are " +
                (images.defined() ? shape_str(images) : std::string("undefined")) +
                ": expected float [K, H, W, C] in [0, 1] (Diffusers' output_type \"np\") or "
                "clips [K, F, H, W, C]");
  }
  if (images.dim() == 5) {
    // A clip is a row of its frames (whatever `columns` says): the clip's label under its first,
    // "frame f" under the rest.
    const int64_t K = images.size(0), F = images.size(1);
    std::vector<std::string> cells;
    if (!labels.empty()) {
      for (int64_t k = 0; k < K; ++k) {
        for (int64_t f = 0; f < F; ++f) {
          const auto at = static_cast<size_t>(k);
          cells.push_back(f > 0                ? "frame " + std::to_string(f)
                          : at < labels.size() ? labels[at]
                                               : "");
        }
      }
    }
    return save_image_grid(path, images.flatten(0, 1), cells, F, padding);
  }
  torch::Tensor grid =
      make_grid(to_uint8_images(images.permute({0, 3, 1, 2})), labels, columns, padding);
  save_png(path, grid);
  return grid;
}

std::array<int64_t, 2> image_size(const std::string& path) {
  // The header is at the start, except for JPEGs whose EXIF block comes first: read a prefix,
  // then the whole file when the prefix does not hold the size.
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    throw Error("cannot read image '" + path + "': " + std::strerror(errno) +
                "; check the path (metadata.jsonl file_name) and its permissions");
  }
  std::string bytes(256 * 1024, '\0');
  in.read(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  bytes.resize(static_cast<size_t>(in.gcount()));
  if (is_webp(bytes)) {
#if DIFFTRAIN_HAVE_WEBP
    int ww = 0, wh = 0;
    if (WebPGetInfo(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(), &ww, &wh) == 0) {
      throw Error("cannot load image '" + path + "': not a valid WebP file; convert it to PNG");
    }
    return {int64_t{wh}, int64_t{ww}};
#else
    throw Error("cannot load image '" + path +
                "': a WebP file, and this difftrain was built without libwebp (install "
                "libwebp-dev and rebuild), or convert it to PNG");
#endif
  }
  int w = 0, h = 0, c = 0;
  auto info = [&](const std::string& b) {
    return stbi_info_from_memory(reinterpret_cast<const stbi_uc*>(b.data()),
                                 static_cast<int>(b.size()), &w, &h, &c) != 0;
  };
  if (!info(bytes) && !(in.gcount() == 256 * 1024 && info(read_file(path)))) {
    std::string reason = stbi_failure_reason() ? stbi_failure_reason() : "unknown error";
    throw Error("cannot load image '" + path + "': " + reason +
                " (not a PNG, JPEG or BMP file?); convert it to PNG");
  }
  if (exif_orientation(bytes) >= 5) return {int64_t{w}, int64_t{h}};  // turned a quarter
  return {int64_t{h}, int64_t{w}};
}

}  // namespace difftrain::io
