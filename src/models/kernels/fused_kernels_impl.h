// The body of the fused CPU kernels (fused_kernels.h), written once with ATen's vectorised type
// at::vec::Vectorized<float> and compiled per instruction set: fused_kernels_generic.cpp and
// fused_kernels_avx2.cpp include it inside their own namespace. No include guard on purpose.
//
// Attention works one query row at a time over all keys: the row's scores (S floats) stay in L1/L2
// instead of a [B*heads, N, S] matrix in memory, and every inner loop runs over S contiguous
// floats (keys and values are transposed per head first, d x S). The backward recomputes the
// probabilities from the saved log-normaliser (as flash attention does) instead of storing them.
// GroupNorm(+SiLU) reads x once for the statistics and once for the output; its backward needs
// x, mean and rstd only (the plain path keeps the normalised tensor and the SiLU input as well).
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "fused_kernels_slab.h"  // NOLINT(bugprone-suspicious-include)
#include "fused_kernels_vec.h"   // NOLINT(bugprone-suspicious-include)

namespace {

float horizontal_sum(const Vec& v) {
  float lanes[kLanes];
  v.store(lanes);
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += lanes[i];
  return s;
}

float dot(const float* a, const float* b, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    acc = at::vec::fmadd(Vec::loadu(a + i), Vec::loadu(b + i), acc);
  float s = horizontal_sum(acc);
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

float row_max(const float* x, int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  int64_t i = 0;
  if (n >= kLanes) {
    Vec acc = Vec::loadu(x);
    for (i = kLanes; i + kLanes <= n; i += kLanes) acc = at::vec::maximum(acc, Vec::loadu(x + i));
    float lanes[kLanes];
    acc.store(lanes);
    for (int64_t l = 0; l < kLanes; ++l) m = std::max(m, lanes[l]);
  }
  for (; i < n; ++i) m = std::max(m, x[i]);
  return m;
}

// x[0:n] = exp(x - shift); returns the sum of the new values.
float exp_shifted(float* x, int64_t n, float shift) {
  const Vec s(shift);
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec e = fast_exp(Vec::loadu(x + i) - s);
    e.store(x + i);
    acc = acc + e;
  }
  float sum = horizontal_sum(acc);
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    sum += x[i];
  }
  return sum;
}

// dst[c * rows + r] = src[r * stride + c] for r < rows, c < cols (one head's keys -> d x S).
void transpose_head(const float* src, int64_t stride, int64_t rows, int64_t cols, float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    const float* s = src + r * stride;
    for (int64_t c = 0; c < cols; ++c) dst[c * rows + r] = s[c];
  }
}

// Register-tiled products on small row-major blocks, vectorised along contiguous rows; the
// attention kernels below are written with them (a one-row-at-a-time axpy form streams the
// accumulators through memory once per row and runs several times slower for narrow heads).

// C[M x N] = (accumulate ? C : 0) + alpha * A[M x K] . B[K x N]  (B rows contiguous along N).
template <int MR>
void gemm_nn_rows(int64_t N, int64_t K, float alpha, const float* A, int64_t lda, const float* B,
                  int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  const Vec va(alpha);
  int64_t n = 0;
  for (; n + 2 * kLanes <= N; n += 2 * kLanes) {
    Vec acc[MR][2];
    for (int r = 0; r < MR; ++r) acc[r][0] = acc[r][1] = Vec(0.f);
    for (int64_t k = 0; k < K; ++k) {
      const Vec b0 = Vec::loadu(B + k * ldb + n), b1 = Vec::loadu(B + k * ldb + n + kLanes);
      for (int r = 0; r < MR; ++r) {
        const Vec a(A[r * lda + k]);
        acc[r][0] = at::vec::fmadd(a, b0, acc[r][0]);
        acc[r][1] = at::vec::fmadd(a, b1, acc[r][1]);
      }
    }
    for (int r = 0; r < MR; ++r) {
      float* c = C + r * ldc + n;
      for (int h = 0; h < 2; ++h) {
        const Vec old = accumulate ? Vec::loadu(c + h * kLanes) : Vec(0.f);
        at::vec::fmadd(va, acc[r][h], old).store(c + h * kLanes);
      }
    }
  }
  for (; n + kLanes <= N; n += kLanes) {
    Vec acc[MR];
    for (int r = 0; r < MR; ++r) acc[r] = Vec(0.f);
    for (int64_t k = 0; k < K; ++k) {
      const Vec b0 = Vec::loadu(B + k * ldb + n);
      for (int r = 0; r < MR; ++r) acc[r] = at::vec::fmadd(Vec(A[r * lda + k]), b0, acc[r]);
    }
    for (int r = 0; r < MR; ++r) {
      float* c = C + r * ldc + n;
      const Vec old = accumulate ? Vec::loadu(c) : Vec(0.f);
      at::vec::fmadd(va, acc[r], old).store(c);
    }
  }
  for (; n < N; ++n) {
    for (int r = 0; r < MR; ++r) {
      float sum = 0.f;
      for (int64_t k = 0; k < K; ++k) sum += A[r * lda + k] * B[k * ldb + n];
      float& c = C[r * ldc + n];
      c = (accumulate ? c : 0.f) + alpha * sum;
    }
  }
}

