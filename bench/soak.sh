#!/usr/bin/env bash
# Soak: `difftrain train` of a tiny UNet (8x8 Fashion-MNIST, batch 8 per rank) on 2 ranks under
# `difftrain launch` for STEPS optimizer steps, with a checkpoint every 500 steps (keeping 2),
# TensorBoard + JSONL logging every 50 steps and an EMA. Every INTERVAL seconds it reads each
# rank's resident memory (VmRSS), open file descriptors (/proc/<pid>/fd) and threads (Threads:)
# from /proc, and at the end reports per rank: RSS at the end of warm-up (the first WARM percent
# of the samples) and at the end, the least-squares RSS slope after warm-up in KiB per 1000 steps
# and MiB per hour, and the min/max of fds and threads after warm-up. Samples go to $OUT/soak.csv.
#   [INTERVAL=2] [WARM=20] [OUT=dir] bash bench/soak.sh [build] [steps]
set -euo pipefail
build=${1:-build}
steps=${2:-5000}
interval=${INTERVAL:-2}
warm=${WARM:-20}
difftrain=$(cd "$build" && pwd)/bin/difftrain
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
cat > "$out/tiny_unet.json" <<'JSON'
{"_class_name": "UNet2DModel", "sample_size": 8, "in_channels": 1, "out_channels": 1,
 "layers_per_block": 1, "block_out_channels": [8, 16],
 "down_block_types": ["DownBlock2D", "AttnDownBlock2D"],
 "up_block_types": ["AttnUpBlock2D", "UpBlock2D"], "norm_num_groups": 4, "attention_head_dim": 8}
JSON
rm -rf "$out/run"
echo "soak: $steps steps on 2 ranks, sampling every ${interval}s into $out/soak.csv"
start=$(date +%s.%N)
"$difftrain" launch --num_processes 2 "$difftrain" train \
  --model_config_name_or_path "$out/tiny_unet.json" --resolution 8 --max_train_samples 1024 \
  --train_batch_size 8 --learning_rate 1e-3 --lr_warmup_steps 10 --max_train_steps "$steps" \
  --checkpointing_steps 500 --checkpoints_total_limit 2 --logging_steps 50 --report_to all \
  --use_ema --num_validation_images 0 --output_dir "$out/run" > "$out/train.log" 2>&1 &
launcher=$!
echo "t,rank,pid,rss_kib,fds,threads" > "$out/soak.csv"
while kill -0 "$launcher" 2>/dev/null; do
  sleep "$interval"
  now=$(date +%s.%N)
  rank=0
  for pid in $(pgrep -P "$launcher" | sort -n); do
    rss=$(awk '/^VmRSS:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || continue
    threads=$(awk '/^Threads:/ {print $2}' "/proc/$pid/status" 2>/dev/null) || continue
    fds=$(ls "/proc/$pid/fd" 2>/dev/null | wc -l)
    [ -n "$rss" ] && echo "$(awk -v a="$now" -v b="$start" 'BEGIN {print a - b}'),$rank,$pid,$rss,$fds,$threads" >> "$out/soak.csv"
    rank=$((rank + 1))
  done
done
wait "$launcher" || { echo "soak: the job failed; see $out/train.log" >&2; tail -20 "$out/train.log" >&2; exit 1; }
seconds=$(awk -v a="$(date +%s.%N)" -v b="$start" 'BEGIN {print a - b}')
echo "job finished in ${seconds}s ($(awk -v s="$steps" -v t="$seconds" 'BEGIN {printf "%.1f", s / t}') steps/s)"
awk -F, -v warm="$warm" -v steps="$steps" -v secs="$seconds" '
  NR > 1 { n[$2]++; t[$2, n[$2]] = $1; r[$2, n[$2]] = $4; f[$2, n[$2]] = $5; h[$2, n[$2]] = $6 }
  END {
    for (k = 0; k in n; k++) {
      first = int(n[k] * warm / 100) + 1
      sx = sy = sxx = sxy = 0; m = 0; fmin = hmin = 1e9; fmax = hmax = 0
      for (i = first; i <= n[k]; i++) {
        m++; sx += t[k, i]; sy += r[k, i]; sxx += t[k, i] * t[k, i]; sxy += t[k, i] * r[k, i]
        if (f[k, i] < fmin) fmin = f[k, i]; if (f[k, i] > fmax) fmax = f[k, i]
        if (h[k, i] < hmin) hmin = h[k, i]; if (h[k, i] > hmax) hmax = h[k, i]
      }
      slope = (m * sxy - sx * sy) / (m * sxx - sx * sx)  # KiB per second
      printf "rank %d: %d samples after warm-up; RSS %.1f MiB at warm-up end, %.1f MiB at the end; slope %+.2f KiB per 1000 steps (%+.2f MiB/hour); fds %d..%d; threads %d..%d\n",
        k, m, r[k, first] / 1024, r[k, n[k]] / 1024, slope * secs / steps * 1000, slope * 3600 / 1024,
        fmin, fmax, hmin, hmax
    }
  }' "$out/soak.csv"
