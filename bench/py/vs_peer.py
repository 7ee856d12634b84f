#!/usr/bin/python3
"""difftrain against the Python peer (Diffusers + Accelerate on torch 1.13), side by side (issue 22).

Driver behind bench/vs_peer.sh; standard library only. Run it through the wrapper, which checks
and sets up the peer (../shared/refstack) first:
  bash bench/vs_peer.sh [--rounds 3] [--steps 20] [--difftrain PATH] [--json OUT.json] [--quick]
Directly (the refstack environment must already be sourced):
  . ../shared/refstack/env.sh; /usr/bin/python3 bench/py/vs_peer.py --refstack ../shared/refstack

Workloads, each run by difftrain and by the peer, interleaved (in every round each workload runs
difftrain then the peer, the other way round in odd rounds):
  tiny     accel_train_min.py's tiny UNet2DModel (3x32x32, (32, 64), attention at 16x16) on 64
           PNGs, batch 8 per process, accumulation 2, AdamW lr 1e-4, cosine with 5 warm-up steps
  default  difftrain's built-in class-conditional Fashion-MNIST UNet, batch 16 per process,
           accumulation 1, lr 1e-3, cosine with difftrain's 100 warm-up steps; the peer is
           bench/py/peer_train_default.py
both fp32, clip 1.0, no EMA, in the layouts 1x2 (1 process x 2 threads) and 2x1 (2 x 1).
When the CPU has avx512_bf16, difftrain also runs every workload/layout with bf16 (the peer
cannot: bf16 autocast fails in GroupNorm on torch 1.13's CPU).

Measured per run: training-loop samples/s (updates after the first 2: difftrain's "timing:
training loop" line, the peer's result_json), launch to the first finished update (wall time
from starting the command to the first output line saying update 1 is done; the child's merged
stdout+stderr read line by line), whole-process wall time, and the final loss.
Output: medians over rounds per workload x layout with the ratios difftrain/peer (samples/s) and
peer/difftrain (launch to first update), every round's figures, and with --json all of it.
Exit status: 0 done, 1 a run failed (the line names it and its log), 2 bad arguments.
"""
import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FASHION_MNIST = "/usr/share/datasets/fashion-mnist"

# accel_train_min.py's "tiny" UNet2DModel, written out with Diffusers 0.31.0's defaults for the rest
TINY_CONFIG = {
    "_class_name": "UNet2DModel", "_diffusers_version": "0.31.0",
    "sample_size": 32, "in_channels": 3, "out_channels": 3, "center_input_sample": False,
    "time_embedding_type": "positional", "freq_shift": 0, "flip_sin_to_cos": True,
    "down_block_types": ["DownBlock2D", "AttnDownBlock2D"], "up_block_types": ["AttnUpBlock2D", "UpBlock2D"],
    "block_out_channels": [32, 64], "layers_per_block": 1, "mid_block_scale_factor": 1,
    "downsample_padding": 1, "downsample_type": "conv", "upsample_type": "conv", "dropout": 0.0,
    "act_fn": "silu", "attention_head_dim": 8, "norm_num_groups": 32, "attn_norm_num_groups": None,
    "norm_eps": 1e-05, "resnet_time_scale_shift": "default", "add_attention": True,
    "class_embed_type": None, "num_class_embeds": None, "num_train_timesteps": None,
}
LAYOUTS = {"1x2": (1, 2), "2x1": (2, 1)}
WORKLOADS = ("tiny", "default")

DT_TIMING = re.compile(r"info: timing: training loop ([0-9.]+) samples/s")
DT_FINAL = re.compile(r"info: done: .*final loss ([-+0-9.eEnaif]+)")
PEER_PREFIX = re.compile(r"^\[default\d+\]:")  # torchrun's --tee prefix on 2-process runs


class RunFailed(Exception):
    pass