void gemm_nn(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
             const float* B, int64_t ldb, float* C, int64_t ldc, bool accumulate) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4)
    gemm_nn_rows<4>(N, K, alpha, A + m * lda, lda, B, ldb, C + m * ldc, ldc, accumulate);
  for (; m < M; ++m)
    gemm_nn_rows<1>(N, K, alpha, A + m * lda, lda, B, ldb, C + m * ldc, ldc, accumulate);
}

// C[M x N] = alpha * A[M x K] . Bt[N x K]^T  (rows of both contiguous along K).
template <int MR, int NR>
void gemm_nt_tile(int64_t K, float alpha, const float* A, int64_t lda, const float* Bt, int64_t ldb,
                  float* C, int64_t ldc) {
  Vec acc[MR][NR];
  for (int r = 0; r < MR; ++r)
    for (int c = 0; c < NR; ++c) acc[r][c] = Vec(0.f);
  int64_t k = 0;
  for (; k + kLanes <= K; k += kLanes) {
    Vec b[NR];
    for (int c = 0; c < NR; ++c) b[c] = Vec::loadu(Bt + c * ldb + k);
    for (int r = 0; r < MR; ++r) {
      const Vec a = Vec::loadu(A + r * lda + k);
      for (int c = 0; c < NR; ++c) acc[r][c] = at::vec::fmadd(a, b[c], acc[r][c]);
    }
  }
  for (int r = 0; r < MR; ++r) {
    for (int c = 0; c < NR; ++c) {
      float sum = horizontal_sum(acc[r][c]);
      for (int64_t t = k; t < K; ++t) sum += A[r * lda + t] * Bt[c * ldb + t];
      C[r * ldc + c] = alpha * sum;
    }
  }
}

void gemm_nt(int64_t M, int64_t N, int64_t K, float alpha, const float* A, int64_t lda,
             const float* Bt, int64_t ldb, float* C, int64_t ldc) {
  int64_t m = 0;
  for (; m + 4 <= M; m += 4) {
    int64_t n = 0;
    for (; n + 2 <= N; n += 2)
      gemm_nt_tile<4, 2>(K, alpha, A + m * lda, lda, Bt + n * ldb, ldb, C + m * ldc + n, ldc);
    for (; n < N; ++n)
      gemm_nt_tile<4, 1>(K, alpha, A + m * lda, lda, Bt + n * ldb, ldb, C + m * ldc + n, ldc);
  }
  for (; m < M; ++m) {
    int64_t n = 0;
    for (; n + 2 <= N; n += 2)
      gemm_nt_tile<1, 2>(K, alpha, A + m * lda, lda, Bt + n * ldb, ldb, C + m * ldc + n, ldc);
    for (; n < N; ++n)
      gemm_nt_tile<1, 1>(K, alpha, A + m * lda, lda, Bt + n * ldb, ldb, C + m * ldc + n, ldc);
  }
}

// dst[r * d + c] = scale * src[r * stride + c]: a block of query rows, scaled as the scores want
// (the same rounding in the forward and in the backward's recomputation).
void scaled_rows(const float* src, int64_t stride, int64_t rows, int64_t d, float scale,
                 float* dst) {
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < d; ++c) dst[r * d + c] = src[r * stride + c] * scale;
  }
}

}  // namespace

