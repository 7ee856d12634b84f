#!/usr/bin/env bash
# A transformer family's LoRA training step in difftrain (build/bench/bench_<family>_step) against
# Diffusers' own transformer + PEFT on torch 2.6 (bench/py/diffusers_<family>_step.py in
# refstack2), side by side on this CPU, interleaved for --rounds rounds, the same threads and
# shapes; prints each JSON line and the median ratio peer / difftrain of ms per step (> 1:
# difftrain is faster). The family scripts (z_image_vs_diffusers.sh, qwen_image_vs_diffusers.sh,
# wan_vs_diffusers.sh) call it with their family.
#
#   bash bench/dit_vs_diffusers.sh FAMILY [--rounds 2] [--threads 2] [-- extra flags for both]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
family="${1:?dit_vs_diffusers: give the family (z_image, qwen_image, wan)}"
shift
me="${family}_vs_diffusers"
rounds=2
threads=2
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --) shift; break ;;
    *) echo "$me: unknown option $1" >&2; exit 2 ;;
  esac
done
bench="$repo/build/bench/bench_${family}_step"
script="bench/py/diffusers_${family}_step.py"
peer="$repo/../shared/refstack2/run"
[[ -x "$bench" ]] || { echo "$me: build first (bash scripts/build): $bench is missing" >&2; exit 2; }
[[ -f "$script" ]] || { echo "$me: $script is missing (no Diffusers peer for $family)" >&2; exit 2; }
[[ -x "$peer" ]] || { echo "$me: ../shared/refstack2 is missing (the peer)" >&2; exit 2; }
# Debian 13's python3-torch calls the system BLAS (BLAS_INFO=generic): the reference BLAS (about
# 7 GFLOPS on one thread here) unless OpenBLAS provides libblas.so.3, as scripts/setup gives
# difftrain. Measure peer and difftrain on the same kind of BLAS.
blas=$("$peer" /bin/readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3)
[[ "$blas" == *openblas* ]] || {
  echo "$me: the peer's libblas.so.3 is $blas (the reference BLAS); install OpenBLAS in it first:" >&2
  echo "  ../shared/refstack2/run /bin/bash -c 'apt-get install -y libopenblas0-pthread'" >&2
  exit 2
}
ours=() theirs=()
for ((r = 1; r <= rounds; r++)); do
  a=$(OMP_NUM_THREADS="$threads" "$bench" --threads "$threads" "$@" | tail -1)
  echo "difftrain: $a"
  b=$(OMP_NUM_THREADS="$threads" "$peer" python3 "$script" --threads "$threads" "$@" | tail -1)
  echo "diffusers: $b"
  ours+=("$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ms_per_step"])' "$a")")
  theirs+=("$(python3 -c 'import json,sys; print(json.loads(sys.argv[1])["ms_per_step"])' "$b")")
done
python3 - "${ours[*]}" "${theirs[*]}" <<'PY'
import statistics, sys
ours = [float(x) for x in sys.argv[1].split()]
theirs = [float(x) for x in sys.argv[2].split()]
print(f"median ms per step: difftrain {statistics.median(ours):.0f}, diffusers {statistics.median(theirs):.0f}, "
      f"ratio diffusers/difftrain {statistics.median(theirs) / statistics.median(ours):.2f}")
PY
