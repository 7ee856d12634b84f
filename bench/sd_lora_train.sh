#!/usr/bin/env bash
# Text-to-image LoRA training (`difftrain train --lora --rank 4` on the tiny random SD fixture
# tests/golden/sd/tiny_sd, 64x64 captioned images, batch 4 per rank), variants side by side:
#   plain        the VAE encodes each batch's images and CLIP its captions on every step;
#   cached       --cache_latents into a cache dir filled once before the rounds (steady state:
#                the cache is reused across epochs and restarts);
#   cached-fresh --cache_latents into a fresh cache dir (pays the one-time encoding);
#   bf16         --mixed_precision bf16 (frozen UNet, VAE and text encoder held in bf16);
#   2 ranks      plain under `difftrain launch --num_processes 2` (1 intra-op thread per rank;
#                the 1-rank runs use both cores with 2 threads).
# The variants run interleaved for several rounds and the medians are reported, because a shared
# 2-vCPU machine drifts. samples/s is the training loop's steady state: the trainer's metrics.jsonl
# gives, at every step, samples so far / seconds since the loop started, from which the script
# takes (steps - WARMUP) x global batch / the loop's seconds after step WARMUP. The loop excludes
# loading, cache filling and the final save; "whole run" divides all samples by the process's wall
# time. "system share" is kernel time / (user + kernel) CPU time over the ranks, from the same
# /usr/bin/time. Peak RSS is /usr/bin/time's "Maximum resident set size" of each training process; this
# script alone needs Debian's `time` package (apt-get install time). python3 (standard library
# only) writes the images.
#   [IMAGES=32] [WARMUP=5] bash bench/sd_lora_train.sh [build] [steps] [rounds]
set -euo pipefail
build=${1:-build}
steps=${2:-30}
rounds=${3:-3}
images=${IMAGES:-32}
warmup=${WARMUP:-5}
root=$(cd "$(dirname "$0")/.." && pwd)
difftrain=$(cd "$build" && pwd)/bin/difftrain
[ -x /usr/bin/time ] || { echo "needs /usr/bin/time: apt-get install time" >&2; exit 1; }
((steps > warmup)) || { echo "steps ($steps) must be more than WARMUP ($warmup)" >&2; exit 1; }
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# Captioned 64x64 PNGs: a red/green/blue/yellow square or circle on white, one caption each.
python3 - "$work/data" "$images" 64 <<'PY'
import json, os, random, struct, sys, zlib
out, n, size = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
os.makedirs(out)
def chunk(tag, data):
    return struct.pack(">I", len(data)) + tag + data + struct.pack(">I", zlib.crc32(tag + data))
colours = {"red": (220, 40, 40), "green": (40, 180, 60), "blue": (40, 70, 220), "yellow": (230, 210, 40)}
rng = random.Random(0)
with open(os.path.join(out, "metadata.jsonl"), "w") as meta:
    for i in range(n):
        name, rgb = rng.choice(sorted(colours.items()))
        shape = rng.choice(["square", "circle"])
        cx, cy, r = rng.randint(16, size - 16), rng.randint(16, size - 16), rng.randint(6, 14)
        raw = bytearray()
        for y in range(size):
            raw.append(0)  # PNG filter type 0 for the row
            for x in range(size):
                inside = (max(abs(x - cx), abs(y - cy)) <= r if shape == "square"
                          else (x - cx) ** 2 + (y - cy) ** 2 <= r * r)
                raw.extend(rgb if inside else (245, 245, 245))
        with open(os.path.join(out, f"{i:04d}.png"), "wb") as f:
            f.write(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0))
                    + chunk(b"IDAT", zlib.compress(bytes(raw))) + chunk(b"IEND", b""))
        meta.write(json.dumps({"file_name": f"{i:04d}.png", "text": f"a {name} {shape} on a white background"}) + "\n")
PY

# --lr_warmup_steps 0 only so that short runs pass the scheduler's check; it does not change the work.
common=(--pretrained_model_name_or_path "$root/tests/golden/sd/tiny_sd" --dataset imagefolder
  --train_data_dir "$work/data" --resolution 64 --center_crop --lora --rank 4 --train_batch_size 4
  --lr_warmup_steps 0 --num_validation_images 0 --use_ema false
  --logging_steps 1 --checkpointing_steps 0)