// Attention over one (batch, head) at a time in blocks of query rows: a block's scores [rows x S]
// stay in cache (never the whole [B*heads, N, S] matrix); keys and values are transposed per head
// (d x S) so that every product runs along contiguous memory.
void attention_forward(const AttentionShape& s, const float* q, const float* k, const float* v,
                       float* o, float* lse) {
  const int64_t B = s.batch, N = s.queries, S = s.keys, H = s.heads, d = s.head_dim;
  const int64_t inner = H * d;
  const int64_t block = 32;  // queries per task: enough tasks for every thread, few transposes
  const int64_t blocks = (N + block - 1) / block;
  const float scale = static_cast<float>(s.scale);
  at::parallel_for(0, B * H * blocks, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(d * S), vt(d * S), p(block * S), qs(block * d), inv(block);
    int64_t cached = -1;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t bh = task / blocks, b = bh / H, h = bh % H;
      if (bh != cached) {
        transpose_head(k + b * S * inner + h * d, inner, S, d, kt.data());
        transpose_head(v + b * S * inner + h * d, inner, S, d, vt.data());
        cached = bh;
      }
      const int64_t first = (task % blocks) * block, rows = std::min(N, first + block) - first;
      scaled_rows(q + (b * N + first) * inner + h * d, inner, rows, d, scale, qs.data());
      gemm_nn(rows, S, d, 1.f, qs.data(), d, kt.data(), S, p.data(), S, false);
      for (int64_t r = 0; r < rows; ++r) {
        float* row = p.data() + r * S;
        const float m = row_max(row, S);
        const float sum = exp_shifted(row, S, m);
        lse[bh * N + first + r] = m + std::log(sum);
        inv[r] = 1.f / sum;
      }
      float* ob = o + (b * N + first) * inner + h * d;
      gemm_nt(rows, d, S, 1.f, p.data(), S, vt.data(), S, ob, inner);
      for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < d; ++c) ob[r * inner + c] *= inv[r];
      }
    }
  });
}

void attention_backward(const AttentionShape& s, const float* q, const float* k, const float* v,
                        const float* o, const float* lse, const float* dout, float* dq, float* dk,
                        float* dv) {
  const int64_t B = s.batch, N = s.queries, S = s.keys, H = s.heads, d = s.head_dim;
  const int64_t inner = H * d;
  const int64_t block = 64;
  const float scale = static_cast<float>(s.scale);
  // One task per (batch, head): dk and dv sum over every query of the head.
  at::parallel_for(0, B * H, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> kt(d * S), vt(d * S), dkt(d * S), dvt(d * S), p(block * S), ds(block * S),
        qt(d * block), dot_t(d * block), qs(block * d);
    for (int64_t bh = begin; bh < end; ++bh) {
      const int64_t b = bh / H, h = bh % H;
      transpose_head(k + b * S * inner + h * d, inner, S, d, kt.data());
      transpose_head(v + b * S * inner + h * d, inner, S, d, vt.data());
      std::fill(dkt.begin(), dkt.end(), 0.f);
      std::fill(dvt.begin(), dvt.end(), 0.f);
      for (int64_t first = 0; first < N; first += block) {
        const int64_t rows = std::min(N, first + block) - first;
        const int64_t at_row = (b * N + first) * inner + h * d;
        const float *qb = q + at_row, *ob = o + at_row, *dob = dout + at_row;
        // p = the block's softmax rows, recomputed from the saved log-normaliser
        scaled_rows(qb, inner, rows, d, scale, qs.data());
        gemm_nn(rows, S, d, 1.f, qs.data(), d, kt.data(), S, p.data(), S, false);
        for (int64_t r = 0; r < rows; ++r)
          exp_shifted(p.data() + r * S, S, lse[bh * N + first + r]);
        // ds = p * (do . v_j - do . o)
        gemm_nn(rows, S, d, 1.f, dob, inner, vt.data(), S, ds.data(), S, false);
        for (int64_t r = 0; r < rows; ++r) {
          const float di_scalar = dot(dob + r * inner, ob + r * inner, d);
          const Vec di(di_scalar);
          float *pr = p.data() + r * S, *dsr = ds.data() + r * S;
          int64_t j = 0;
          for (; j + kLanes <= S; j += kLanes) {
            (Vec::loadu(pr + j) * (Vec::loadu(dsr + j) - di)).store(dsr + j);
          }
          for (; j < S; ++j) dsr[j] = pr[j] * (dsr[j] - di_scalar);
        }
        // dq = scale * ds . k;  dk^T += scale * q^T . ds;  dv^T += do^T . p
        gemm_nt(rows, d, S, scale, ds.data(), S, kt.data(), S, dq + at_row, inner);
        transpose_head(qb, inner, rows, d, qt.data());
        transpose_head(dob, inner, rows, d, dot_t.data());
        gemm_nn(d, S, rows, scale, qt.data(), rows, ds.data(), S, dkt.data(), S, true);
        gemm_nn(d, S, rows, 1.f, dot_t.data(), rows, p.data(), S, dvt.data(), S, true);
      }
      for (int64_t j = 0; j < S; ++j) {
        float* dkj = dk + (b * S + j) * inner + h * d;
        float* dvj = dv + (b * S + j) * inner + h * d;
        for (int64_t c = 0; c < d; ++c) {
          dkj[c] = dkt[c * S + j];
          dvj[c] = dvt[c * S + j];
        }
      }
    }
  });
}

