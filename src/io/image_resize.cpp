// PIL's resampling (Image.resize for 8-bit images), restated: per output pixel a window of input
// pixels around its centre, weighted by the filter at (input centre - output centre) / scale,
// the weights normalised, then rounded to fixed point so that the sums are integers.

#include "difftrain/core/error.h"
#include "difftrain/io/image.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace difftrain::io {
namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;

struct Filter {
  double support;
  double (*weight)(double);
};

double bilinear(double x) {
  x = std::abs(x);
  return x < 1.0 ? 1.0 - x : 0.0;
}

double bicubic(double x) {
  constexpr double a = -0.5;
  x = std::abs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1;
  if (x < 2.0) return (((x - 5) * x + 8) * x - 4) * a;
  return 0.0;
}

double sinc(double x) {
  if (x == 0.0) return 1.0;
  x *= M_PI;
  return std::sin(x) / x;
}

double lanczos(double x) { return (-3.0 <= x && x < 3.0) ? sinc(x) * sinc(x / 3) : 0.0; }

Filter filter_of(Resample r) {
  switch (r) {
    case Resample::kBilinear: return {1.0, bilinear};
    case Resample::kBicubic: return {2.0, bicubic};
    case Resample::kLanczos: return {3.0, lanczos};
  }
  return {2.0, bicubic};
}

// For each output index: the first input index, the count, and `ksize` fixed-point weights.
struct Coefficients {
  int64_t ksize = 0;
  std::vector<int64_t> first, count;
  std::vector<int32_t> weights;
};

Coefficients coefficients(int64_t in_size, int64_t out_size, const Filter& f) {
  const double scale = static_cast<double>(in_size) / static_cast<double>(out_size);
  const double filterscale = std::max(scale, 1.0);
  const double support = f.support * filterscale;
  Coefficients c;
  c.ksize = static_cast<int64_t>(std::ceil(support)) * 2 + 1;
  c.first.resize(out_size);
  c.count.resize(out_size);
  c.weights.assign(out_size * c.ksize, 0);
  std::vector<double> k(c.ksize);
  for (int64_t xx = 0; xx < out_size; ++xx) {
    const double center = (static_cast<double>(xx) + 0.5) * scale;
    const double ss = 1.0 / filterscale;
    // (int) of PIL: truncation toward zero, then clamped.
    const int64_t xmin = std::max<int64_t>(static_cast<int64_t>(center - support + 0.5), 0);
    const int64_t xmax =
        std::min<int64_t>(static_cast<int64_t>(center + support + 0.5), in_size) - xmin;
    double ww = 0.0;
    for (int64_t x = 0; x < xmax; ++x) {
      k[x] = f.weight((static_cast<double>(x + xmin) - center + 0.5) * ss);
      ww += k[x];
    }
    for (int64_t x = 0; x < xmax; ++x) {
      double w = ww != 0.0 ? k[x] / ww : k[x];
      w *= static_cast<double>(1 << kPrecisionBits);
      c.weights[xx * c.ksize + x] = static_cast<int32_t>(w < 0 ? -0.5 + w : 0.5 + w);
    }
    c.first[xx] = xmin;
    c.count[xx] = xmax;
  }
  return c;
}

uint8_t clip8(int32_t v) {
  return static_cast<uint8_t>(std::clamp<int32_t>(v >> kPrecisionBits, 0, 255));
}

}  // namespace

torch::Tensor resize_image(const torch::Tensor& image, int64_t height, int64_t width,
                           Resample filter) {
  if (image.scalar_type() != torch::kUInt8 || image.dim() != 3) {
    throw Error("resize_image: expected a uint8 image [H, W, C], got " +
                std::string(c10::toString(image.scalar_type())) + " of " +
                std::to_string(image.dim()) + " dimensions");
  }
  if (height < 1 || width < 1) {
    throw Error("resize_image: the size must be at least 1 x 1, got " + std::to_string(height) +
                " x " + std::to_string(width));
  }
  const torch::Tensor in = image.to(torch::kCPU).contiguous();
  const int64_t h = in.size(0), w = in.size(1), ch = in.size(2);
  if (h == height && w == width) return in.clone();
  const Filter f = filter_of(filter);
  torch::Tensor current = in;
  if (w != width) {
    const Coefficients c = coefficients(w, width, f);
    torch::Tensor out = torch::empty({h, width, ch}, torch::kUInt8);
    const uint8_t* src = current.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    for (int64_t y = 0; y < h; ++y) {
      for (int64_t xx = 0; xx < width; ++xx) {
        const int32_t* k = &c.weights[xx * c.ksize];
        for (int64_t cc = 0; cc < ch; ++cc) {
          int32_t ss = 1 << (kPrecisionBits - 1);
          for (int64_t x = 0; x < c.count[xx]; ++x) {
            ss += static_cast<int32_t>(src[(y * w + c.first[xx] + x) * ch + cc]) * k[x];
          }
          dst[(y * width + xx) * ch + cc] = clip8(ss);
        }
      }
    }
    current = out;
  }
  if (h != height) {
    const Coefficients c = coefficients(h, height, f);
    torch::Tensor out = torch::empty({height, width, ch}, torch::kUInt8);
    const uint8_t* src = current.data_ptr<uint8_t>();
    uint8_t* dst = out.data_ptr<uint8_t>();
    for (int64_t yy = 0; yy < height; ++yy) {
      const int32_t* k = &c.weights[yy * c.ksize];
      for (int64_t x = 0; x < width; ++x) {
        for (int64_t cc = 0; cc < ch; ++cc) {
          int32_t ss = 1 << (kPrecisionBits - 1);
          for (int64_t y = 0; y < c.count[yy]; ++y) {
            ss += static_cast<int32_t>(src[((c.first[yy] + y) * width + x) * ch + cc]) * k[y];
          }
          dst[(yy * width + x) * ch + cc] = clip8(ss);
        }
      }
    }
    current = out;
  }
  return current;
}

}  // namespace difftrain::io
