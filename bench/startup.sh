#!/usr/bin/env bash
# Start-up of a difftrain process with and without scripts/link_order's library order, side by
# side: build/bench/startup_probe (libraries named first) and startup_probe_natural (the linker's
# order) load LibTorch, run one tensor op and leave; runs alternate, medians and the ratio printed.
#   bash bench/startup.sh [RUNS (default 30)] [BUILD_DIR (default build)]
set -euo pipefail
repo="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
runs="${1:-30}"
build="${2:-$repo/build}"
for probe in startup_probe startup_probe_natural; do
  [[ -x "$build/bench/$probe" ]] || { echo "startup: $build/bench/$probe not built (ninja -C $build $probe)" >&2; exit 2; }
done
exec python3 - "$build/bench" "$runs" <<'PY'
import resource, statistics, subprocess, sys, time
bench, runs = sys.argv[1], int(sys.argv[2])
probes = ["startup_probe", "startup_probe_natural"]
wall = {p: [] for p in probes}
cpu = {p: [] for p in probes}
for i in range(runs):
    for p in probes if i % 2 == 0 else probes[::-1]:
        r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        subprocess.run([f"{bench}/{p}"], stdout=subprocess.DEVNULL, check=True)
        wall[p].append(time.perf_counter() - t0)
        r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu[p].append(r1.ru_utime - r0.ru_utime + r1.ru_stime - r0.ru_stime)
print(f"{runs} alternating runs each; medians (s)")
print(f"{'probe':24} {'wall':>7} {'cpu':>7}")
for p in probes:
    print(f"{p:24} {statistics.median(wall[p]):7.3f} {statistics.median(cpu[p]):7.3f}")
n, o = statistics.median(wall["startup_probe_natural"]), statistics.median(wall["startup_probe"])
print(f"natural / ordered: {n / o:.2f}x ({(n - o) * 1000:.0f} ms less per process start)")
PY
