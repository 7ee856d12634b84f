#!/usr/bin/env bash
# GPU training throughput and memory, difftrain vs Diffusers + Accelerate, side by side in one
# run on the same GPU (bench_unet_step and bench/py/diffusers_unet_step.py: the same step on the
# same random inputs; see their headers):
#   default   the built-in Fashion-MNIST UNet2DModel (32x32, 1 channel, 11 class embeddings),
#             batch 32 (the default job's global batch), fp32 and bf16
#   sd15      configs/sd15_unet_config.json (random weights), 64x64 latents, 77x768 text states,
#             batch 8, bf16: full fine-tune, and LoRA rank 16 (PEFT's target modules)
# then `difftrain train` on the built-in default for $TRAIN_STEPS steps on the GPU (samples/s of
# its last logged window). Each pair runs interleaved for $ROUNDS rounds; medians are reported,
# with difftrain / Diffusers ratios (speed: higher is better; memory: lower is better).
#
#   bash bench/gpu_train.sh [build-gpu] [steps]
# Env: PYTHON (python3), ROUNDS (3), WARMUP (5), TRAIN_STEPS (200), PYSRC (a folder holding
# diffusers-v0.31.0/src and peft-v0.14.0/src; default .gpu-deps/py, as scripts/gpu_build
# fetch leaves it), SMOKE=1 (tiny configs on the CPU: checks the script itself, no figures).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build-gpu}" && pwd)
steps=${2:-20}
python=${PYTHON:-python3}
rounds=${ROUNDS:-3}
warmup=${WARMUP:-5}
train_steps=${TRAIN_STEPS:-200}
pysrc=${PYSRC:-$root/.gpu-deps/py}
if [ -d "$pysrc/diffusers-v0.31.0/src" ]; then
  export PYTHONPATH="$pysrc/diffusers-v0.31.0/src:$pysrc/peft-v0.14.0/src${PYTHONPATH:+:$PYTHONPATH}"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

# The built-in default model: default_unet_config(32, 1) in src/train/parts.cpp, class-conditional
# with 10 Fashion-MNIST classes + the null class.
cat >"$work/default.json" <<'JSON'
{"_class_name": "UNet2DModel", "sample_size": 32, "in_channels": 1, "out_channels": 1,
 "layers_per_block": 1, "block_out_channels": [32, 64, 64],
 "down_block_types": ["DownBlock2D", "DownBlock2D", "AttnDownBlock2D"],
 "up_block_types": ["AttnUpBlock2D", "UpBlock2D", "UpBlock2D"], "norm_num_groups": 8,
 "attention_head_dim": 32, "num_class_embeds": 11}
JSON

device=cuda
if [ "${SMOKE:-0}" = 1 ]; then
  device=cpu
  cp "$root/tests/golden/diffusers/unet_cond/config.json" "$work/sd15.json"
  cases=("default no 4 32 0" "sd15 no 2 16 0" "sd15 no 2 16 4")
  train_steps=4
else
  cp "$root/configs/sd15_unet_config.json" "$work/sd15.json"
  cases=("default no 32 32 0" "default bf16 32 32 0" "sd15 bf16 8 64 0" "sd15 bf16 8 64 16")
fi

results=$work/results.jsonl
for ((round = 1; round <= rounds; round++)); do
  for c in "${cases[@]}"; do
    read -r model mp batch res rank <<<"$c"
    common=(--config "$work/$model.json" --batch "$batch" --resolution "$res" --mixed_precision "$mp"
            --lora_rank "$rank" --steps "$steps" --warmup "$warmup" --device "$device")
    "$build/bench/bench_unet_step" "${common[@]}" | sed "s/^{/{\"case\": \"$model\", \"round\": $round, /" >>"$results"
    "$python" "$root/bench/py/diffusers_unet_step.py" "${common[@]}" 2>"$work/py.err" |
      sed "s/^{/{\"case\": \"$model\", \"round\": $round, /" >>"$results" ||
      { cat "$work/py.err" >&2; exit 1; }
  done
done

# `difftrain train` on the built-in default, on the GPU, one process.
train_args=(train --max_train_steps "$train_steps" --lr_warmup_steps 0 --checkpointing_steps 0 --num_validation_images 0
            --logging_steps 50 --output_dir "$work/run")
[ -n "${DIFFTRAIN_FASHION_MNIST_DIR:-}" ] && train_args+=(--train_data_dir "$DIFFTRAIN_FASHION_MNIST_DIR")
"$build/bin/difftrain" "${train_args[@]}" >"$work/train.log" 2>&1 || { cat "$work/train.log" >&2; exit 1; }
train_line=$(grep -E "step [0-9]+/[0-9]+ \|" "$work/train.log" | tail -n 1)

"$python" - "$results" "$train_line" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
key = lambda r: (r["case"], r["mixed_precision"], r["batch"], r["resolution"], r["lora_rank"])
groups = {}
for r in rows:
    groups.setdefault(key(r), {}).setdefault(r["impl"], []).append(r)
dev = next((r.get("device_name") for r in rows if r.get("device_name")), rows[0]["device"])
torch_v = next((r["torch"] for r in rows if "torch" in r), "?")
print(f"device: {dev}; Python peer: torch {torch_v}; medians of {max(len(v) for g in groups.values() for v in g.values())} rounds")
print("| model | precision | batch | latents | LoRA | difftrain samples/s | Diffusers samples/s | speed ratio | difftrain peak GiB | Diffusers peak GiB | memory ratio |")
print("|---|---|---|---|---|---|---|---|---|---|---|")
for k, g in groups.items():
    d, p = g["difftrain"], g["diffusers"]
    ds = statistics.median(r["samples_per_s"] for r in d)
    ps = statistics.median(r["samples_per_s"] for r in p)
    dm = statistics.median(r["peak_mem_gib"] for r in d)
    pm = statistics.median(r["peak_mem_gib"] for r in p)
    case, mp, b, res, rank = k
    print(f"| {case} | {mp} | {b} | {res}x{res} | {rank or 'full'} | {ds:.1f} | {ps:.1f} | {ds/ps:.2f}x | {dm:.2f} | {pm:.2f} | {dm/pm:.2f}x |")
print(f"difftrain train (built-in default, one process): {sys.argv[2].split('info: ')[-1]}")
PY
