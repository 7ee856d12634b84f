// The blocked layout's GroupNorm loops (slabs of 16 channels, [L, 16] rows), for
// fused_kernels_impl.h, which includes this file at its top: each ISA's translation unit
// compiles it once, inside that unit's namespace.
#pragma once

#include "fused_kernels_vec.h"  // NOLINT(bugprone-suspicious-include)

namespace {

// Slabs of the blocked layout: rows of exactly kSlabVecs vectors (16 channels), walked with the
// per-channel values and accumulators held in registers (the generic [L, C] loops above keep
// them in memory, one dependent load and store per row).
constexpr int kSlabVecs = static_cast<int>(16 / kLanes);
constexpr int64_t kSlabWidth = kSlabVecs * kLanes;
static_assert(kSlabVecs >= 1 && kSlabWidth == 16, "a blocked slab row is 16 floats");

// sum[c] += f(x[l, c], v) over the L rows of a [L, 16] slab (v: the vector index of c), in float
// over blocks of 64 rows (two rows at a time, two accumulators), then in double.
template <typename F>
void slab_sums(const float* x, int64_t L, double* sum, F f) {
  for (int64_t l0 = 0; l0 < L; l0 += 64) {
    Vec acc0[kSlabVecs], acc1[kSlabVecs];
    for (int v = 0; v < kSlabVecs; ++v) acc0[v] = acc1[v] = Vec(0.f);
    const int64_t l1 = std::min(L, l0 + 64);
    int64_t l = l0;
    for (; l + 2 <= l1; l += 2) {
      const float* r = x + l * kSlabWidth;
      for (int v = 0; v < kSlabVecs; ++v) {
        acc0[v] = acc0[v] + f(Vec::loadu(r + v * kLanes), v);
        acc1[v] = acc1[v] + f(Vec::loadu(r + kSlabWidth + v * kLanes), v);
      }
    }
    for (; l < l1; ++l) {
      for (int v = 0; v < kSlabVecs; ++v) {
        acc0[v] = acc0[v] + f(Vec::loadu(x + l * kSlabWidth + v * kLanes), v);
      }
    }
    for (int v = 0; v < kSlabVecs; ++v) {
      float out[kLanes];
      (acc0[v] + acc1[v]).store(out);
      for (int64_t i = 0; i < kLanes; ++i) sum[v * kLanes + i] += out[i];
    }
  }
}

// y = x * a + b per channel (then SiLU when act) over a [L, 16] slab.
void slab_scale_shift(const float* x, int64_t L, const float* a, const float* b, float* y,
                      bool act) {
  Vec va[kSlabVecs], vb[kSlabVecs];
  for (int v = 0; v < kSlabVecs; ++v)
    va[v] = Vec::loadu(a + v * kLanes), vb[v] = Vec::loadu(b + v * kLanes);
  for (int64_t l = 0; l < L; ++l) {
    for (int v = 0; v < kSlabVecs; ++v) {
      const int64_t i = l * kSlabWidth + v * kLanes;
      Vec z = at::vec::fmadd(Vec::loadu(x + i), va[v], vb[v]);
      if (act) z = silu(z);
      z.store(y + i);
    }
  }
}

// One pass over a [L, 16] slab of the backward: dz = dy (times silu'(x * a + b) when silu) into
// dz_out (may alias dy), db[c] += sum_l dz, ds[c] += sum_l dz * x (float over 64 rows, then
// double).
void slab_grad_sums(const float* dy, const float* x, int64_t L, const float* a, const float* b,
                    bool silu, float* dz_out, double* db, double* ds) {
  Vec va[kSlabVecs], vb[kSlabVecs];
  for (int v = 0; v < kSlabVecs; ++v)
    va[v] = Vec::loadu(a + v * kLanes), vb[v] = Vec::loadu(b + v * kLanes);
  const Vec one(1.f), zero(0.f);
  for (int64_t l0 = 0; l0 < L; l0 += 64) {
    Vec sdb[kSlabVecs], sds[kSlabVecs];
    for (int v = 0; v < kSlabVecs; ++v) sdb[v] = sds[v] = Vec(0.f);
    const int64_t l1 = std::min(L, l0 + 64);
    for (int64_t l = l0; l < l1; ++l) {
      for (int v = 0; v < kSlabVecs; ++v) {
        const int64_t i = l * kSlabWidth + v * kLanes;
        const Vec xv = Vec::loadu(x + i);
        Vec dz = Vec::loadu(dy + i);
        if (silu) {
          const Vec z = at::vec::fmadd(xv, va[v], vb[v]);
          const Vec sig = one / (one + fast_exp(zero - z));
          dz = dz * sig * (one + z * (one - sig));
        }
        dz.store(dz_out + i);
        sdb[v] = sdb[v] + dz;
        sds[v] = at::vec::fmadd(dz, xv, sds[v]);
      }
    }
    for (int v = 0; v < kSlabVecs; ++v) {
      float tb[kLanes], ts[kLanes];
      sdb[v].store(tb);
      sds[v].store(ts);
      for (int64_t i = 0; i < kLanes; ++i) db[v * kLanes + i] += tb[i], ds[v * kLanes + i] += ts[i];
    }
  }
}

// dx = dz * sc + x * k2 + k3 per channel over a [L, 16] slab (dx holds dz on entry).
void slab_grad_finish(float* dx, const float* x, int64_t L, const float* sc, const float* k2,
                      const float* k3, const float* add) {
  Vec vs[kSlabVecs], v2[kSlabVecs], v3[kSlabVecs];
  for (int v = 0; v < kSlabVecs; ++v) {
    vs[v] = Vec::loadu(sc + v * kLanes), v2[v] = Vec::loadu(k2 + v * kLanes),
    v3[v] = Vec::loadu(k3 + v * kLanes);
  }
  if (add == nullptr) {
    for (int64_t l = 0; l < L; ++l) {
      for (int v = 0; v < kSlabVecs; ++v) {
        const int64_t i = l * kSlabWidth + v * kLanes;
        const Vec t = at::vec::fmadd(Vec::loadu(x + i), v2[v], v3[v]);
        at::vec::fmadd(Vec::loadu(dx + i), vs[v], t).store(dx + i);
      }
    }
    return;
  }
  // The other consumer's gradient added as autograd would have (one rounding after the finish).
  for (int64_t l = 0; l < L; ++l) {
    for (int v = 0; v < kSlabVecs; ++v) {
      const int64_t i = l * kSlabWidth + v * kLanes;
      const Vec t = at::vec::fmadd(Vec::loadu(x + i), v2[v], v3[v]);
      (at::vec::fmadd(Vec::loadu(dx + i), vs[v], t) + Vec::loadu(add + i)).store(dx + i);
    }
  }
}

}  // namespace
