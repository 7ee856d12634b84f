#!/usr/bin/env bash
# GPU training throughput, memory and model FLOPs utilisation, difftrain vs Diffusers + Accelerate,
# side by side in one run on the same GPU (bench_unet_step and bench/py/diffusers_unet_step.py:
# the same step on the same random inputs; see their headers):
#   default   the built-in Fashion-MNIST UNet2DModel (32x32, 1 channel, 11 class embeddings),
#             batch 32 (the default job's global batch), fp32 and bf16
#   sd15      configs/sd15_unet_config.json (random weights), 64x64 latents, 77x768 text states,
#             batch 8, bf16: full fine-tune, and LoRA rank 16 (PEFT's target modules)
#   sdxl      configs/sdxl-base-1.0/unet/config.json (random weights), 128x128 latents, 77x2048
#             text states + SDXL's added conditioning (text_embeds, time_ids), batch 2, bf16,
#             LoRA rank 16
#   flux      FLUX.1-sized transformer blocks (bench_flux_step): LoRA r16 on a bf16 / int8 / fp8
#             base, full fine-tune without and with optimizer offload; and the LoRA r16 step on
#             the bf16 base against Diffusers' FluxTransformer2DModel + PEFT
#             (bench/py/diffusers_flux_step.py on this machine's PyTorch)
# then `difftrain train` on the built-in default for $TRAIN_STEPS steps on the GPU (samples/s of
# its last logged window). Each pair runs interleaved for $ROUNDS rounds (fewer when
# BENCH_DEADLINE comes first); medians are reported,
# with difftrain / Diffusers ratios (speed: higher is better; memory: lower is better), and
# TFLOP/s and MFU (step FLOPs x steps/s / the GPU's peak) for both sides.
#
#   bash bench/gpu_train.sh [build-gpu] [steps]
# Env: PYTHON (python3), ROUNDS (3), FLUX_ROUNDS (1), WARMUP (5), TRAIN_STEPS (200), PYSRC (a folder holding
# diffusers-v0.31.0/src and peft-v0.14.0/src, e.g. bench/py/trim_refstack.py's output; default
# .gpu-deps/py, as scripts/gpu_build fetch leaves it: a fallback only, appended to the peer's
# sys.path, so the machine's own peft, accelerate and transformers win), GPU_PEAK_TFLOPS (the
# peak for MFU; default: the dense bf16 datasheet figure of a known GPU), OUT_DIR (also write
# results.jsonl, train.log and table.md there), SMOKE=1 (tiny configs on the CPU, 4 steps: checks
# the script itself, no figures).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
build=$(cd "${1:-$root/build-gpu}" && pwd)
smoke=${SMOKE:-0}
if [ "$smoke" = 1 ]; then def_steps=4 def_warmup=1; else def_steps=20 def_warmup=5; fi
steps=${2:-$def_steps}
python=${PYTHON:-python3}
rounds=${ROUNDS:-3}
warmup=${WARMUP:-$def_warmup}
train_steps=${TRAIN_STEPS:-200}
pysrc=${PYSRC:-$root/.gpu-deps/py}
if [ -d "$pysrc/diffusers-v0.31.0/src" ]; then
  export DIFFTRAIN_PY_FALLBACK="$pysrc/diffusers-v0.31.0/src:$pysrc/peft-v0.14.0/src"
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
out_dir=$work
if [ -n "${OUT_DIR:-}" ]; then
  mkdir -p "$OUT_DIR"
  out_dir=$(cd "$OUT_DIR" && pwd)
fi

# The built-in default model: default_unet_config(32, 1) in src/train/parts.cpp, class-conditional
# with 10 Fashion-MNIST classes + the null class.
cat >"$work/default.json" <<'JSON'
{"_class_name": "UNet2DModel", "sample_size": 32, "in_channels": 1, "out_channels": 1,
 "layers_per_block": 1, "block_out_channels": [32, 64, 64],
 "down_block_types": ["DownBlock2D", "DownBlock2D", "AttnDownBlock2D"],
 "up_block_types": ["AttnUpBlock2D", "UpBlock2D", "UpBlock2D"], "norm_num_groups": 8,
 "attention_head_dim": 32, "num_class_embeds": 11}
JSON

# Cases: "model precision batch resolution lora_rank" (model: $work/<model>.json).
device=cuda
if [ "$smoke" = 1 ]; then
  device=cpu
  cp "$root/tests/golden/diffusers/unet_cond/config.json" "$work/sd15.json"
  cp "$root/tests/golden/sdxl/tiny_sdxl/unet/config.json" "$work/sdxl.json"
  cases=("default no 4 32 0" "sd15 no 2 16 0" "sd15 no 2 16 4" "sdxl no 2 16 4")
  train_steps=4
