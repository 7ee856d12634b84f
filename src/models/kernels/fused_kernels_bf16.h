// The fused CPU kernels over bf16 (or float32) values, computed in float32 and rounded once: GELU
// and attention's softmax. Part of fused_kernels_impl.h's body (it includes this file at its end,
// after the helpers used here: row_max, exp_shifted, dot); compiled per instruction set with it.
// No include guard on purpose.

// ------------------------------------------------------------------ GELU

namespace {

constexpr int64_t kGeluBlock = 1024;  // values converted to float32 at a time (4 KiB, in L1)

float bf16_bits_to_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
}

// Rounds to nearest, ties to even, as c10::BFloat16 does (NaN to 0x7FC0).
uint16_t float_to_bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return static_cast<uint16_t>(f != f ? 0x7FC0u : (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

void load_floats(const void* src, bool bf16, int64_t offset, int64_t n, float* dst) {
  if (!bf16) {
    std::memcpy(dst, static_cast<const float*>(src) + offset, static_cast<size_t>(n) * 4);
    return;
  }
  const uint16_t* s = static_cast<const uint16_t*>(src) + offset;
  for (int64_t i = 0; i < n; ++i) dst[i] = bf16_bits_to_float(s[i]);
}

void store_floats(const float* src, bool bf16, int64_t offset, int64_t n, void* dst) {
  if (!bf16) {
    std::memcpy(static_cast<float*>(dst) + offset, src, static_cast<size_t>(n) * 4);
    return;
  }
  uint16_t* d = static_cast<uint16_t*>(dst) + offset;
  for (int64_t i = 0; i < n; ++i) d[i] = float_to_bf16_bits(src[i]);
}

// torch's GELU formulas (ATen's GeluKernel), in float32: the tanh approximation
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) and the exact x Phi(x), and their derivatives.
const float kGeluBeta = static_cast<float>(M_SQRT2 * M_2_SQRTPI * 0.5);
const float kGeluKappa = 0.044715f;
const float kGeluAlpha = static_cast<float>(M_2_SQRTPI * M_SQRT1_2 * 0.5);
const float kSqrtHalf = static_cast<float>(M_SQRT1_2);

// The tanh form through 0.5 (1 + tanh(u)) = sigmoid(2u) = 1 / (1 + e^(-2u)): one inline exp
// (fast_exp) where Sleef's tanh was an out-of-line call and two thirds of the backward's time.
Vec gelu_value(const Vec& x, bool tanh_approximation) {
  if (tanh_approximation) {
    const Vec inner = Vec(kGeluBeta) * (x + Vec(kGeluKappa) * (x * x * x));
    return x / (Vec(1.f) + fast_exp(Vec(-2.f) * inner));
  }
  return x * Vec(0.5f) * (Vec(1.f) + (x * Vec(kSqrtHalf)).erf());
}

// dy * d gelu(x) / dx
Vec gelu_grad(const Vec& dy, const Vec& x, bool tanh_approximation) {
  if (tanh_approximation) {
    // d/dx x·s with s = sigmoid(2u): s + 2x·s(1 − s)·u', and s(1 − s) = e·s² for e = e^(-2u)
    // (no cancellation where s is near 1); it is the tanh form's 0.5(1 + t) + 0.5x(1 − t²)u'.
    const Vec x_sq = x * x;
    const Vec inner = Vec(kGeluBeta) * (x + Vec(kGeluKappa) * (x_sq * x));
    // e capped at e^80 (fast_exp's e^88.7 is inf, and inf · 0 NaN): where it binds, s is 0 in
    // bf16 terms either way.
    const Vec e = fast_exp(at::vec::minimum(Vec(-2.f) * inner, Vec(80.f)));
    const Vec sig = Vec(1.f) / (Vec(1.f) + e);
    const Vec inner_derivative = Vec(kGeluBeta) * (Vec(1.f) + Vec(3.f * kGeluKappa) * x_sq);
    return dy * (sig + Vec(2.f) * x * (e * sig * sig) * inner_derivative);
  }
  const Vec cdf = Vec(0.5f) * (Vec(1.f) + (x * Vec(kSqrtHalf)).erf());
  const Vec pdf = Vec(kGeluAlpha) * (Vec(-0.5f) * x * x).exp();
  return dy * (cdf + x * pdf);
}

// f(i, count) over [0, n) in blocks of kGeluBlock, blocks spread over the threads.
template <typename F>
void for_gelu_blocks(int64_t n, const F& f) {
  const int64_t blocks = (n + kGeluBlock - 1) / kGeluBlock;
  at::parallel_for(0, blocks, 16, [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b) {
      f(b * kGeluBlock, std::min(kGeluBlock, n - b * kGeluBlock));
    }
  });
}

}  // namespace

