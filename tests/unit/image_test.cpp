// Images: PNG round trips, one-line load errors naming the path, Diffusers' float → uint8
// rounding, and the grid layout with captions drawn only in the caption strips.

#include "difftrain/io/image.h"
#include "difftrain/core/error.h"
#include "difftrain/io/atomic_file.h"

#include "test_util.h"

#include <gtest/gtest.h>
#include <torch/torch.h>

#include <zlib.h>

#include <array>
#include <cmath>
#include <filesystem>
#include <limits>

namespace {

using difftrain::test::error_of;
using difftrain::test::temp_dir;

namespace fs = std::filesystem;
using difftrain::io::load_image;
using difftrain::io::make_grid;
using difftrain::io::save_png;

torch::Tensor random_image(int64_t h, int64_t w, int64_t c, uint64_t seed) {
  auto gen = at::detail::createCPUGenerator(seed);
  return at::randint(0, 256, {h, w, c}, gen, torch::kInt64).to(torch::kUInt8);
}

TEST(ImagePng, RoundTripIsExact) {
  const auto dir = temp_dir("png");
  for (int64_t c : {1, 3, 4}) {
    SCOPED_TRACE(c);
    const auto image = random_image(17, 23, c, 100 + c);
    const std::string path = dir + "/img" + std::to_string(c) + ".png";
    save_png(path, image);
    const auto back = load_image(path, 0);  // as stored
    EXPECT_EQ(back.sizes(), image.sizes());
    EXPECT_TRUE(torch::equal(back, image));
    EXPECT_TRUE(torch::equal(load_image(path, static_cast<int>(c)), image));
  }
  // Grey read as RGB repeats the grey value (PIL's convert("RGB")); a non-contiguous view saves.
  const auto grey = random_image(5, 7, 1, 7);
  save_png(dir + "/grey.png", grey);
  EXPECT_TRUE(torch::equal(load_image(dir + "/grey.png"), grey.expand({5, 7, 3})));
  const auto rgb = random_image(9, 6, 3, 8).transpose(0, 1);
  save_png(dir + "/t.png", rgb);
  EXPECT_TRUE(torch::equal(load_image(dir + "/t.png"), rgb));
  // Written atomically: no temporary file is left beside the images.
  int files = 0;
  for (const auto& entry : fs::directory_iterator(dir)) {
    EXPECT_EQ(entry.path().extension(), ".png") << entry.path();
    ++files;
  }
  EXPECT_EQ(files, 5);
  EXPECT_HAS(error_of([&] { save_png(dir + "/f.png", torch::zeros({4, 4, 3})); }), "uint8");
  EXPECT_HAS(error_of([&] {
               save_png(dir + "/f.png", torch::zeros({4, 4, 5}, torch::kUInt8));
             }),
             "[4, 4, 5]");
  fs::remove_all(dir);
}

// An EXIF block (TIFF) holding only the Orientation tag, big- or little-endian.
std::string exif_tiff(int orientation, bool little) {
  auto u16 = [&](uint32_t v) {
    return little ? std::string{char(v & 0xff), char(v >> 8)}
                  : std::string{char(v >> 8), char(v & 0xff)};
  };
  auto u32 = [&](uint32_t v) {
    return little ? u16(v & 0xffff) + u16(v >> 16) : u16(v >> 16) + u16(v & 0xffff);
  };
  return std::string(little ? "II" : "MM") + u16(42) + u32(8) + u16(1) + u16(0x0112) + u16(3) +
         u32(1) + u16(static_cast<uint32_t>(orientation)) + u16(0) + u32(0);
}

std::string be32(size_t v) {
  return {char(v >> 24), char((v >> 16) & 0xff), char((v >> 8) & 0xff), char(v & 0xff)};
}

// The image PIL's exif_transpose returns, written pixel by pixel from PIL's definitions of its
// transpose methods (out(x, y) = in(...)), independently of the code under test.
torch::Tensor pil_exif_transpose(const torch::Tensor& in, int orientation) {
  const int64_t H = in.size(0), W = in.size(1);
  const bool swap = orientation >= 5;
  auto out = torch::empty({swap ? W : H, swap ? H : W, in.size(2)}, in.options());
  for (int64_t y = 0; y < out.size(0); ++y) {
    for (int64_t x = 0; x < out.size(1); ++x) {
      int64_t sx = x, sy = y;
      switch (orientation) {
        case 2: sx = W - 1 - x; break;                  // FLIP_LEFT_RIGHT
        case 3: sx = W - 1 - x, sy = H - 1 - y; break;  // ROTATE_180
        case 4: sy = H - 1 - y; break;                  // FLIP_TOP_BOTTOM
        case 5: sx = y, sy = x; break;                  // TRANSPOSE
        case 6: sx = y, sy = H - 1 - x; break;          // ROTATE_270
        case 7: sx = W - 1 - y, sy = H - 1 - x; break;  // TRANSVERSE
        case 8: sx = W - 1 - y, sy = x; break;          // ROTATE_90
        default: break;
      }
      out[y][x] = in[sy][sx];
    }
  }
  return out;
}

// Phone photos (issue 38): every EXIF orientation of a JPEG (APP1) and a PNG (eXIf) comes out as
// PIL's exif_transpose makes it, and image_size reports the turned size.
TEST(ImageLoad, ExifOrientationIsAppliedAsPilDoes) {
  const auto dir = temp_dir("img_exif");
  const auto image = torch::arange(2 * 3 * 3, torch::kInt64)
                         .mul(13)
                         .remainder(256)
                         .to(torch::kUInt8)
                         .reshape({2, 3, 3});  // H 2, W 3: every pixel distinct
  const std::string png = difftrain::io::encode_png(image);
  const std::string jpeg = difftrain::io::encode_jpeg(image, 100);
  const auto jpeg_plain = difftrain::io::decode_image(jpeg, "plain.jpg");
  for (int o = 1; o <= 8; ++o) {
    for (bool little : {false, true}) {
      const std::string tiff = exif_tiff(o, little);
      // JPEG: an APP1 segment "Exif\0\0" + TIFF right after SOI.
      const std::string app1 =
          std::string("\xFF\xE1", 2) +
          std::string{char((tiff.size() + 8) >> 8), char((tiff.size() + 8) & 0xff)} +
          std::string("Exif\0\0", 6) + tiff;
      const std::string oriented_jpeg = jpeg.substr(0, 2) + app1 + jpeg.substr(2);
      // PNG: an eXIf chunk after IHDR (8-byte signature + 25-byte IHDR chunk).
      const std::string body = "eXIf" + tiff;
      const uLong crc = crc32(0, reinterpret_cast<const Bytef*>(body.data()), body.size());
      const std::string oriented_png =
          png.substr(0, 33) + be32(tiff.size()) + body + be32(crc) + png.substr(33);
      const std::string jpg_path = dir + "/o" + std::to_string(o) + ".jpg";
      const std::string png_path = dir + "/o" + std::to_string(o) + ".png";
      difftrain::io::write_file_atomic(jpg_path, oriented_jpeg);
      difftrain::io::write_file_atomic(png_path, oriented_png);
      const auto want_png = pil_exif_transpose(image, o);
      const auto want_jpg = pil_exif_transpose(jpeg_plain, o);
      EXPECT_TRUE(torch::equal(load_image(png_path), want_png)) << "PNG orientation " << o;
      EXPECT_TRUE(torch::equal(load_image(jpg_path), want_jpg)) << "JPEG orientation " << o;
      const std::array<int64_t, 2> size = {want_png.size(0), want_png.size(1)};
      EXPECT_EQ(difftrain::io::image_size(png_path), size) << o;
      EXPECT_EQ(difftrain::io::image_size(jpg_path), size) << o;
    }
  }
}

TEST(ImageLoad, ErrorsNameThePath) {
  const auto dir = temp_dir("load");
  std::vector<std::string> messages;
  const std::string missing = dir + "/missing.png";
  auto msg = messages.emplace_back(error_of([&] { load_image(missing); }));
  std::printf("missing: %s\n", msg.c_str());
  EXPECT_HAS(msg, missing);
  EXPECT_HAS(msg, "no such file");

  const std::string corrupt = dir + "/corrupt.png";
  difftrain::io::write_file_atomic(corrupt, "this is not an image at all");
  msg = messages.emplace_back(error_of([&] { load_image(corrupt); }));
  std::printf("corrupt: %s\n", msg.c_str());
  EXPECT_HAS(msg, corrupt);
  EXPECT_HAS(msg, "corrupt");

  // A PNG cut in half: the signature is right, the data is not.
  const auto png = difftrain::io::encode_png(random_image(32, 32, 3, 1));
  const std::string truncated = dir + "/truncated.png";
  difftrain::io::write_file_atomic(truncated, png.substr(0, png.size() / 2));
  msg = messages.emplace_back(error_of([&] { load_image(truncated); }));
  std::printf("truncated: %s\n", msg.c_str());
  EXPECT_HAS(msg, truncated);

  const std::string webp = dir + "/image.webp";  // a format stb_image does not read
  difftrain::io::write_file_atomic(
      webp, std::string("RIFF\x24\0\0\0WEBPVP8 ", 16) + std::string(40, '\0'));
  msg = messages.emplace_back(error_of([&] { load_image(webp); }));
  std::printf("webp: %s\n", msg.c_str());
  EXPECT_HAS(msg, webp);

  // A bare 54-byte BMP header claiming 10000 x 10000 pixels: refused before decoding (stb_image
  // would read the missing pixels as zeros and allocate 300 MB).
  std::string bmp(54, '\0');
  auto put32 = [&](size_t at, uint32_t v) {
    for (int i = 0; i < 4; ++i) bmp[at + i] = static_cast<char>((v >> (8 * i)) & 0xff);
  };
  bmp[0] = 'B';
  bmp[1] = 'M';
  put32(2, 54);   // file size
  put32(10, 54);  // pixel data offset
  put32(14, 40);  // BITMAPINFOHEADER
  put32(18, 10000);
  put32(22, 10000);
  bmp[26] = 1;   // planes
  bmp[28] = 24;  // bits per pixel
  const std::string bomb = dir + "/bomb.bmp";
  difftrain::io::write_file_atomic(bomb, bmp);
  msg = messages.emplace_back(error_of([&] { load_image(bomb); }));
  std::printf("header bomb: %s\n", msg.c_str());
  EXPECT_HAS(msg, bomb);
  EXPECT_HAS(msg, "10000x10000 pixels, more than a file of 54 bytes can hold");

  EXPECT_HAS(error_of([&] { load_image(dir); }), "folder");
  EXPECT_HAS(error_of([&] { load_image(truncated, 5); }), "channels");
  for (const auto& m : messages) EXPECT_EQ(m.find('\n'), std::string::npos) << m;
  fs::remove_all(dir);
}

// WebP (libwebp): a lossless file decodes to its pixels exactly, alpha is dropped for RGB as
// PIL's convert("RGB") does, grey is stb's luminance, and image_size reads the header (issue 56:
// kohya and Diffusers train on .webp files).
TEST(ImageLoad, WebpDecodesExactlyAndConverts) {
  ASSERT_TRUE(difftrain::io::webp_supported()) << "built without libwebp-dev (scripts/setup)";
  const auto dir = temp_dir("webp");
  const auto rgb = random_image(7, 5, 3, 11);
  const std::string path = dir + "/a.webp";
  difftrain::io::write_file_atomic(path, difftrain::io::encode_webp_lossless(rgb));
  EXPECT_TRUE(torch::equal(load_image(path, 3), rgb));
  EXPECT_EQ(difftrain::io::image_size(path), (std::array<int64_t, 2>{7, 5}));
  const auto rgba = random_image(6, 9, 4, 12);
  const auto bytes = difftrain::io::encode_webp_lossless(rgba);
  EXPECT_TRUE(torch::equal(difftrain::io::decode_image(bytes, "rgba.webp", 4), rgba));
  EXPECT_TRUE(
      torch::equal(difftrain::io::decode_image(bytes, "rgba.webp", 3), rgba.narrow(2, 0, 3)));
  EXPECT_EQ(difftrain::io::decode_image(bytes, "rgba.webp", 0).size(2), 4);
  const auto px = rgba.to(torch::kInt64);
  const auto grey =
      (px.select(2, 0) * 77 + px.select(2, 1) * 150 + px.select(2, 2) * 29).div(256, "floor");
  EXPECT_TRUE(torch::equal(
      difftrain::io::decode_image(bytes, "rgba.webp", 1).squeeze(2).to(torch::kInt64), grey));
  // Damaged data names the file.
  EXPECT_HAS(error_of([&] {
               difftrain::io::decode_image(bytes.substr(0, bytes.size() / 2), "cut.webp", 3);
             }),
             "cut.webp");
  fs::remove_all(dir);
}

TEST(ImageConvert, ToUint8RoundsLikeDiffusers) {
  const float nan = std::numeric_limits<float>::quiet_NaN();
  // [1, 1, 1, 8]: (x * 255).round() with clamping; 0.25 → 63.75 → 64, 0.75 → 191.25 → 191.
  const auto x =
      torch::tensor({0.0f, 1.0f, 0.5f, 0.25f, 0.75f, -0.2f, 1.3f, nan}).view({1, 1, 1, 8});
  const auto got = difftrain::io::to_uint8_images(x);
  const auto expected = torch::tensor({0, 255, 128, 64, 191, 0, 255, 0}, torch::kUInt8);
  EXPECT_TRUE(torch::equal(got.flatten(), expected)) << got;

  // NCHW → NHWC, and any float dtype.
  auto gen = at::detail::createCPUGenerator(3);
  const auto images = at::rand({2, 3, 4, 5}, gen, torch::kFloat64);
  const auto u8 = difftrain::io::to_uint8_images(images.to(torch::kFloat16));
  EXPECT_EQ(u8.sizes(), (std::vector<int64_t>{2, 4, 5, 3}));
  const auto ref =
      images.to(torch::kFloat16).to(torch::kFloat32).permute({0, 2, 3, 1}).mul(255.0f).round();
  EXPECT_TRUE(torch::equal(u8, ref.to(torch::kUInt8)));
  EXPECT_HAS(error_of([&] {
               difftrain::io::to_uint8_images(torch::zeros({3, 4, 4}, torch::kUInt8));
             }),
             "[N, C, H, W]");
}

TEST(ImageGrid, SizeArithmeticAndPlacement) {
  const int64_t n = 5, h = 16, w = 16, pad = 2;
  auto gen = at::detail::createCPUGenerator(4);
  const auto images = at::randint(0, 256, {n, h, w, 3}, gen, torch::kInt64).to(torch::kUInt8);
  struct Case {
    int64_t columns, cols, rows;
  };
  for (const Case& c :
       {Case{0, 3, 2}, Case{2, 2, 3}, Case{1, 1, 5}, Case{5, 5, 1}, Case{9, 5, 1}}) {
    SCOPED_TRACE(c.columns);
    const auto grid = make_grid(images, {}, c.columns, pad);
    EXPECT_EQ(grid.sizes(), (std::vector<int64_t>{c.rows * h + (c.rows + 1) * pad,
                                                  c.cols * w + (c.cols + 1) * pad, 3}));
    for (int64_t i = 0; i < n; ++i) {
      const int64_t y = pad + (i / c.cols) * (h + pad), x = pad + (i % c.cols) * (w + pad);
      EXPECT_TRUE(torch::equal(grid.narrow(0, y, h).narrow(1, x, w), images[i])) << i;
    }
    // Padding and empty cells are background (white): the image pixels are all there is.
    EXPECT_EQ(grid.ne(255).any(-1).sum().item<int64_t>(),
              images.ne(255).any(-1).sum().item<int64_t>());
  }
  EXPECT_EQ(make_grid(images, {}, 0, 0).sizes(), (std::vector<int64_t>{32, 48, 3}));
  // Grey shows as grey; alpha is dropped.
  const auto grey = images.narrow(3, 0, 1);
  EXPECT_TRUE(
      torch::equal(make_grid(grey, {}, 5, 0), torch::cat(grey.unbind(0), 1).expand({h, n * w, 3})));
  const auto rgba = torch::cat({images, torch::zeros({n, h, w, 1}, torch::kUInt8)}, 3);
  EXPECT_TRUE(torch::equal(make_grid(rgba, {}, 2, pad), make_grid(images, {}, 2, pad)));

  EXPECT_HAS(error_of([&] { make_grid(images, {"a", "b"}); }), "2 labels for 5 images");
  EXPECT_HAS(error_of([&] { make_grid(images.to(torch::kFloat32)); }), "uint8 [N, H, W, C]");
  EXPECT_HAS(error_of([&] { make_grid(images, {}, -1); }), "columns");
}

TEST(ImageGrid, LabelsDrawOnlyInTheCaptionStrip) {
  const int64_t n = 3, h = 16, w = 16, pad = 2, cols = 3;
  // Constant-coloured images: any change inside an image area would show.
  auto images = torch::empty({n, h, w, 3}, torch::kUInt8);
  images.select(3, 0).fill_(40);
  images.select(3, 1).fill_(160);
  images.select(3, 2).fill_(90);
  const std::vector<std::string> labels = {"seed 0", "step 10", ""};
  const auto grid = make_grid(images, labels, cols, pad);
  const auto plain = make_grid(images, {}, cols, pad);
  // One line of caption: 2 + 12 pixels under each image; captions widen the cells.
  const int64_t caption = grid.size(0) - plain.size(0);
  EXPECT_EQ(caption, 14);
  const int64_t cell_w = (grid.size(1) - (cols + 1) * pad) / cols;
  EXPECT_EQ(grid.size(1), cols * cell_w + (cols + 1) * pad);
  EXPECT_GT(cell_w, w);
  EXPECT_LE(cell_w, 160);
  for (int64_t i = 0; i < n; ++i) {
    SCOPED_TRACE(i);
    const int64_t x0 = pad + i * (cell_w + pad);
    const auto cell = grid.narrow(0, pad, h + caption).narrow(1, x0, cell_w);
    const int64_t xi = (cell_w - w) / 2;
    EXPECT_TRUE(torch::equal(cell.narrow(0, 0, h).narrow(1, xi, w), images[i]));
    // Beside the image, inside the cell: background.
    EXPECT_TRUE(cell.narrow(0, 0, h).narrow(1, 0, xi).eq(255).all().item<bool>());
    const auto strip = cell.narrow(0, h, caption);
    const int64_t inked = strip.ne(255).any(-1).sum().item<int64_t>();
    std::printf("label '%s': %lld inked pixels in its %lldx%lld caption strip\n", labels[i].c_str(),
                static_cast<long long>(inked), static_cast<long long>(caption),
                static_cast<long long>(cell_w));
    if (labels[i].empty()) {
      EXPECT_EQ(inked, 0);
    } else {
      EXPECT_GT(inked, 20);
      EXPECT_TRUE(strip.eq(0).all(-1).logical_or(strip.eq(255).all(-1)).all().item<bool>());
    }
  }
  // All ink is inside the strips: with them blanked, only the images' pixels are not white.
  auto blanked = grid.clone();
  for (int64_t i = 0; i < n; ++i) {
    blanked.narrow(0, pad + h, caption).narrow(1, pad + i * (cell_w + pad), cell_w).fill_(255);
  }
  EXPECT_EQ(blanked.ne(255).any(-1).sum().item<int64_t>(), n * h * w);

  // A long label wraps onto at most 3 lines; a large image gets the 2x font.
  const std::string prompt =
      "a photograph of an astronaut riding a horse on the moon, highly "
      "detailed, 8k, trending on artstation, by greg rutkowski";
  const auto wrapped = make_grid(images.narrow(0, 0, 1), {prompt}, 1, 0);
  EXPECT_EQ(wrapped.size(0) - h, 2 + 3 * 12);
  EXPECT_EQ(wrapped.size(1), 160);
  const auto big = torch::full({1, 256, 256, 3}, 128, torch::kUInt8);
  const auto big_grid = make_grid(big, {"seed 0 \xC3\xA9t\xC3\xA9"}, 1, 0);
  EXPECT_EQ(big_grid.size(0), 256 + 2 * 14);
  EXPECT_EQ(big_grid.size(1), 256);
  EXPECT_TRUE(big_grid.narrow(0, 256, 28).ne(255).any().item<bool>());
  // One '?' per UTF-8 character, not per byte.
  EXPECT_TRUE(torch::equal(big_grid, make_grid(big, {"seed 0 ?t?"}, 1, 0)));
}

}  // namespace
