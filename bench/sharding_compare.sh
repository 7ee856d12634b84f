#!/usr/bin/env bash
# Sharding strategies side by side at 2 ranks (1 intra-op thread each, the same per-rank batch):
# samples/s relative to NO_SHARD, and per-rank state bytes and peak resident memory. Runs
# interleaved for several rounds; reports medians (a shared 2-vCPU machine drifts).
#   bash bench/sharding_compare.sh [build] [iters] [batch] [rounds] [channels]
set -euo pipefail
build=${1:-build}
iters=${2:-10}
batch=${3:-8}
rounds=${4:-3}
channels=${5:-64}
difftrain=$build/bin/difftrain
bench=$build/bench/bench_sharding
run() {  # strategy prefetch
  DIFFTRAIN_NUM_THREADS=1 "$difftrain" launch --num_processes 2 --cpu \
    --num_cpu_threads_per_process 1 "$bench" --strategy "$1" --prefetch "$2" --iters "$iters" \
    --batch "$batch" --channels "$channels" 2>/dev/null | grep '^\[rank 0\] {' | sed 's/^\[rank 0\] //'
}
results=$(mktemp)
for round in $(seq "$rounds"); do
  for s in NO_SHARD SHARD_OPTIMIZER SHARD_GRAD_OP FULL_SHARD; do run "$s" 1 >>"$results"; done
  run FULL_SHARD 0 >>"$results"
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
def key(r): return r["strategy"] + ("" if r["prefetch"] else " (no prefetch)")
keys = []
for r in rows:
    if key(r) not in keys: keys.append(key(r))
base = statistics.median(r["samples_per_s"] for r in rows if key(r) == "NO_SHARD")
p = rows[0]
print(f"UNet2DModel {p['params']/1e6:.2f} M parameters, 2 ranks x batch {p['batch_per_rank']}, "
      f"median of {sum(1 for r in rows if key(r) == 'NO_SHARD')} rounds")
print("| strategy | samples/s | vs NO_SHARD | params MiB (peak) | grads MiB (peak) | optimizer MiB | peak RSS MiB |")
print("|---|---|---|---|---|---|---|")
mib = 1 / 2**20
for k in keys:
    rs = [r for r in rows if key(r) == k]
    sps = statistics.median(r["samples_per_s"] for r in rs)
    r = rs[0]
    rss = statistics.median(x["peak_rss_bytes"] for x in rs)
    print(f"| {k} | {sps:.1f} | {sps / base:.2f} | {r['param_bytes']*mib:.1f} ({r['param_peak_bytes']*mib:.1f}) "
          f"| {r['grad_bytes']*mib:.1f} ({r['grad_peak_bytes']*mib:.1f}) | {r['optimizer_bytes']*mib:.1f} | {rss*mib:.0f} |")
PY
rm -f "$results"
