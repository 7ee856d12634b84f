#!/usr/bin/env bash
# FLUX.1's training step in difftrain (bench_flux_step) against Diffusers' FluxTransformer2DModel
# + PEFT on torch 2.6 (bench/py/diffusers_flux_step.py in refstack2), side by side on this CPU, in
# interleaved rounds, the same threads, shapes, dtypes and step; prints each JSON line, then one
# table: per row and token count the median ms per step of every side, the ratios peer / difftrain
# (> 1: difftrain is faster) and the peak heap bytes of every side during the timed steps.
#
#   bash bench/flux_vs_diffusers.sh [--rounds 2] [--threads 2] [--steps 2] [--warmup 1]
#        [--rows lora,int8,checkpointing,full] [--tokens 256,1024] [--text_tokens 128]
#        [--blocks 1,2] [--peers default,math] [--libtorch26 0|1] [--unfused 0|1] [--unpacked 0|1]
#
# Rows: lora (LoRA r16 on Diffusers' 12 FLUX targets, bf16 base), int8 (the same on an int8 base),
# checkpointing (lora with gradient checkpointing), full (every weight trains, float32 master
# weights); all under bf16 autocast, AdamW, clipping, batch 1, FLUX.1's width with --blocks
# double,single blocks.
# Peers: default is torch's scaled_dot_product_attention as the Diffusers script runs it (on this
# CPU torch picks its fused flash kernel); math forces SDPA's reference backend (faster where the
# fused bf16 kernel has no AMX to run on). --libtorch26 1 also runs difftrain built against
# LibTorch 2.6 (build-cuda/bench/bench_flux_step in the Debian 13 cuda root, on the CPU; make it
# with `bash scripts/debian13 run cuda ninja -C build-cuda bench_flux_step` after the root's cmake).
# --unfused 1 also runs difftrain with DIFFTRAIN_FUSED_KERNELS=0 (the DiT blocks' RoPE and RMSNorm
# as tensor expressions): what the one-pass kernels buy. --unpacked 1 also runs difftrain with
# DIFFTRAIN_PACKED_GRAD=0 (frozen layers' input gradients through LibTorch's matmul instead of
# oneDNN's with the weight packed for the call, models/kernels/packed_matmul.h).
#
# Memory: bench/alloc_peak.c (built here into build/alloc_peak.so) is LD_PRELOADed into every
# process and counts the bytes malloc has handed out; each side reports the peak during its timed
# steps (peak_heap_gib), the same measure on both sides, free of what allocators keep cached.
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$repo"
me=flux_vs_diffusers
rounds=2 threads=2 steps=2 warmup=1 text_tokens=128 blocks=1,2 libtorch26=0 unfused=0 unpacked=0
rows=lora,int8,checkpointing,full tokens=256,1024 peers=default,math
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) rounds="$2" ;;
    --threads) threads="$2" ;;
    --steps) steps="$2" ;;
    --warmup) warmup="$2" ;;
    --rows) rows="$2" ;;
    --tokens) tokens="$2" ;;
    --text_tokens) text_tokens="$2" ;;
    --blocks) blocks="$2" ;;
    --peers) peers="$2" ;;
    --libtorch26) libtorch26="$2" ;;
    --unfused) unfused="$2" ;;
    --unpacked) unpacked="$2" ;;
    *) echo "$me: unknown option $1 (see the header of bench/flux_vs_diffusers.sh)" >&2; exit 2 ;;
  esac
  shift 2
done
bench="$repo/build/bench/bench_flux_step"
bench26="$repo/build-cuda/bench/bench_flux_step"
script="bench/py/diffusers_flux_step.py"
peer="$repo/../shared/refstack2/run"
[[ -x "$bench" ]] || { echo "$me: build first (bash scripts/build): $bench is missing" >&2; exit 2; }
[[ -x "$peer" ]] || { echo "$me: ../shared/refstack2 is missing (the peer)" >&2; exit 2; }
if [[ "$libtorch26" == 1 && ! -x "$bench26" ]]; then
  echo "$me: --libtorch26 1 needs $bench26 (see the header)" >&2
  exit 2
fi
# The peer must call the same kind of BLAS (dit_vs_diffusers.sh says why).
blas=$("$peer" /bin/readlink -f /usr/lib/x86_64-linux-gnu/libblas.so.3)
[[ "$blas" == *openblas* ]] || {
  echo "$me: the peer's libblas.so.3 is $blas (the reference BLAS); install OpenBLAS in it first:" >&2
  echo "  ../shared/refstack2/run /bin/bash -c 'apt-get install -y libopenblas0-pthread'" >&2
  exit 2
}
shim="$repo/build/alloc_peak.so"
cc -O2 -shared -fPIC -o "$shim" bench/alloc_peak.c
IFS=, read -r layers singles <<<"$blocks"