else
  cp "$root/configs/sd15_unet_config.json" "$work/sd15.json"
  cp "$root/configs/sdxl-base-1.0/unet/config.json" "$work/sdxl.json"
  cases=("default no 32 32 0" "default bf16 32 32 0" "sd15 bf16 8 64 0" "sd15 bf16 8 64 16"
         "sdxl bf16 2 128 16")
fi
# ---- FLUX.1-sized blocks (issue 42: the 8-bit base and ZeRO-Offload) ----
# bench_flux_step: 2 double- + 4 single-stream blocks at FLUX.1's width (3072), 4096 image + 512
# text tokens (1024x1024 px), bf16, gradient checkpointing: LoRA r16 on a bf16 / int8 / fp8_e4m3
# base, and a full fine-tune step without and with optimizer offload (SHARD_GRAD_OP over a world
# of one). difftrain only (no peer), one row per case, medians over the rounds.
# Cases: "mode base offload".
flux_common=(--num_layers 2 --num_single_layers 4 --heads 24 --image_tokens 4096 --text_tokens 512
             --mixed_precision bf16 --gradient_checkpointing 1 --lora_rank 16 --steps "$steps"
             --warmup "$warmup" --device "$device")
flux_cases=("lora none 0" "lora int8 0" "lora fp8_e4m3 0" "full none 0" "full none 1")
if [ "$smoke" = 1 ]; then
  flux_common=(--num_layers 1 --num_single_layers 1 --heads 2 --image_tokens 64 --text_tokens 16
               --mixed_precision bf16 --gradient_checkpointing 1 --lora_rank 4 --steps "$steps"
               --warmup "$warmup" --device "$device")
  flux_cases=("lora none 0" "lora int8 0" "full none 0" "full none 1")
fi
flux_results=$out_dir/flux.jsonl
: >"$flux_results"
flux_note=""

results=$out_dir/results.jsonl
: >"$results"
# BENCH_DEADLINE (epoch seconds, optional; scripts/gpu_check sets it from its budget): a round is
# started only when the last round's duration still fits before it (the first always runs), so a
# lease-bound run reports the medians of the rounds it completed instead of being cut off.
deadline=${BENCH_DEADLINE:-0}
round_start=$(date +%s)
for ((round = 1; round <= rounds; round++)); do
  if ((round > 1 && deadline > 0)); then
    now=$(date +%s)
    if ((now + (now - round_start) / (round - 1) > deadline)); then
      echo "gpu_train: stopping after $((round - 1)) of $rounds rounds: another would pass BENCH_DEADLINE" >&2
      break
    fi
  fi
  for c in "${cases[@]}"; do
    read -r model mp batch res rank <<<"$c"
    common=(--config "$work/$model.json" --batch "$batch" --resolution "$res" --mixed_precision "$mp"
            --lora_rank "$rank" --steps "$steps" --warmup "$warmup" --device "$device")
    # Each row is also printed as it comes, so a run stopped by a time limit keeps what it had.
    "$build/bench/bench_unet_step" "${common[@]}" |
      sed "s/^{/{\"case\": \"$model\", \"round\": $round, /" | tee -a "$results"
    "$python" "$root/bench/py/diffusers_unet_step.py" "${common[@]}" 2>"$work/py.err" |
      sed "s/^{/{\"case\": \"$model\", \"round\": $round, /" | tee -a "$results" ||
      { cat "$work/py.err" >&2; exit 1; }
  done
done

# FLUX.1-sized blocks: each case in its own process (peak memory is per process).
# FLUX_ROUNDS (default 1: each case builds a 1.2B-parameter model); a case starts only before
# BENCH_DEADLINE.
for ((round = 1; round <= ${FLUX_ROUNDS:-1}; round++)); do
  for c in "${flux_cases[@]}"; do
    if ((deadline > 0 && $(date +%s) > deadline)); then
      echo "gpu_train: flux case '$c' skipped: past BENCH_DEADLINE" >&2
      continue
    fi
    read -r mode base off <<<"$c"
    "$build/bench/bench_flux_step" "${flux_common[@]}" --mode "$mode" --base_weights_dtype "$base" \
      --offload "$off" | sed "s/^{/{\"case\": \"flux\", \"round\": $round, /" | tee -a "$flux_results" ||
      echo "gpu_train: bench_flux_step --mode $mode --base_weights_dtype $base --offload $off failed" >&2
  done