namespace {

// Per-channel sums over the L positions of one sample in channels-last memory ([L, C]):
// sum[c] += f(x[l, c]) for every l, accumulated in float blocks of 64 rows, then in double.
template <typename F>
void channel_sums_cl(const float* x, int64_t L, int64_t C, double* sum, F f) {
  std::vector<float> part(C);
  for (int64_t l0 = 0; l0 < L; l0 += 64) {
    std::fill(part.begin(), part.end(), 0.f);
    const int64_t l1 = std::min(L, l0 + 64);
    for (int64_t l = l0; l < l1; ++l) {
      const float* row = x + l * C;
      int64_t c = 0;
      for (; c + kLanes <= C; c += kLanes) {
        (Vec::loadu(part.data() + c) + f(Vec::loadu(row + c), c)).store(part.data() + c);
      }
      for (; c < C; ++c) {
        float lane[kLanes] = {row[c]};
        float out[kLanes];
        f(Vec::loadu(lane, 1), c).store(out);
        part[c] += out[0];
      }
    }
    for (int64_t c = 0; c < C; ++c) sum[c] += part[c];
  }
}

double sum_shifted_squares(const float* x, int64_t n, float mean) {
  const Vec m(mean);
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec t = Vec::loadu(x + i) - m;
    acc = at::vec::fmadd(t, t, acc);
  }
  double s = horizontal_sum(acc);
  for (; i < n; ++i) s += (x[i] - mean) * (x[i] - mean);
  return s;
}

double plain_sum(const float* x, int64_t n) {
  Vec acc(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) acc = acc + Vec::loadu(x + i);
  double s = horizontal_sum(acc);
  for (; i < n; ++i) s += x[i];
  return s;
}

// y[0:n] = x * a + b (then silu)
void scale_shift(const float* x, const float* a, const float* b, float* y, int64_t n, bool act) {
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec z = at::vec::fmadd(Vec::loadu(x + i), Vec::loadu(a + i), Vec::loadu(b + i));
    if (act) z = silu(z);
    z.store(y + i);
  }
  for (; i < n; ++i) {
    const float z = x[i] * a[i] + b[i];
    y[i] = act ? z / (1.f + std::exp(-z)) : z;
  }
}

void scale_shift(const float* x, float a, float b, float* y, int64_t n, bool act) {
  const Vec va(a), vb(b);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    Vec z = at::vec::fmadd(Vec::loadu(x + i), va, vb);
    if (act) z = silu(z);
    z.store(y + i);
  }
  for (; i < n; ++i) {
    const float z = x[i] * a + b;
    y[i] = act ? z / (1.f + std::exp(-z)) : z;
  }
}

// dz = dy * silu'(x * a + b), written to out (out may alias dy).
void silu_grad(const float* dy, const float* x, float a, float b, float* out, int64_t n) {
  const Vec va(a), vb(b), one(1.f), zero(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec z = at::vec::fmadd(Vec::loadu(x + i), va, vb);
    const Vec sig = one / (one + fast_exp(zero - z));
    (Vec::loadu(dy + i) * sig * (one + z * (one - sig))).store(out + i);
  }
  for (; i < n; ++i) {
    const float z = x[i] * a + b;
    const float sig = 1.f / (1.f + std::exp(-z));
    out[i] = dy[i] * sig * (1.f + z * (1.f - sig));
  }
}

