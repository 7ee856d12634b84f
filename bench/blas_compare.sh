#!/usr/bin/env bash
# Why scripts/setup installs OpenBLAS: LibTorch's float32 matmul on the BLAS the system selects
# (OpenBLAS after setup) against Netlib's reference BLAS, side by side in one run.
#   bash bench/blas_compare.sh [build/bin/difftrain]
set -euo pipefail
difftrain=${1:-build/bin/difftrain}
reference_dir=/usr/lib/x86_64-linux-gnu/blas
probe() { "$difftrain" env --probe_seconds 3 | sed -n 's/^- matmul probe: \([0-9.]*\) GFLOP.*/\1/p'; }
fast=$(probe)
slow=$(LD_LIBRARY_PATH=$reference_dir probe)
blas=$("$difftrain" env --probe_seconds 0 | sed -n 's/^- BLAS: //p')
echo "selected BLAS ($blas): $fast GFLOP/s"
echo "reference BLAS ($reference_dir): $slow GFLOP/s"
awk -v f="$fast" -v s="$slow" 'BEGIN { printf "ratio: %.1fx\n", f / s }'
