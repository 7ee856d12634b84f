#!/usr/bin/env bash
# How much of a finished Ninja build the given targets need, from its .ninja_log: the summed
# seconds of every edge those targets depend on (each edge's wall time; with `ninja -j N` on N
# otherwise idle cores, about its CPU time), against the whole build's, and what that sum becomes
# on more cores: sum / cores, bounded below by the serial chain that no core count shortens (the
# precompiled header, the library's archive, the longest link). scripts/gpu_check's build stage
# was sized this way from the Debian 13 CUDA root's build (docs/LIBTORCH.md).
#
#   bash bench/build_share.sh BUILD_DIR [CORES] [TARGET...]
# Default CORES 16, TARGETS: difftrain difftrain-cli difftrain_gpu_tests bench_unet_step.
set -euo pipefail
build=$1
cores=${2:-16}
shift $(($# >= 2 ? 2 : $#))
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(difftrain difftrain-cli difftrain_gpu_tests bench_unet_step)
[ -f "$build/.ninja_log" ] || { echo "build_share: no $build/.ninja_log: build first" >&2; exit 1; }
# The outputs of every command the targets need: `-o OUT` of compile and link commands, and the
# archive of `ar`.
ninja -C "$build" -t commands "${targets[@]}" |
  sed -n -e 's/.* -o \([^ ]*\).*/\1/p' -e 's/.*\(ar\|ranlib\) [a-z]* \([^ ]*\.a\) .*/\2/p' |
  sort -u >"$build/.build_share_outputs"
python3 - "$build/.ninja_log" "$build/.build_share_outputs" "$cores" "${targets[*]}" <<'PY'
import sys
log, outs_file, cores, targets = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
edges = {}
for line in open(log):
    if line.startswith("#"):
        continue
    start, end, _, out, _ = line.rstrip("\n").split("\t")
    edges[out] = (int(end) - int(start)) / 1000.0  # the last run of each output
wanted = {l.strip() for l in open(outs_file) if l.strip()}
sub = {o: s for o, s in edges.items() if o in wanted}
total, part = sum(edges.values()), sum(sub.values())
serial = sum(s for o, s in sub.items() if o.endswith((".gch", ".a")))
links = [s for o, s in sub.items() if not o.endswith((".o", ".gch", ".a"))]
serial += max(links, default=0.0)
longest_tu = max((s for o, s in sub.items() if o.endswith(".o")), default=0.0)
print(f"build_share: {len(sub)} of {len(edges)} edges for {targets}: {part:.0f} s of {total:.0f} s "
      f"({100 * part / max(total, 1e-9):.0f}%)")
print(f"build_share: serial part (precompiled header, archive, longest link) {serial:.0f} s; longest "
      f"compile {longest_tu:.0f} s")
print(f"build_share: on {cores} cores about max({part:.0f} / {cores}, serial + longest compile) = "
      f"{max(part / cores, serial + longest_tu):.0f} s; on 2 cores {part / 2:.0f} s")
PY
