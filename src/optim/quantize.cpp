#include "difftrain/optim/quantize.h"

#include "difftrain/core/error.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace difftrain::optim {
namespace {

// torch.linspace(start, end, steps) in float32, with its two-sided evaluation.
std::vector<float> linspace_f32(float start, float end, int64_t steps) {
  std::vector<float> out(steps);
  const float step = (end - start) / static_cast<float>(steps - 1);
  const int64_t halfway = steps / 2;
  for (int64_t i = 0; i < steps; ++i) {
    out[i] = i < halfway ? start + step * static_cast<float>(i)
                         : end - step * static_cast<float>(steps - i - 1);
  }
  return out;
}

std::array<float, 256> make_map(bool is_signed) {
  // bitsandbytes: 7 exponent bits; 7 non-sign bits for both signed and unsigned maps, so the
  // unsigned map spends the sign bit on a finer fraction.
  constexpr int kExponentBits = 7;
  constexpr int kNonSignBits = 7;
  std::vector<float> data;
  for (int i = 0; i < kExponentBits; ++i) {
    const int64_t items = is_signed ? (int64_t{1} << (i + kNonSignBits - kExponentBits)) + 1
                                    : (int64_t{1} << (i + kNonSignBits - kExponentBits + 1)) + 1;
    auto bounds = linspace_f32(0.1f, 1.0f, items);
    const float scale = static_cast<float>(std::pow(10.0, -(kExponentBits - 1) + i));
    for (int64_t k = 0; k + 1 < items; ++k) {
      const float mean = (bounds[k] + bounds[k + 1]) / 2.0f;
      data.push_back(scale * mean);
      if (is_signed) data.push_back(-(scale * mean));
    }
  }
  data.push_back(0.0f);
  data.push_back(1.0f);
  std::sort(data.begin(), data.end());
  std::array<float, 256> out{};
  std::copy(data.begin(), data.end(), out.begin());
  return out;
}

// Midpoints between neighbouring codes: the decision boundaries of nearest rounding.
std::array<float, 255> make_midpoints(const std::array<float, 256>& map) {
  std::array<float, 255> mid{};
  for (size_t k = 0; k < 255; ++k) mid[k] = (map[k] + map[k + 1]) / 2.0f;
  return mid;
}

const std::array<float, 255>& midpoints(bool is_signed) {
  static const auto kSigned = make_midpoints(dynamic_code_map(true));
  static const auto kUnsigned = make_midpoints(dynamic_code_map(false));
  return is_signed ? kSigned : kUnsigned;
}

}  // namespace

const std::array<float, 256>& dynamic_code_map(bool is_signed) {
  static const auto kSigned = make_map(true);
  static const auto kUnsigned = make_map(false);
  return is_signed ? kSigned : kUnsigned;
}

namespace {

// Count of midpoints below x: branch-free binary search over the 255 sorted midpoints.
int count_below(const std::array<float, 255>& mid, float x) {
  int idx = 0;
  for (int step = 128; step >= 1; step >>= 1) idx += (mid[idx + step - 1] < x) ? step : 0;
  return idx;
}

// A lookup table on the top 17 bits of x's float encoding (sign, exponent, 8 mantissa bits):
// for every bucket of floats sharing them, the nearest-code index of the bucket's smallest
// value. The buckets are narrower (0.4% relative) than the code spacing wherever codes are
// dense, so the exact answer is at most a step or two above the table's.
struct Lut {
  std::vector<uint8_t> start;
  explicit Lut(const std::array<float, 255>& mid) : start(1u << 17) {
    for (uint32_t key = 0; key < (1u << 17); ++key) {
      const bool negative = key >> 16;
      // The smallest value of the bucket: its lowest magnitude when positive, highest when
      // negative.
      uint32_t bits = key << 15;
      if (negative) bits |= 0x7fffu;
      float x;
      std::memcpy(&x, &bits, sizeof x);
      if (std::isnan(x)) x = negative ? -INFINITY : INFINITY;
      start[key] = static_cast<uint8_t>(count_below(mid, x));
    }
  }
};

const Lut& lut(bool is_signed) {
  static const Lut kSigned(midpoints(true));
  static const Lut kUnsigned(midpoints(false));
  return is_signed ? kSigned : kUnsigned;
}

}  // namespace

uint8_t quantize_nearest(float x, bool is_signed) {
  const auto& mid = midpoints(is_signed);
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  int idx = lut(is_signed).start[bits >> 15];
  while (idx < 255 && mid[idx] < x) ++idx;
  return static_cast<uint8_t>(idx);
}

QuantizedBlocks quantize_blockwise(const torch::Tensor& x, bool is_signed, int64_t block) {
  if (block <= 0) throw Error("quantize_blockwise: block size must be positive");
  auto flat = x.detach().to(torch::kCPU, torch::kFloat32).contiguous().view(-1);
  const int64_t n = flat.numel();
  const int64_t blocks = (n + block - 1) / block;
  QuantizedBlocks q{torch::empty(x.sizes(), torch::kUInt8),
                    torch::zeros({blocks}, torch::kFloat32)};
  const float* in = flat.data_ptr<float>();
  uint8_t* codes = q.codes.data_ptr<uint8_t>();
  float* absmax = q.absmax.data_ptr<float>();
  const uint8_t zero = quantize_nearest(0.0f, is_signed);
  at::parallel_for(0, blocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t begin = b * block, end = std::min(n, begin + block);
      float amax = 0.0f;
      for (int64_t i = begin; i < end; ++i) amax = std::max(amax, std::fabs(in[i]));
      absmax[b] = amax;
      const float inv = amax > 0.0f ? 1.0f / amax : 0.0f;
      for (int64_t i = begin; i < end; ++i) {
        codes[i] = amax > 0.0f ? quantize_nearest(in[i] * inv, is_signed) : zero;
      }
    }
  });
  return q;
}

torch::Tensor dequantize_blockwise(const QuantizedBlocks& q, bool is_signed, int64_t block) {
  const auto& map = dynamic_code_map(is_signed);
  auto codes = q.codes.contiguous();
  auto absmax = q.absmax.to(torch::kFloat32).contiguous();
  const int64_t n = codes.numel();
  if (absmax.numel() != (n + block - 1) / block) {
    throw Error("dequantize_blockwise: " + std::to_string(absmax.numel()) + " absmax values for " +
                std::to_string(n) + " codes in blocks of " + std::to_string(block));
  }
  auto out = torch::empty(codes.sizes(), torch::kFloat32);
  const uint8_t* c = codes.data_ptr<uint8_t>();
  const float* a = absmax.data_ptr<float>();
  float* o = out.data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) o[i] = map[c[i]] * a[i / block];
  return out;
}

}  // namespace difftrain::optim