def parse_args():
    p = argparse.ArgumentParser(description="difftrain against the Python peer, side by side (issue 22)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (median over them); default 3")
    p.add_argument("--steps", type=int, default=20, help="optimizer updates per run (> 2); default 20")
    p.add_argument("--difftrain", default=os.environ.get("DIFFTRAIN", os.path.join(REPO, "build/bin/difftrain")),
                   help="difftrain binary (default $DIFFTRAIN or build/bin/difftrain)")
    p.add_argument("--json", default=None, help="write every figure to this file")
    p.add_argument("--quick", action="store_true", help="smoke test: 1 round, 6 steps, layout 1x2 only")
    p.add_argument("--workloads", default=",".join(WORKLOADS), help="comma list of tiny,default")
    p.add_argument("--layouts", default=",".join(LAYOUTS), help="comma list of 1x2,2x1")
    p.add_argument("--no_bf16", action="store_true", help="skip the difftrain bf16 runs")
    p.add_argument("--timeout", type=float, default=900, help="seconds one run may take (default 900)")
    p.add_argument("--refstack", default=os.path.join(os.path.dirname(REPO), "shared", "refstack"),
                   help="the peer's folder (default: the repo's sibling shared/refstack)")
    p.add_argument("--workdir", default=None, help="logs and scratch (default: a new temp dir, kept)")
    a = p.parse_args()
    if a.quick:
        a.rounds, a.steps, a.layouts = 1, 6, "1x2"
    a.workloads = [w for w in a.workloads.split(",") if w]
    a.layouts = [l for l in a.layouts.split(",") if l]
    bad = [w for w in a.workloads if w not in WORKLOADS] + [l for l in a.layouts if l not in LAYOUTS]
    if bad or a.rounds < 1 or a.steps < 3:
        p.error(f"bad value(s): {bad or ''} rounds={a.rounds} steps={a.steps} (need rounds >= 1, steps >= 3, "
                f"workloads from {WORKLOADS}, layouts from {tuple(LAYOUTS)})")
    a.difftrain = os.path.abspath(a.difftrain)
    a.refstack = os.path.abspath(a.refstack)
    return a


def run_timed(cmd, env, cwd, log_path, first_update, timeout):
    """Runs cmd (its stdout+stderr merged, read line by line as it comes); writes each line to
    log_path prefixed with seconds since the start. Returns (rc, wall_s, first_update_s, lines):
    first_update_s is when the first line with first_update(line) true arrived (None if never)."""
    lines, first = [], None
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, bufsize=0,
                            start_new_session=True, cwd=cwd)
    killed = []

    def kill_group():
        killed.append(True)
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    timer = threading.Timer(timeout, kill_group)
    timer.start()
    try:
        with open(log_path, "w") as log:
            log.write("# " + " ".join(cmd) + "\n")
            for raw in iter(proc.stdout.readline, b""):
                t = time.perf_counter() - t0
                line = raw.decode("utf-8", "replace").rstrip("\n")
                if first is None and first_update(line):
                    first = t
                lines.append(line)
                log.write(f"{t:9.3f} {line}\n")
            rc = proc.wait()
            wall = time.perf_counter() - t0
            if killed:
                log.write(f"# killed after {timeout:.0f} s\n")
    except BaseException:
        kill_group()
        proc.wait()
        raise
    finally:
        timer.cancel()
    return (rc if not killed else -9), wall, first, lines


def dt_first_update(line):
    return "info: step 1/" in line


def peer_first_update(line):
    return PEER_PREFIX.sub("", line).startswith("step   1 ")