echo "$me: $(lscpu | sed -n 's/^Model name: *//p' | head -1); $(grep -o -w -E 'avx512f|avx512_bf16|amx_bf16|amx_tile|avx2' /proc/cpuinfo | sort -u | tr '\n' ' ')"
echo "$me: $threads threads, $rounds rounds, $steps timed steps after $warmup warm-up, blocks $layers+$singles, text tokens $text_tokens"
results=$(mktemp)
trap 'rm -f "$results"' EXIT

row_flags() {  # the flags both sides take for a row
  case "$1" in
    lora) echo "--mode lora --gradient_checkpointing 0" ;;
    int8) echo "--mode lora --base_weights_dtype int8 --gradient_checkpointing 0" ;;
    checkpointing) echo "--mode lora --gradient_checkpointing 1" ;;
    full) echo "--mode full --gradient_checkpointing 0" ;;
    *) echo "$me: unknown row $1 (lora, int8, checkpointing, full)" >&2; exit 2 ;;
  esac
}

for ((r = 1; r <= rounds; r++)); do
  for row in ${rows//,/ }; do
    flags=$(row_flags "$row")
    for tok in ${tokens//,/ }; do
      common="$flags --image_tokens $tok --text_tokens $text_tokens --num_layers $layers"
      common="$common --num_single_layers $singles --steps $steps --warmup $warmup --threads $threads"
      # shellcheck disable=SC2086 # flags are word lists
      a=$(LD_PRELOAD="$shim" OMP_NUM_THREADS="$threads" "$bench" $common --lora_rank 16 \
        --mixed_precision bf16 --device cpu 2>/dev/null | tail -1)
      echo "$row $tok difftrain $a" | tee -a "$results"
      variants=()
      [[ "$unfused" == 1 ]] && variants+=(unfused:DIFFTRAIN_FUSED_KERNELS=0)
      [[ "$unpacked" == 1 ]] && variants+=(unpacked:DIFFTRAIN_PACKED_GRAD=0)
      for variant in "${variants[@]}"; do
        # shellcheck disable=SC2086
        a=$(env "${variant#*:}" LD_PRELOAD="$shim" OMP_NUM_THREADS="$threads" "$bench" \
          $common --lora_rank 16 --mixed_precision bf16 --device cpu 2>/dev/null | tail -1)
        echo "$row $tok difftrain-${variant%%:*} $a" | tee -a "$results"
      done
      if [[ "$libtorch26" == 1 ]]; then
        # shellcheck disable=SC2086
        a=$(bash scripts/debian13 run cuda env LD_PRELOAD="$shim" OMP_NUM_THREADS="$threads" \
          CUDA_VISIBLE_DEVICES= "$bench26" $common --lora_rank 16 --mixed_precision bf16 \
          --device cpu 2>/dev/null | tail -1)
        echo "$row $tok difftrain-2.6 $a" | tee -a "$results"
      fi
      for sdpa in ${peers//,/ }; do
        # shellcheck disable=SC2086
        b=$(OMP_NUM_THREADS="$threads" "$peer" env LD_PRELOAD="$shim" python3 "$script" $common \
          --lora_rank 16 --sdpa "$sdpa" 2>/dev/null | tail -1)
        echo "$row $tok diffusers-$sdpa $b" | tee -a "$results"
      done
    done
  done
done
python3 - "$results" <<'PY'
import collections, json, statistics, sys
runs = collections.defaultdict(list)
order = []
for line in open(sys.argv[1]):
    row, tok, side, js = line.split(" ", 3)
    key = (row, int(tok))
    if key not in order:
        order.append(key)
    runs[key + (side,)].append(json.loads(js))
sides = []
for k in runs:
    if k[2] not in sides:
        sides.append(k[2])
def med(key, field):
    vals = [r[field] for r in runs.get(key, []) if field in r]
    return statistics.median(vals) if vals else float("nan")
peers = [s for s in sides if s.startswith("diffusers")]
ours = [s for s in sides if s.startswith("difftrain")]
head = "| row | image + text tokens | " + " | ".join(f"{s} ms" for s in sides)
head += " | " + " | ".join(f"{p} / {o}" for o in ours for p in peers)
head += " | " + " | ".join(f"{s} peak heap GiB" for s in sides) + " |"
print(head)
print("|" + "---|" * (head.count(" | ") + 1))
for row, tok in order:
    text = runs[(row, tok, sides[0])][0]["tokens"][1]
    cells = [row, f"{tok} + {text}"]
    cells += [f"{med((row, tok, s), 'ms_per_step'):,.0f}" for s in sides]
    cells += [f"{med((row, tok, p), 'ms_per_step') / med((row, tok, o), 'ms_per_step'):.2f}x"
              for o in ours for p in peers]
    cells += [f"{med((row, tok, s), 'peak_heap_gib'):.2f}" for s in sides]
    print("| " + " | ".join(cells) + " |")
PY