void silu_grad(const float* dy, const float* x, const float* a, const float* b, float* out,
               int64_t n) {
  const Vec one(1.f), zero(0.f);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    const Vec z = at::vec::fmadd(Vec::loadu(x + i), Vec::loadu(a + i), Vec::loadu(b + i));
    const Vec sig = one / (one + fast_exp(zero - z));
    (Vec::loadu(dy + i) * sig * (one + z * (one - sig))).store(out + i);
  }
  for (; i < n; ++i) {
    const float z = x[i] * a[i] + b[i];
    const float sig = 1.f / (1.f + std::exp(-z));
    out[i] = dy[i] * sig * (1.f + z * (1.f - sig));
  }
}

// Per sample n: a_c = rstd_g * gamma_c, b_c = beta_c - mean_g * a_c for every channel c.
void affine_coefficients(const GroupNormShape& s, int64_t n, const float* mean, const float* rstd,
                         const float* gamma, const float* beta, float* a, float* b) {
  const int64_t C = s.channels, cpg = C / s.groups;
  for (int64_t c = 0; c < C; ++c) {
    const int64_t g = c / cpg;
    const float r = rstd[n * s.groups + g], m = mean[n * s.groups + g];
    a[c] = r * (gamma ? gamma[c] : 1.f);
    b[c] = (beta ? beta[c] : 0.f) - m * a[c];
  }
}

}  // namespace

void group_norm_forward(const GroupNormShape& s, const float* x, const float* gamma,
                        const float* beta, float* y, float* mean, float* rstd) {
  const int64_t N = s.batch, C = s.channels, L = s.length, G = s.groups, cpg = C / G;
  const double count = static_cast<double>(cpg * L);
  if (!s.channels_last && s.block == 0) {
    // [N, C, L]: group (n, g) is one contiguous block of cpg * L floats.
    at::parallel_for(0, N * G, 1, [&](int64_t begin, int64_t end) {
      for (int64_t ng = begin; ng < end; ++ng) {
        const float* block = x + ng * cpg * L;
        const float m = static_cast<float>(plain_sum(block, cpg * L) / count);
        const double var = sum_shifted_squares(block, cpg * L, m) / count;
        mean[ng] = m;
        rstd[ng] = static_cast<float>(1.0 / std::sqrt(var + s.eps));
      }
    });
    at::parallel_for(0, N * C, 1, [&](int64_t begin, int64_t end) {
      for (int64_t nc = begin; nc < end; ++nc) {
        const int64_t n = nc / C, c = nc % C, ng = n * G + c / cpg;
        const float a = rstd[ng] * (gamma ? gamma[c] : 1.f);
        const float b = (beta ? beta[c] : 0.f) - mean[ng] * a;
        scale_shift(x + nc * L, a, b, y + nc * L, L, s.silu);
      }
    });
    return;
  }
  // [N, L, C] or [N, C / B, L, B]: slabs of B channels, each [L, B] (channels-last is one slab
  // of B = C). Per-channel sums over the positions, then per group.
  const int64_t B = s.block > 0 ? s.block : C, slabs = C / B;
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<double> sum(C);
    std::vector<float> channel_mean(C), a(C), b(C);
    for (int64_t n = begin; n < end; ++n) {
      const float* xn = x + n * L * C;
      const bool slab16 = B == kSlabWidth;
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t k = 0; k < slabs; ++k) {
        if (slab16) {
          slab_sums(xn + k * L * B, L, sum.data() + k * B, [](const Vec& v, int) { return v; });
        } else {
          channel_sums_cl(xn + k * L * B, L, B, sum.data() + k * B,
                          [](const Vec& v, int64_t) { return v; });
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        double t = 0;
        for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) t += sum[c];
        mean[n * G + g] = static_cast<float>(t / count);
        for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) channel_mean[c] = mean[n * G + g];
      }
      std::fill(sum.begin(), sum.end(), 0.0);
      for (int64_t k = 0; k < slabs; ++k) {
        const float* slab_mean = channel_mean.data() + k * B;
        if (slab16) {
          Vec mv[kSlabVecs];
          for (int v = 0; v < kSlabVecs; ++v) mv[v] = Vec::loadu(slab_mean + v * kLanes);
          slab_sums(xn + k * L * B, L, sum.data() + k * B, [&](const Vec& x_v, int v) {
            const Vec t = x_v - mv[v];
            return t * t;
          });
          continue;
        }
        channel_sums_cl(xn + k * L * B, L, B, sum.data() + k * B, [&](const Vec& v, int64_t c) {
          const Vec t = v - Vec::loadu(slab_mean + c, std::min<int64_t>(kLanes, B - c));
          return t * t;
        });
      }
      for (int64_t g = 0; g < G; ++g) {
        double t = 0;
        for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) t += sum[c];
        rstd[n * G + g] = static_cast<float>(1.0 / std::sqrt(t / count + s.eps));
      }
      affine_coefficients(s, n, mean, rstd, gamma, beta, a.data(), b.data());
      for (int64_t k = 0; k < slabs; ++k) {
        if (slab16) {
          slab_scale_shift(xn + k * L * B, L, a.data() + k * B, b.data() + k * B,
                           y + n * L * C + k * L * B, s.silu);
          continue;
        }
        for (int64_t l = 0; l < L; ++l) {
          const int64_t row = (k * L + l) * B;
          scale_shift(xn + row, a.data() + k * B, b.data() + k * B, y + n * L * C + row, B, s.silu);
        }
      }
    }
  });
}

