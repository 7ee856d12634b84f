// The fused kernels for the build's baseline instruction set (any x86-64 or other CPU).
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

namespace difftrain::models::kernels::generic {
#include "fused_kernels_impl.h"  // NOLINT(bugprone-suspicious-include)
}  // namespace difftrain::models::kernels::generic
