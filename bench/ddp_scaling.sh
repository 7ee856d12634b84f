#!/usr/bin/env bash
# DDP scaling of the Accelerator, side by side in one run: step time on 1 rank against 2 ranks
# (1 intra-op thread each, same per-rank batch) with the all-reduce overlapped with backward and
# after it, plus 2 ranks that train independently with no communication at all (the ceiling
# the machine leaves for 2 processes). The configurations run interleaved for several rounds and
# the median step time is reported, because a shared 2-vCPU machine drifts by 10-30% over a
# minute. Models: conv (compute-heavy, 0.15 M parameters) and wide (4.4 M parameters, a 17 MB
# gradient all-reduce per step).
#   [MODELS="conv wide"] bash bench/ddp_scaling.sh [build] [iters] [batch] [rounds]
set -euo pipefail
build=${1:-build}
iters=${2:-20}
batch=${3:-8}
rounds=${4:-3}
models=${MODELS:-conv wide}
difftrain=$build/bin/difftrain
bench=$build/bench/bench_ddp
run() {  # ranks model overlap ddp
  DIFFTRAIN_NUM_THREADS=1 "$difftrain" launch --num_processes "$1" --cpu \
    --num_cpu_threads_per_process 1 "$bench" --model "$2" --overlap "$3" --ddp "$4" \
    --iters "$iters" --batch "$batch" 2>/dev/null | grep '^\[rank 0\] {' | sed 's/^\[rank 0\] //'
}
results=$(mktemp)
for round in $(seq "$rounds"); do
  for model in $models; do
    run 1 "$model" 1 1 >>"$results"
    run 2 "$model" 1 0 >>"$results"
    run 2 "$model" 1 1 >>"$results"
    run 2 "$model" 0 1 >>"$results"
  done
done
python3 - "$results" <<'PY'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for model in sorted({r["model"] for r in rows}):
    def med(ranks, ddp, overlap):
        v = [r["step_ms"] for r in rows if r["model"] == model and r["ranks"] == ranks
             and r["ddp"] == ddp and r["overlap"] == overlap]
        return statistics.median(v), len(v)
    (one, n), (free, _), (on, _), (off, _) = (med(1, True, True), med(2, False, True),
                                             med(2, True, True), med(2, True, False))
    p = next(r for r in rows if r["model"] == model)
    print(f"{model} (params {p['params']}, batch {p['batch_per_rank']}/rank, median of {n}): "
          f"step ms 1 rank {one:.1f} | 2 ranks no-comm {free:.1f} | DDP overlap {on:.1f} | "
          f"DDP after-backward {off:.1f}")
    # Same per-rank batch: 2-rank throughput / (2 x 1-rank throughput) = t1 / t2.
    print(f"  scaling efficiency (2 ranks vs 2 x 1 rank): no-comm {one / free:.1%}, "
          f"overlap {one / on:.1%}, after-backward {one / off:.1%}")
    def med_field(field, overlap):
        return statistics.median(r[field] for r in rows if r["model"] == model
                                 and r["ranks"] == 2 and r["ddp"] and r["overlap"] == overlap)
    print(f"  rank 0 time split with overlap: forward {med_field('forward_ms', True):.1f} ms, "
          f"backward {med_field('backward_ms', True):.1f} ms, waiting for all-reduces after "
          f"backward {med_field('wait_ms', True):.1f} ms (after-backward mode: "
          f"{med_field('wait_ms', False):.1f} ms)")
    comm_on, comm_off = on - free, off - free
    print(f"  DDP vs the no-comm ceiling: overlap {free / on:.1%}, after-backward {free / off:.1%}; "
          f"communication cost per step: overlap {comm_on:.1f} ms, after-backward {comm_off:.1f} ms")
PY
rm -f "$results"
