// Vectorised primitives of the fused CPU kernels (the vector type, exp, SiLU), for
// fused_kernels_impl.h and fused_kernels_slab.h, which include this file first. Like them it is
// compiled once per instruction set inside that translation unit's namespace (its includes come
// first in the .cpp); #pragma once keeps it to one copy per translation unit.
#pragma once

using Vec = at::vec::Vectorized<float>;
constexpr int64_t kLanes = Vec::size();

namespace {

// exp(x) for the softmax and SiLU, inline: x = n ln2 + r with |r| <= ln2 / 2, Cephes' degree-6
// polynomial for e^r, and 2^n through the exponent bits. Sleef's exp (Vec::exp) is an out-of-line
// call that took a third of a small-head attention's time. Within 2 ulp of expf; NaN stays NaN;
// +inf above 88.72; below -87.34 it returns 2^-126 (1.2e-38) instead of a denormal or 0.
#if defined(CPU_CAPABILITY_AVX2) && defined(__FMA__)
Vec fast_exp(const Vec& x) {
  const __m256 v = _mm256_min_ps(_mm256_set1_ps(88.7228394f),
                                 _mm256_max_ps(_mm256_set1_ps(-87.3365448f), __m256(x)));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(v, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e =
      _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return Vec(_mm256_mul_ps(p, _mm256_castsi256_ps(e)));
}
#else
Vec fast_exp(const Vec& x) { return x.exp(); }
#endif

Vec silu(const Vec& z) { return z / (Vec(1.f) + fast_exp(Vec(0.f) - z)); }

}  // namespace