void group_norm_backward(const GroupNormShape& s, const float* dy, const float* x,
                         const float* mean, const float* rstd, const float* gamma,
                         const float* beta, float* dx, float* dgamma, float* dbeta,
                         const float* dx_add) {
  const int64_t N = s.batch, C = s.channels, L = s.length, G = s.groups, cpg = C / G;
  const double count = static_cast<double>(cpg * L);
  // ds[n, c] = sum_l dz * x, db[n, c] = sum_l dz, with dz = dy (times silu' when fused), which is
  // first written to dx and then turned into dx in place.
  std::vector<double> ds(N * C, 0.0), db(N * C, 0.0);
  // [N, L, C] or [N, C / B, L, B]: slabs of B channels, each [L, B] (as in the forward).
  const bool blocked = s.channels_last || s.block > 0;
  const int64_t B = s.block > 0 ? s.block : C, slabs = C / B;
  // dx_add is taken where it is fused: the blocked layout's 16-channel slabs.
  TORCH_CHECK(dx_add == nullptr || (s.block > 0 && B == kSlabWidth),
              "group_norm_backward: dx_add needs the blocked layout of ", kSlabWidth, " channels");
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> a(C), b(C), scale(C), c2(G), c3(G);
    for (int64_t n = begin; n < end; ++n) {
      const int64_t base = n * C * L;
      affine_coefficients(s, n, mean, rstd, gamma, beta, a.data(), b.data());
      if (!blocked) {
        for (int64_t c = 0; c < C; ++c) {
          const int64_t off = base + c * L;
          if (s.silu) {
            silu_grad(dy + off, x + off, a[c], b[c], dx + off, L);
          } else {
            std::copy(dy + off, dy + off + L, dx + off);
          }
          ds[n * C + c] = dot(dx + off, x + off, L);
          db[n * C + c] = plain_sum(dx + off, L);
        }
      } else if (B == kSlabWidth) {
        for (int64_t k = 0; k < slabs; ++k) {
          const int64_t off = base + k * L * B;
          slab_grad_sums(dy + off, x + off, L, a.data() + k * B, b.data() + k * B, s.silu, dx + off,
                         db.data() + n * C + k * B, ds.data() + n * C + k * B);
        }
      } else {
        for (int64_t k = 0; k < slabs; ++k) {
          for (int64_t l = 0; l < L; ++l) {
            const int64_t off = base + (k * L + l) * B;
            if (s.silu) {
              silu_grad(dy + off, x + off, a.data() + k * B, b.data() + k * B, dx + off, B);
            } else {
              std::copy(dy + off, dy + off + B, dx + off);
            }
          }
        }
        for (int64_t k = 0; k < slabs; ++k) {
          const float* dzk = dx + base + k * L * B;
          const float* xk = x + base + k * L * B;
          double* dbk = db.data() + n * C + k * B;
          double* dsk = ds.data() + n * C + k * B;
          channel_sums_cl(dzk, L, B, dbk, [](const Vec& v, int64_t) { return v; });
          // ds = sum over positions of dz * x
          std::vector<float> part(B);
          for (int64_t l0 = 0; l0 < L; l0 += 64) {
            std::fill(part.begin(), part.end(), 0.f);
            for (int64_t l = l0; l < std::min(L, l0 + 64); ++l) {
              const float *dzr = dzk + l * B, *xr = xk + l * B;
              int64_t c = 0;
              for (; c + kLanes <= B; c += kLanes) {
                at::vec::fmadd(Vec::loadu(dzr + c), Vec::loadu(xr + c), Vec::loadu(part.data() + c))
                    .store(part.data() + c);
              }
              for (; c < B; ++c) part[c] += dzr[c] * xr[c];
            }
            for (int64_t c = 0; c < B; ++c) dsk[c] += part[c];
          }
        }
      }
      // dx = dz * rstd * gamma + x * c2 + c3 (per group), as ATen's GroupNorm backward.
      for (int64_t g = 0; g < G; ++g) {
        const int64_t ng = n * G + g;
        double sum_a = 0, sum_b = 0;
        for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
          const double gm = gamma ? gamma[c] : 1.0;
          sum_a += gm * ds[n * C + c];
          sum_b += gm * db[n * C + c];
        }
        const double r = rstd[ng], m = mean[ng];
        const double k2 = (sum_b * m - sum_a) * r * r * r / count;
        c2[g] = static_cast<float>(k2);
        c3[g] = static_cast<float>(-k2 * m - sum_b * r / count);
        for (int64_t c = g * cpg; c < (g + 1) * cpg; ++c) {
          scale[c] = static_cast<float>(r * (gamma ? gamma[c] : 1.0));
        }
      }
      if (!blocked) {
        for (int64_t c = 0; c < C; ++c) {
          const int64_t off = base + c * L, g = c / cpg;
          const Vec sc(scale[c]), k2(c2[g]), k3(c3[g]);
          int64_t i = 0;
          for (; i + kLanes <= L; i += kLanes) {
            const Vec t = at::vec::fmadd(Vec::loadu(x + off + i), k2, k3);
            at::vec::fmadd(Vec::loadu(dx + off + i), sc, t).store(dx + off + i);
          }
          for (; i < L; ++i) dx[off + i] = dx[off + i] * scale[c] + x[off + i] * c2[g] + c3[g];
        }
      } else {
        std::vector<float> k2c(C), k3c(C);
        for (int64_t c = 0; c < C; ++c) k2c[c] = c2[c / cpg], k3c[c] = c3[c / cpg];
        for (int64_t k = 0; k < slabs; ++k) {
          const float *k2 = k2c.data() + k * B, *k3 = k3c.data() + k * B,
                      *sc = scale.data() + k * B;
          if (B == kSlabWidth) {
            slab_grad_finish(dx + base + k * L * B, x + base + k * L * B, L, sc, k2, k3,
                             dx_add ? dx_add + base + k * L * B : nullptr);
            continue;
          }
          for (int64_t l = 0; l < L; ++l) {
            const int64_t off = base + (k * L + l) * B;
            int64_t c = 0;
            for (; c + kLanes <= B; c += kLanes) {
              const Vec t =
                  at::vec::fmadd(Vec::loadu(x + off + c), Vec::loadu(k2 + c), Vec::loadu(k3 + c));
              at::vec::fmadd(Vec::loadu(dx + off + c), Vec::loadu(sc + c), t).store(dx + off + c);
            }
            for (; c < B; ++c) dx[off + c] = dx[off + c] * sc[c] + x[off + c] * k2[c] + k3[c];
          }
        }
      }
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    double dg = 0, dbt = 0;
    for (int64_t n = 0; n < N; ++n) {
      const int64_t ng = n * G + c / cpg;
      dg += (ds[n * C + c] - mean[ng] * db[n * C + c]) * rstd[ng];
      dbt += db[n * C + c];
    }
    if (dgamma) dgamma[c] = static_cast<float>(dg);
    if (dbeta) dbeta[c] = static_cast<float>(dbt);
  }
}