class Bench:
    def __init__(self, a):
        self.a = a
        self.work = a.workdir or tempfile.mkdtemp(prefix="vs_peer-")
        os.makedirs(os.path.join(self.work, "logs"), exist_ok=True)
        self.pngs = os.path.join(self.work, "png32")
        self.tiny_dir = os.path.join(self.work, "tiny_unet")
        self.runs = []

    def setup(self):
        out = subprocess.run(["/usr/bin/python3", os.path.join(self.a.refstack, "make_pngs.py"), self.pngs],
                             capture_output=True, text=True)
        if out.returncode != 0:
            raise RunFailed(f"make_pngs.py failed: {out.stderr.strip().splitlines()[-1:]}")
        os.makedirs(self.tiny_dir, exist_ok=True)
        with open(os.path.join(self.tiny_dir, "config.json"), "w") as f:
            json.dump(TINY_CONFIG, f, indent=2)

    # ---- commands ----
    def dt_cmd(self, workload, procs, threads, precision, out_dir):
        dt = self.a.difftrain
        cmd = [dt, "launch", "--num_processes", str(procs), "--num_cpu_threads_per_process", str(threads),
               dt, "train"]
        if workload == "tiny":
            cmd += ["--model_config_name_or_path", self.tiny_dir, "--dataset", "imagefolder",
                    "--train_data_dir", self.pngs, "--train_batch_size", "8", "--gradient_accumulation_steps", "2",
                    "--learning_rate", "1e-4", "--lr_warmup_steps", "5"]
        cmd += ["--max_train_steps", str(self.a.steps), "--use_ema", "false", "--logging_steps", "1",
                "--checkpointing_steps", "0", "--validation_steps", "0", "--num_validation_images", "0",
                "--report_to", "none", "--output_dir", out_dir, "--mixed_precision", precision]
        return cmd, dict(os.environ)

    def peer_cmd(self, workload, procs, threads, result_json, log_dir):
        cmd = [os.path.join(self.a.refstack, "bin", "accelerate"), "launch"]  # refstack's `accelerate`
        if procs == 1:
            cmd += ["--cpu", "--num_processes", "1"]
        else:  # torch 1.13 + Python 3.11: 2 CPU processes need --multi_gpu (gloo) and --tee/--log_dir
            cmd += ["--multi_gpu", "--num_processes", str(procs), "--tee", "1", "--log_dir", log_dir]
        cmd += ["--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no"]
        if workload == "tiny":
            cmd += [os.path.join(self.a.refstack, "accel_train_min.py"), "--data_dir", self.pngs]
        else:
            cmd += [os.path.join(REPO, "bench", "py", "peer_train_default.py"), "--data_dir", FASHION_MNIST]
        cmd += ["--max_steps", str(self.a.steps), "--result_json", result_json]
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1")
        return cmd, env

    # ---- one run ----
    def one(self, rnd, workload, layout, tool):
        procs, threads = LAYOUTS[layout]
        name = f"r{rnd + 1}-{workload}-{layout}-{tool}"
        run_dir = os.path.join(self.work, "runs", name)
        os.makedirs(run_dir, exist_ok=True)
        log = os.path.join(self.work, "logs", name + ".log")
        result_json = os.path.join(run_dir, "result.json")
        if tool == "peer":
            cmd, env = self.peer_cmd(workload, procs, threads, result_json, os.path.join(run_dir, "torchrun_logs"))
            first_fn = peer_first_update
        else:
            cmd, env = self.dt_cmd(workload, procs, threads, "bf16" if tool == "difftrain-bf16" else "no",
                                   os.path.join(run_dir, "out"))
            first_fn = dt_first_update
        print(f"  {name} ...", end="", flush=True)
        load = loadavg()
        rc, wall, first, lines = run_timed(cmd, env, run_dir, log, first_fn, self.a.timeout)
        if rc != 0:
            print()
            raise RunFailed(f"run {name} failed (exit {rc}); log: {log}")
        rec = {"round": rnd + 1, "workload": workload, "layout": layout, "tool": tool, "processes": procs,
               "threads": threads, "steps": self.a.steps, "wall_s": round(wall, 3),
               "first_update_s": None if first is None else round(first, 3), "load1_before": load, "log": log}
        if tool == "peer":
            try:
                with open(result_json) as f:
                    res = json.load(f)
            except (OSError, ValueError) as e:
                print()
                raise RunFailed(f"run {name}: no result json ({e}); log: {log}")
            rec.update(samples_per_s=res["samples_per_s"], final_loss=res["final_loss"],
                       ranks_identical=res.get("ranks_identical"))
        else:
            sps = [float(m.group(1)) for m in map(DT_TIMING.search, lines) if m]
            loss = [float(m.group(1)) for m in map(DT_FINAL.search, lines) if m]
            if not sps or not loss:
                print()
                raise RunFailed(f"run {name}: no 'timing: training loop' or 'final loss' line; log: {log}")
            rec.update(samples_per_s=sps[0], final_loss=loss[-1])
        if first is None:
            print()
            raise RunFailed(f"run {name}: no line showing update 1 finished; log: {log}")
        print(f" {rec['samples_per_s']:7.2f} samples/s, first update {rec['first_update_s']:6.2f} s, "
              f"wall {rec['wall_s']:6.2f} s, "
              f"loss {rec['final_loss']:.4f}", flush=True)
        shutil.rmtree(run_dir, ignore_errors=True)  # checkpoints/exports; the log stays
        self.runs.append(rec)
        return rec

    def run_all(self, bf16):
        for rnd in range(self.a.rounds):
            print(f"round {rnd + 1}/{self.a.rounds}", flush=True)
            for workload in self.a.workloads:
                for layout in self.a.layouts:
                    order = ["difftrain", "peer"] + (["difftrain-bf16"] if bf16 else [])
                    if rnd % 2 == 1:
                        order.reverse()
                    for tool in order:
                        self.one(rnd, workload, layout, tool)