done
# The FLUX.1 LoRA step against Diffusers + PEFT on this machine's PyTorch (issue 62):
# bench/py/diffusers_flux_step.py with the same blocks, tokens, bf16 base, rank, checkpointing
# and step as the first case ("lora none 0"), interleaved with difftrain's over FLUX_ROUNDS.
flux_peer_results=$out_dir/flux_peer.jsonl
: >"$flux_peer_results"
for ((round = 1; round <= ${FLUX_ROUNDS:-1}; round++)); do
  if ((deadline > 0 && $(date +%s) > deadline)); then
    echo "gpu_train: the flux peer skipped: past BENCH_DEADLINE" >&2
    break
  fi
  "$build/bench/bench_flux_step" "${flux_common[@]}" --mode lora --base_weights_dtype none |
    sed "s/^{/{\"round\": $round, /" | tee -a "$flux_peer_results" ||
    echo "gpu_train: bench_flux_step (the peer comparison) failed" >&2
  "$python" "$root/bench/py/diffusers_flux_step.py" "${flux_common[@]}" --mode lora |
    sed "s/^{/{\"round\": $round, /" | tee -a "$flux_peer_results" ||
    echo "gpu_train: bench/py/diffusers_flux_step.py failed" >&2
done
flux_note=$("$python" - "$flux_results" "$flux_peer_results" <<'PY'
import json, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if not rows:
    print("flux: no rows (bench_flux_step failed: see above)")
    sys.exit()
r0 = rows[0]
print(f"FLUX.1-sized blocks {r0['blocks'][0]} double + {r0['blocks'][1]} single, width {r0['width']}, "
      f"tokens {r0['tokens'][0]} + {r0['tokens'][1]}, {r0['mixed_precision']}, gradient checkpointing; "
      f"medians of {len(rows) // max(1, len({(r['mode'], r['base_weights_dtype'], r['offload']) for r in rows}))} rounds")
print("| mode | base | offload | trainable | frozen base GiB | ms/step | fwd+bwd ms | optimizer ms | peak GiB | host GiB |")
print("|---|---|---|---|---|---|---|---|---|---|")
groups = {}
for r in rows:
    groups.setdefault((r["mode"], r["base_weights_dtype"], r["offload"]), []).append(r)
med = lambda g, k: statistics.median(x[k] for x in g)
for (mode, base, off), g in groups.items():
    print(f"| {mode} | {base if mode == 'lora' else 'fp32 (trains)'} | {'cpu' if off else 'no'} | {g[0]['trainable']} "
          f"| {g[0]['frozen_bytes'] / 2**30:.2f} | {med(g, 'ms_per_step'):.1f} | {med(g, 'ms_forward_backward'):.1f} "
          f"| {med(g, 'ms_optimizer'):.1f} | {med(g, 'peak_mem_gib'):.2f} | {g[0]['host_bytes'] / 2**30:.2f} |")
peer = [json.loads(l) for l in open(sys.argv[2]) if l.strip()]
ours = [r for r in peer if r.get("impl") == "difftrain"]
theirs = [r for r in peer if r.get("impl") == "diffusers+peft"]
if ours and theirs:
    a, b = med(ours, "ms_per_step"), med(theirs, "ms_per_step")
    print(f"flux: LoRA r{ours[0]['lora_rank']} step vs Diffusers + PEFT (torch {theirs[0]['torch']}, "
          f"{len(theirs)} rounds): difftrain {a:.1f} ms, peer {b:.1f} ms, ratio peer/difftrain {b / a:.2f}x; "
          f"peak allocated difftrain {med(ours, 'peak_mem_gib'):.2f} GiB, peer {med(theirs, 'peak_mem_gib'):.2f} GiB")
else:
    print("flux: the Diffusers + PEFT comparison has no rows (see above)")
PY
)

# `difftrain train` on the built-in default, on the GPU, one process.
train_args=(train --max_train_steps "$train_steps" --lr_warmup_steps 0 --checkpointing_steps 0 --num_validation_images 0
            --logging_steps 50 --output_dir "$work/run")
[ -n "${DIFFTRAIN_FASHION_MNIST_DIR:-}" ] && train_args+=(--train_data_dir "$DIFFTRAIN_FASHION_MNIST_DIR")
"$build/bin/difftrain" "${train_args[@]}" >"$out_dir/train.log" 2>&1 || { cat "$out_dir/train.log" >&2; exit 1; }
train_line=$(grep -E "step [0-9]+/[0-9]+ \|" "$out_dir/train.log" | tail -n 1)