run() {  # name ranks steps [train flags...]; leaves train/metrics.jsonl, log, time.<rank> in runs/
  local name=$1 ranks=$2 n=$3 out
  shift 3
  out=$work/runs/$name-$round
  mkdir -p "$out"
  if [ "$ranks" = 1 ]; then
    /usr/bin/time -f '%M %e %U %S' -o "$out/time.0" \
      "$difftrain" train "${common[@]}" --max_train_steps "$n" --output_dir "$out/train" "$@" >"$out/log" 2>&1
  else
    "$difftrain" launch --num_processes "$ranks" --cpu \
      bash -c '/usr/bin/time -f "%M %e %U %S" -o "$0.$RANK" "$@"' "$out/time" \
      "$difftrain" train "${common[@]}" --max_train_steps "$n" --output_dir "$out/train" "$@" >"$out/log" 2>&1
  fi || { echo "$name (round $round) failed:" >&2; tail -n 30 "$out/log" >&2; exit 1; }
  printf '{"name": "%s", "ranks": %s, "dir": "%s"}\n' "$name" "$ranks" "$out" >>"$work/runs.jsonl"
}
# Fill the steady-state cache once (latents and caption embeddings).
round=0
run fill 1 1 --cache_latents --cache_dir "$work/cache"
: >"$work/runs.jsonl"
for round in $(seq "$rounds"); do
  run plain 1 "$steps"
  run cached 1 "$steps" --cache_latents --cache_dir "$work/cache"
  run cached-fresh 1 "$steps" --cache_latents --cache_dir "$work/runs/cached-fresh-$round/cache"
  run bf16 1 "$steps" --mixed_precision bf16
  run 2-ranks 2 "$steps"
done

echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
python3 - "$work/runs.jsonl" "$steps" "$warmup" "$images" <<'PY'
import glob, json, statistics, sys
runs_file, steps, warmup, images = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
batch = 4
rows = []
for run in map(json.loads, open(runs_file)):
    gb = batch * run["ranks"]
    m = {r["step"]: r for r in map(json.loads, open(run["dir"] + "/train/metrics.jsonl"))}
    assert max(m) == steps, run
    # samples_per_second at step k = k * global batch / seconds since the loop started.
    t = {k: k * gb / r["samples_per_second"] for k, r in m.items()}
    # /usr/bin/time: peak RSS KiB, wall s, user s, system s (one file per rank).
    times = [list(map(float, open(f).read().split()[-4:])) for f in sorted(glob.glob(run["dir"] + "/time.*"))]
    wall = times[0][1]  # rank 0
    rows.append(dict(name=run["name"], ranks=run["ranks"], gb=gb,
                     steady=(steps - warmup) * gb / (t[steps] - t[warmup]),
                     whole=steps * gb / wall, outside=wall - t[steps],
                     sys=sum(x[3] for x in times) / sum(x[2] + x[3] for x in times),
                     rss=[x[0] / 1024 for x in times]))
def med(name, key):
    return statistics.median(r[key] for r in rows if r["name"] == name)
names = list(dict.fromkeys(r["name"] for r in rows))
n = sum(1 for r in rows if r["name"] == "plain")
base, base_whole = med("plain", "steady"), med("plain", "whole")
labels = {"plain": "plain (1 rank, 2 threads)", "cached": "--cache_latents, cache already filled",
          "cached-fresh": "--cache_latents, fresh cache (one-time encoding)",
          "bf16": "--mixed_precision bf16", "2-ranks": "plain, 2 ranks x 1 thread"}
print(f"tiny_sd LoRA rank 4, {images} images 64x64, batch 4 per rank, {steps} steps, "
      f"loop samples/s over steps {warmup + 1}-{steps}, median of {n} rounds")
print("| variant | samples/s (loop) | min-max | vs plain | samples/s (whole run) | vs plain "
      "| s outside the loop | system share of CPU time | peak RSS MiB per rank |")
print("|---|---|---|---|---|---|---|---|---|")
for name in names:
    rs = [r for r in rows if r["name"] == name]
    rss = " / ".join(f"{statistics.median(r['rss'][i] for r in rs):.0f}" for i in range(rs[0]["ranks"]))
    steady, whole = med(name, "steady"), med(name, "whole")
    lo, hi = min(r["steady"] for r in rs), max(r["steady"] for r in rs)
    print(f"| {labels.get(name, name)} | {steady:.2f} | {lo:.2f}-{hi:.2f} | {steady / base:.2f} | {whole:.2f} "
          f"| {whole / base_whole:.2f} | {med(name, 'outside'):.1f} | {med(name, 'sys'):.0%} | {rss} |")
fill = med("cached-fresh", "outside") - med("cached", "outside")
print(f"one-time cache fill (s outside the loop, fresh cache - filled cache): {fill:.1f} s "
      f"for {images} images and their captions")
PY