def loadavg():
    """1-minute load average: other work on the machine (a compiler) makes a run's figures noise."""
    try:
        with open("/proc/loadavg") as f:
            return float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def med(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def fmt(x, spec="7.2f", none="-"):
    return none if x is None else format(x, spec)


def summarize(runs, workloads, layouts):
    rows = []
    for w in workloads:
        for l in layouts:
            def pick(tool, key):
                return [r[key] for r in runs if r["workload"] == w and r["layout"] == l and r["tool"] == tool]
            row = {"workload": w, "layout": l}
            for tool, tag in (("difftrain", "dt"), ("peer", "peer"), ("difftrain-bf16", "dt_bf16")):
                for key in ("samples_per_s", "first_update_s", "wall_s", "final_loss"):
                    row[f"{tag}_{key}"] = med(pick(tool, key))
            row["sps_ratio_dt_over_peer"] = ratio(row["dt_samples_per_s"], row["peer_samples_per_s"])
            row["first_update_ratio_peer_over_dt"] = ratio(row["peer_first_update_s"], row["dt_first_update_s"])
            row["wall_ratio_peer_over_dt"] = ratio(row["peer_wall_s"], row["dt_wall_s"])
            row["bf16_over_fp32"] = ratio(row["dt_bf16_samples_per_s"], row["dt_samples_per_s"])
            # the same ratios taken round by round, then the median (less sensitive to a drifting machine)
            by_round = {}
            for r in runs:
                if r["workload"] == w and r["layout"] == l:
                    by_round.setdefault(r["round"], {})[r["tool"]] = r
            per = [ratio(d["difftrain"]["samples_per_s"], d["peer"]["samples_per_s"])
                   for d in by_round.values() if "difftrain" in d and "peer" in d]
            row["sps_ratio_per_round"] = [round(x, 3) for x in per]
            row["sps_ratio_median_of_rounds"] = med(per)
            rows.append(row)
    return rows


def print_tables(rows, runs, bf16):
    print("\nmedians over rounds (fp32 unless marked; ratio = difftrain/peer for samples/s, peer/difftrain for times)")
    hdr = (f"{'workload':8} {'layout':6} | {'samples/s dt':>12} {'peer':>7} {'dt/peer':>7} | "
           f"{'1st update s dt':>15} {'peer':>6} {'peer/dt':>7} | {'wall s dt':>9} {'peer':>6} {'peer/dt':>7} | "
           f"{'loss dt':>7} {'peer':>6}")
    if bf16:
        hdr += f" | {'bf16 samples/s':>14} {'bf16/fp32':>9}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        s = (f"{r['workload']:8} {r['layout']:6} | {fmt(r['dt_samples_per_s'], '12.2f')} "
             f"{fmt(r['peer_samples_per_s'])} {fmt(r['sps_ratio_dt_over_peer'], '6.2f')}x | "
             f"{fmt(r['dt_first_update_s'], '15.2f')} {fmt(r['peer_first_update_s'], '6.2f')} "
             f"{fmt(r['first_update_ratio_peer_over_dt'], '6.2f')}x | {fmt(r['dt_wall_s'], '9.2f')} "
             f"{fmt(r['peer_wall_s'], '6.2f')} {fmt(r['wall_ratio_peer_over_dt'], '6.2f')}x | "
             f"{fmt(r['dt_final_loss'], '7.4f')} {fmt(r['peer_final_loss'], '6.4f')}")
        if bf16:
            s += f" | {fmt(r['dt_bf16_samples_per_s'], '14.2f')} {fmt(r['bf16_over_fp32'], '8.2f')}x"
        print(s)
    print("\nevery run")
    print(f"{'round':>5} {'workload':8} {'layout':6} {'tool':14} | {'samples/s':>9} {'1st update s':>12} "
          f"{'wall s':>7} {'final loss':>10} {'load before':>11}")
    for r in runs:
        print(f"{r['round']:>5} {r['workload']:8} {r['layout']:6} {r['tool']:14} | {r['samples_per_s']:9.2f} "
              f"{fmt(r['first_update_s'], '12.2f')} {r['wall_s']:7.2f} {r['final_loss']:10.4f} "
              f"{fmt(r['load1_before'], '11.2f')}")
    print("\nper-round samples/s ratio dt/peer: " + "; ".join(
        f"{r['workload']} {r['layout']}: {', '.join(f'{x:.2f}x' for x in r['sps_ratio_per_round'])}" for r in rows))
    busy = [r for r in runs if r["load1_before"] is not None and r["load1_before"] > 0.5 * (os.cpu_count() or 1)]
    if busy:
        print(f"note: {len(busy)} of {len(runs)} runs started with a 1-minute load average above half the "
              f"{os.cpu_count()} cores (something else was running): treat their figures as noise")