table=/dev/null
[ -n "${OUT_DIR:-}" ] && table=$out_dir/table.md
"$python" - "$results" "$train_line" "$flux_note" <<'PY' | tee "$table"
import json, os, re, statistics, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
key = lambda r: (r["case"], r["mixed_precision"], r["batch"], r["resolution"], r["lora_rank"])
groups = {}
for r in rows:
    groups.setdefault(key(r), {}).setdefault(r["impl"], []).append(r)
dev = next((r.get("device_name") for r in rows if r.get("device_name")), rows[0]["device"])
peer = next(r for r in rows if r["impl"] == "diffusers")
peft = next((r for r in rows if r["impl"] == "diffusers" and r.get("peft")), {})


def peak_tflops(name):
    """The GPU's dense bf16 peak in TFLOP/s (datasheet, without sparsity), and where it came from."""
    if os.environ.get("GPU_PEAK_TFLOPS"):
        return float(os.environ["GPU_PEAK_TFLOPS"]), "GPU_PEAK_TFLOPS"
    n = name.upper()
    if "NVL" not in n and ("H200" in n or ("H100" in n and ("SXM" in n or "HBM3" in n))):
        return 989.4, "dense bf16 datasheet, H100 SXM / H200"
    if "H100" in n and "PCIE" in n:
        return 756.0, "dense bf16 datasheet, H100 PCIe"
    return None, "unknown device: set GPU_PEAK_TFLOPS"


peak, peak_src = peak_tflops(dev)
print(f"device: {dev}; Python peer: torch {peer.get('torch', '?')}, diffusers {peer.get('diffusers')} "
      f"({peer.get('diffusers_file')}), peft {peft.get('peft')} ({peft.get('peft_file')}); "
      f"medians of {max(len(v) for g in groups.values() for v in g.values())} rounds")
print(f"MFU = step FLOPs x steps/s / peak; peak {f'{peak:g} TFLOP/s' if peak else 'n/a'} ({peak_src}); "
      "the fp32 rows use the same bf16 peak. Step FLOPs (forward + backward) are the peer's "
      "FlopCounterMode count (n/a on torch < 2.1), used for both sides: same model, same step.")
print("| model | precision | batch | latents | LoRA | difftrain samples/s | Diffusers samples/s "
      "| speed ratio | difftrain peak GiB | Diffusers peak GiB | memory ratio | step GFLOP | difftrain TFLOP/s "
      "| Diffusers TFLOP/s | difftrain MFU | Diffusers MFU |")
print("|" + "---|" * 16)
fmt = lambda x, spec: "n/a" if x is None else format(x, spec)
per_sample_flops = None  # the default fp32 case's, for the `difftrain train` line
for k, g in groups.items():
    d, p = g["difftrain"], g["diffusers"]
    ds = statistics.median(r["samples_per_s"] for r in d)
    ps = statistics.median(r["samples_per_s"] for r in p)
    dm = statistics.median(r["peak_mem_gib"] for r in d)
    pm = statistics.median(r["peak_mem_gib"] for r in p)
    case, mp, b, res, rank = k
    # One count serves both: the step is the same model, inputs and loss on both sides.
    flops = next((r["step_flops"] for r in p if r.get("step_flops")), None)
    if case == "default" and mp == "no" and flops:
        per_sample_flops = flops / b
    dt = flops * ds / b / 1e12 if flops else None
    pt = flops * ps / b / 1e12 if flops else None
    dmfu = dt / peak if dt is not None and peak else None
    pmfu = pt / peak if pt is not None and peak else None
    print(f"| {case} | {mp} | {b} | {res}x{res} | {rank or 'full'} | {ds:.1f} | {ps:.1f} | {ds/ps:.2f}x "
          f"| {dm:.2f} | {pm:.2f} | {dm/pm:.2f}x | {fmt(flops and flops / 1e9, '.1f')} | {fmt(dt, '.2f')} "
          f"| {fmt(pt, '.2f')} | {fmt(dmfu, '.1%')} | {fmt(pmfu, '.1%')} |")
train = sys.argv[2].split("info: ")[-1]
m = re.search(r"([0-9.]+) samples/s", train)
tt = per_sample_flops * float(m.group(1)) / 1e12 if m and per_sample_flops else None
tmfu = tt / peak if tt is not None and peak else None
print(f"difftrain train (built-in default, one process): {train}; {fmt(tt, '.2f')} TFLOP/s, "
      f"MFU {fmt(tmfu, '.1%')} (the default fp32 case's FLOPs per sample)")
print(sys.argv[3])
PY
