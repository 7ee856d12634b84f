// The fused kernels compiled for AVX2 + FMA (CMake gives this file -mavx2 -mfma and ATen's
// CPU_CAPABILITY=AVX2, so Vectorized<float> is 8 lanes and its exp() is Sleef's). Built only when
// the compiler targets x86-64 and Sleef's header is found; fused_ops.cpp calls it only on a CPU
// that reports both features.
#ifdef DIFFTRAIN_HAVE_AVX2_KERNELS
#include "fused_kernels.h"

// The kernel body's own includes come first, outside the namespace it is compiled into.
#include <ATen/Parallel.h>
#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

namespace difftrain::models::kernels::avx2 {
#include "fused_kernels_impl.h"  // NOLINT(bugprone-suspicious-include)
}  // namespace difftrain::models::kernels::avx2
#endif