def difftrain_env(dt):
    try:
        out = subprocess.run([dt, "env"], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    info = {}
    for line in out.splitlines():
        for key, tag in (("cpu", "- CPU:"), ("blas", "- BLAS:"), ("version", "- difftrain version:"),
                         ("libtorch", "- LibTorch version:"), ("matmul", "- matmul probe:")):
            if line.startswith(tag):
                info[key] = line[len(tag):].strip()
    return info


def peer_env():
    code = ("import re, torch; c = torch.__config__.show(); m = re.search(r'BLAS_INFO=([^,]+)', c); "
            "print(torch.__version__, m.group(1) if m else '?')")
    out = subprocess.run(["/usr/bin/python3", "-c", code], capture_output=True, text=True)
    parts = out.stdout.split()
    return {"torch": parts[0], "blas_info": parts[1]} if out.returncode == 0 and len(parts) == 2 else {}


def cpu_model():
    try:
        with open("/proc/cpuinfo") as f:
            text = f.read()
    except OSError:
        return "?", False, 0
    m = re.search(r"^model name\s*:\s*(.*)$", text, re.M)
    return (m.group(1).strip() if m else "?"), bool(re.search(r"\bavx512_bf16\b", text)), os.cpu_count()


def main():
    a = parse_args()
    if not os.access(a.difftrain, os.X_OK):
        print(f"vs_peer: difftrain binary {a.difftrain} not found or not executable; build it or pass --difftrain PATH",
              file=sys.stderr)
        return 2
    if "default" in a.workloads and not os.path.isdir(FASHION_MNIST):
        print(f"vs_peer: {FASHION_MNIST} missing (the 'default' workload needs it): apt install dataset-fashion-mnist, "
              "or --workloads tiny", file=sys.stderr)
        return 2
    bench = Bench(a)
    env = difftrain_env(a.difftrain)
    peer = peer_env()
    model, has_bf16, ncpu = cpu_model()
    bf16 = has_bf16 and not a.no_bf16
    print(f"difftrain {env.get('version', '?')} ({a.difftrain}), LibTorch {env.get('libtorch', '?')}")
    print(f"CPU (all figures below come from it): {model}, {ncpu} logical cores; difftrain env: {env.get('cpu', '?')}")
    print(f"BLAS: difftrain {env.get('blas', '?')}; matmul probe {env.get('matmul', '?')}")
    print(f"peer: torch {peer.get('torch', '?')} (BLAS_INFO={peer.get('blas_info', '?')}), {a.refstack}")
    if not has_bf16:
        print("bf16: this CPU has no bf16 instructions (no avx512_bf16 in /proc/cpuinfo): difftrain bf16 runs skipped")
    elif a.no_bf16:
        print("bf16: skipped (--no_bf16)")
    else:
        print("bf16: the CPU has avx512_bf16: difftrain also runs each workload/layout with --mixed_precision bf16 "
              "(the peer cannot train bf16 on torch 1.13)")
    print(f"rounds {a.rounds}, {a.steps} updates per run (timed: updates 3-{a.steps}), workloads {a.workloads}, "
          f"layouts {a.layouts}; no EMA on either side (the peer's EMA is not comparable); work dir {bench.work}",
          flush=True)
    t0 = time.time()
    try:
        bench.setup()
        bench.run_all(bf16)
    except RunFailed as e:
        print(f"vs_peer: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\nvs_peer: interrupted", file=sys.stderr)
        return 130
    rows = summarize(bench.runs, a.workloads, a.layouts)
    print_tables(rows, bench.runs, bf16)
    print(f"\ntotal {time.time() - t0:.0f} s; logs (each line with seconds since its launch) in {bench.work}/logs")
    if a.json:
        doc = {"date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "cpu_model": model, "logical_cores": ncpu,
               "difftrain_env": env, "peer_env": peer, "difftrain": a.difftrain, "rounds": a.rounds,
               "steps": a.steps, "timing_rule": "updates after the first 2", "bf16": bf16,
               "summary": rows, "runs": bench.runs}
        with open(a.json, "w") as f:
            json.dump(doc, f, indent=2)
        print(f"wrote {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