namespace {

// y[0:n] += a * x[0:n]
void axpy(float a, const float* x, float* y, int64_t n) {
  const Vec va(a);
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes) {
    at::vec::fmadd(va, Vec::loadu(x + i), Vec::loadu(y + i)).store(y + i);
  }
  for (; i < n; ++i) y[i] += a * x[i];
}

// Every (output row, kernel tap) pair of a 3x3 stride-1 convolution over one plane, as
// f(tap, output offset, input offset, length): the run of an output row whose input under tap
// (kh, kw) = (tap / 3, tap % 3) lies inside the input (zero padding elsewhere), in a fixed order.
template <typename F>
void for_each_tap(const SmallConvShape& s, F f) {
  const int64_t H = s.height, W = s.width, p = s.pad;
  const int64_t OH = H + 2 * p - 2, OW = W + 2 * p - 2;
  for (int64_t oh = 0; oh < OH; ++oh) {
    for (int64_t kh = 0; kh < 3; ++kh) {
      const int64_t ih = oh + kh - p;
      if (ih < 0 || ih >= H) continue;
      for (int64_t kw = 0; kw < 3; ++kw) {
        const int64_t dx = kw - p;
        const int64_t lo = std::max<int64_t>(0, -dx), hi = std::min(OW, W - dx);
        if (hi > lo) f(kh * 3 + kw, oh * OW + lo, ih * W + lo + dx, hi - lo);
      }
    }
  }
}

}  // namespace