void gelu_forward(const void* x, void* y, int64_t n, bool bf16, bool tanh_approximation) {
  for_gelu_blocks(n, [&](int64_t offset, int64_t len) {
    float buf[kGeluBlock];
    load_floats(x, bf16, offset, len, buf);
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes) {
      gelu_value(Vec::loadu(buf + i), tanh_approximation).store(buf + i);
    }
    if (i < len) {
      const auto rest = static_cast<int>(len - i);
      gelu_value(Vec::loadu(buf + i, rest), tanh_approximation).store(buf + i, rest);
    }
    store_floats(buf, bf16, offset, len, y);
  });
}

void gelu_backward(const void* dy, const void* x, void* dx, int64_t n, bool bf16,
                   bool tanh_approximation) {
  for_gelu_blocks(n, [&](int64_t offset, int64_t len) {
    float xs[kGeluBlock], gs[kGeluBlock];
    load_floats(x, bf16, offset, len, xs);
    load_floats(dy, bf16, offset, len, gs);
    int64_t i = 0;
    for (; i + kLanes <= len; i += kLanes) {
      gelu_grad(Vec::loadu(gs + i), Vec::loadu(xs + i), tanh_approximation).store(gs + i);
    }
    if (i < len) {
      const auto rest = static_cast<int>(len - i);
      gelu_grad(Vec::loadu(gs + i, rest), Vec::loadu(xs + i, rest), tanh_approximation)
          .store(gs + i, rest);
    }
    store_floats(gs, bf16, offset, len, dx);
  });
}

// ------------------------------------------------------------------ attention's bf16 softmax

namespace {

// One row's probabilities in float32: p = softmax(scale * raw) with masked keys at exactly 0;
// NaN throughout when every key is masked (as softmax over -inf gives).
void softmax_row_bf16(const uint16_t* raw, const uint8_t* mask, int64_t n, float scale, float* p) {
  constexpr float kInf = std::numeric_limits<float>::infinity();
  for (int64_t i = 0; i < n; ++i) p[i] = bf16_bits_to_float(raw[i]) * scale;
  if (mask != nullptr) {
    for (int64_t i = 0; i < n; ++i) p[i] = mask[i] != 0 ? -kInf : p[i];
  }
  const float m = row_max(p, n);
  if (m == -kInf) {
    std::fill(p, p + n, std::numeric_limits<float>::quiet_NaN());
    return;
  }
  const float inv = 1.f / exp_shifted(p, n, m);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) (Vec::loadu(p + i) * Vec(inv)).store(p + i);
  for (; i < n; ++i) p[i] *= inv;
  // fast_exp gives 2^-126, not 0, for a masked key's -inf: its share is cleared.
  if (mask != nullptr) {
    for (int64_t j = 0; j < n; ++j) p[j] = mask[j] != 0 ? 0.f : p[j];
  }
}

// f(offset, mask, p, scratch) for every row of s, p and scratch of s.cols floats.
template <typename F>
void for_attention_rows(const AttentionSoftmaxShape& s, const F& f) {
  at::parallel_for(0, s.heads * s.rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> buffers(static_cast<size_t>(2 * s.cols));
    for (int64_t r = begin; r < end; ++r) {
      const uint8_t* mask =
          s.mask == nullptr ? nullptr : s.mask + (r / s.rows) * s.mask_head_stride;
      f(r * s.cols, mask, buffers.data(), buffers.data() + s.cols);
    }
  });
}

}  // namespace

void attention_softmax_bf16(const AttentionSoftmaxShape& s, const uint16_t* raw, uint16_t* probs) {
  for_attention_rows(s, [&](int64_t offset, const uint8_t* mask, float* p, float*) {
    softmax_row_bf16(raw + offset, mask, s.cols, s.scale, p);
    store_floats(p, true, offset, s.cols, probs);
  });
}

void attention_softmax_backward_bf16(const AttentionSoftmaxShape& s, const uint16_t* raw,
                                     const uint16_t* dp, uint16_t* probs, uint16_t* ds) {
  // ds = p (dp - sum(p dp)) (softmax's backward), times the scale, rounded once.
  for_attention_rows(s, [&](int64_t offset, const uint8_t* mask, float* p, float* g) {
    softmax_row_bf16(raw + offset, mask, s.cols, s.scale, p);
    store_floats(p, true, offset, s.cols, probs);
    load_floats(dp, true, offset, s.cols, g);
    const float total = dot(p, g, s.cols);
    for (int64_t i = 0; i < s.cols; ++i) g[i] = p[i] * (g[i] - total) * s.scale;
    store_floats(g, true, offset, s.cols, ds);
  });
}