void small_conv_forward(const SmallConvShape& s, const float* x, const float* weight,
                        const float* bias, float* y) {
  const int64_t C = s.in_channels, O = s.out_channels, H = s.height, W = s.width, p = s.pad;
  const int64_t OH = H + 2 * p - 2, OW = W + 2 * p - 2;
  at::parallel_for(0, s.batch * O, 1, [&](int64_t begin, int64_t end) {
    for (int64_t no = begin; no < end; ++no) {
      const int64_t n = no / O, o = no % O;
      float* yp = y + no * OH * OW;
      std::fill(yp, yp + OH * OW, bias ? bias[o] : 0.f);
      for (int64_t c = 0; c < C; ++c) {
        const float* xp = x + (n * C + c) * H * W;
        const float* wp = weight + (o * C + c) * 9;
        for_each_tap(s, [&](int64_t tap, int64_t out, int64_t in, int64_t len) {
          axpy(wp[tap], xp + in, yp + out, len);
        });
      }
    }
  });
}

void small_conv_backward_data(const SmallConvShape& s, const float* gy, const float* weight,
                              float* gx) {
  const int64_t C = s.in_channels, O = s.out_channels, H = s.height, W = s.width, p = s.pad;
  const int64_t OH = H + 2 * p - 2, OW = W + 2 * p - 2;
  at::parallel_for(0, s.batch * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nc = begin; nc < end; ++nc) {
      const int64_t n = nc / C, c = nc % C;
      float* gxp = gx + nc * H * W;
      std::fill(gxp, gxp + H * W, 0.f);
      for (int64_t o = 0; o < O; ++o) {
        const float* gyp = gy + (n * O + o) * OH * OW;
        const float* wp = weight + (o * C + c) * 9;
        for_each_tap(s, [&](int64_t tap, int64_t out, int64_t in, int64_t len) {
          axpy(wp[tap], gyp + out, gxp + in, len);
        });
      }
    }
  });
}

void small_conv_backward_weights(const SmallConvShape& s, const float* gy, const float* x,
                                 float* gw, float* gb) {
  const int64_t N = s.batch, C = s.in_channels, O = s.out_channels, H = s.height, W = s.width,
                p = s.pad;
  const int64_t OH = H + 2 * p - 2, OW = W + 2 * p - 2;
  // gw[o, c, kh, kw] = sum over n and output positions of gy * the input under that tap; each
  // row's dot product in float, rows summed in double.
  at::parallel_for(0, O * C, 1, [&](int64_t begin, int64_t end) {
    for (int64_t oc = begin; oc < end; ++oc) {
      const int64_t o = oc / C, c = oc % C;
      double acc[9] = {};
      for (int64_t n = 0; n < N; ++n) {
        const float* gyp = gy + (n * O + o) * OH * OW;
        const float* xp = x + (n * C + c) * H * W;
        for_each_tap(s, [&](int64_t tap, int64_t out, int64_t in, int64_t len) {
          acc[tap] += dot(gyp + out, xp + in, len);
        });
      }
      for (int k = 0; k < 9; ++k) gw[oc * 9 + k] = static_cast<float>(acc[k]);
    }
  });
  if (gb == nullptr) return;
  for (int64_t o = 0; o < O; ++o) {
    double t = 0;
    for (int64_t n = 0; n < N; ++n) t += plain_sum(gy + (n * O + o) * OH * OW, OH * OW);
    gb[o] = static_cast<float>(t);
  }
}

#include "fused_kernels_bf16.h"  // NOLINT(bugprone-suspicious-include)
