"""Trims the refstack's Diffusers 0.31.0 and PEFT 0.14.0 sources to the files that the GPU
benchmark's Python peers (bench/py/diffusers_unet_step.py and diffusers_flux_step.py, run by
bench/gpu_train.sh) load, so a
device machine is sent a few MB instead of the whole trees.

    python3 bench/py/trim_refstack.py DIFFUSERS_SRC PEFT_SRC OUT [--refstack DIR]

DIFFUSERS_SRC / PEFT_SRC: the refstack's src/diffusers-v0.31.0/src and src/peft-v0.14.0/src.
The files land in OUT/diffusers-v0.31.0/src/diffusers/... and OUT/peft-v0.14.0/src/peft/... (the
same relative layout, so OUT works as gpu_train.sh's PYSRC); those two folders are replaced.

How the file list is found:
  1. The peer runs (in subprocesses, with the refstack's torch, accelerate, huggingface_hub and
     safetensors and these two trees first on PYTHONPATH) every case gpu_train.sh runs, on tiny
     configs on the CPU: the built-in default UNet2DModel, an SD-1.5-like and an SDXL-like
     (addition_embed_type "text_time") UNet2DConditionModel, full and (the conditional ones)
     with PEFT LoRA (LoraConfig + unet.add_adapter). The real configs/sd15_unet_config.json and
     configs/sdxl-base-1.0/unet/config.json are also built (under accelerate's
     init_empty_weights: no memory) with an adapter added. Each runs twice: as the refstack is
     (its transformers is a stub without metadata, so Diffusers sees no transformers and
     USE_PEFT_BACKEND is False) and as on the GPU machine, which has transformers (a stand-in
     transformers dist-info makes Diffusers take its USE_PEFT_BACKEND paths). Every diffusers/
     and peft/ module in sys.modules afterwards is kept, with the __init__.py of every package
     above it.
  2. Safety margin: every import statement in those files (at any depth: imports inside
     functions run later, e.g. `from peft import ...` in add_adapter, and module-level branches
     may go the other way on a newer torch) that names a diffusers/ or peft/ module is resolved
     and imported in a subprocess too, so its own module-level imports are kept as well. Imports
     under `if TYPE_CHECKING` (Diffusers' eager import of everything) are not followed.
Check the result with neither full tree importable (a missing file then fails the run):
    R=../shared/refstack; env -i PATH=/usr/bin:/bin HOME=$HOME HF_HUB_OFFLINE=1 \
      PYTHON=/usr/bin/python3 PYSRC=OUT SMOKE=1 ROUNDS=1 \
      PYTHONPATH=$R/site:$R/stubs:$R/src/accelerate-v0.32.1/src:$R/src/huggingface_hub-v0.27.1/src \
      bash bench/gpu_train.sh build
"""
import argparse
import ast
import json
import os
import runpy
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PEER = ROOT / "bench" / "py" / "diffusers_unet_step.py"
PACKAGES = ("diffusers", "peft")

# The built-in default model, as bench/gpu_train.sh writes it (default_unet_config(32, 1)).
DEFAULT_CONFIG = {
    "_class_name": "UNet2DModel", "sample_size": 32, "in_channels": 1, "out_channels": 1,
    "layers_per_block": 1, "block_out_channels": [32, 64, 64],
    "down_block_types": ["DownBlock2D", "DownBlock2D", "AttnDownBlock2D"],
    "up_block_types": ["AttnUpBlock2D", "UpBlock2D", "UpBlock2D"], "norm_num_groups": 8,
    "attention_head_dim": 32, "num_class_embeds": 11}
# (name, config, resolution, LoRA ranks) of the peer runs (UNet2DModel has no add_adapter).
TINY_CASES = [("default", "DEFAULT", 32, ["0"]),
              ("sd15-like", str(ROOT / "tests/golden/diffusers/unet_cond/config.json"), 16, ["0", "4"]),
              ("sdxl-like", str(ROOT / "tests/golden/sdxl/tiny_sdxl/unet/config.json"), 16, ["0", "4"])]
REAL_CONFIGS = [ROOT / "configs/sd15_unet_config.json",
                ROOT / "configs/sdxl-base-1.0/unet/config.json"]


# ---- the probe: runs inside the subprocess, records what was loaded ----

def loaded_files(roots):
    """Files of the loaded modules that lie under one of roots (the two src folders)."""
    files = set()
    for m in list(sys.modules.values()):
        f = getattr(m, "__file__", None)
        if not f:
            continue
        f = os.path.realpath(f)
        if any(f.startswith(r + os.sep) for r in roots):
            files.add(f)
    return files


def probe(record, roots, action, args):
    if action == "peer":
        sys.argv = [str(PEER)] + args
        runpy.run_path(str(PEER), run_name="__main__")
    elif action == "build":
        # The real configs: constructed without memory, with an adapter added as the peer does.
        from accelerate import init_empty_weights
        from diffusers import UNet2DConditionModel
        from peft import LoraConfig

        for path in args:
            with open(path) as f:
                config = json.load(f)
            with init_empty_weights():
                unet = UNet2DConditionModel.from_config(config)
            unet.requires_grad_(False)
            unet.add_adapter(LoraConfig(r=16, lora_alpha=16, init_lora_weights="gaussian",
                                        target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    elif action == "import":
        import importlib

        failed = {}
        for name in args:
            try:
                importlib.import_module(name)
            except Exception as e:  # an optional dependency missing here: keep the file anyway
                failed[name] = f"{type(e).__name__}: {e}"
        for name, err in sorted(failed.items()):
            print(f"  note: importing {name} failed here ({err[:160]}); its file is kept",
                  file=sys.stderr)
    import diffusers

    d = os.path.realpath(diffusers.__file__)
    assert any(d.startswith(r + os.sep) for r in roots), f"diffusers came from {d}, not {roots}"
    with open(record, "w") as f:
        json.dump(sorted(loaded_files(roots)), f)


# ---- the driver ----

def module_name(path, root):
    """diffusers/models/unets/unet_2d.py -> diffusers.models.unets.unet_2d (a package: its name)."""
    parts = list(path.relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def module_file(name, roots):
    """The file of a dotted diffusers/peft module name (x.py or x/__init__.py), or None."""
    for root in roots:
        base = Path(root).joinpath(*name.split("."))
        for f in (base.with_suffix(".py"), base / "__init__.py"):
            if f.is_file():
                return f.resolve()
    return None


def is_type_checking(test):
    return any(isinstance(n, ast.Name) and n.id == "TYPE_CHECKING" for n in ast.walk(test))


def imported_modules(path, root):
    """Dotted diffusers/peft module names that the import statements of path may load."""
    name = module_name(path, root)
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    found = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and is_type_checking(child.test):
                for c in child.orelse:
                    visit(c)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    base = package[: len(package) - (child.level - 1)]
                    target = ".".join(base + ([child.module] if child.module else []))
                else:
                    target = child.module or ""
                found.add(target)
                found.update(f"{target}.{a.name}" for a in child.names if a.name != "*")
            visit(child)

    visit(ast.parse(path.read_text(), str(path)))
    return {m for m in found if m.split(".")[0] in PACKAGES}


def with_package_inits(files, roots):
    out = set(files)
    for f in files:
        for root in roots:
            if str(f).startswith(root + os.sep):
                d = Path(f).parent
                while str(d).startswith(root + os.sep):
                    init = d / "__init__.py"
                    if init.is_file():
                        out.add(str(init.resolve()))
                    d = d.parent
    return out


def du(path):
    return subprocess.run(["du", "-sh", str(path)], capture_output=True, text=True).stdout.split()[0]


def main():
    if len(sys.argv) > 1 and sys.argv[1] == "--probe":
        record, roots, action = sys.argv[2], sys.argv[3].split(":"), sys.argv[4]
        probe(record, roots, action, sys.argv[5:])
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("diffusers_src")
    ap.add_argument("peft_src")
    ap.add_argument("out")
    ap.add_argument("--refstack",
                    default=os.environ.get("REFSTACK", str(ROOT.parent / "shared" / "refstack")),
                    help="the refstack folder: its site/, stubs/, accelerate and huggingface_hub "
                         "sources go on the probe's PYTHONPATH (default $REFSTACK or ../shared/refstack)")
    ap.add_argument("--python", default=os.environ.get("PYTHON", "python3"))
    a = ap.parse_args()
    sys.stdout.reconfigure(line_buffering=True)
    srcs = [str(Path(p).resolve()) for p in (a.diffusers_src, a.peft_src)]
    for s, pkg in zip(srcs, PACKAGES):
        if not (Path(s) / pkg / "__init__.py").is_file():
            sys.exit(f"trim_refstack: {s} has no {pkg}/__init__.py (expected the refstack's "
                     f"src/{pkg}-v.../src folder)")
    rs = Path(a.refstack)
    env = dict(os.environ)
    env["PYTHONPATH"] = ":".join(srcs + [str(rs / "site"), str(rs / "src/accelerate-v0.32.1/src"),
                                         str(rs / "src/huggingface_hub-v0.27.1/src"), str(rs / "stubs")])
    env.pop("DIFFTRAIN_PY_FALLBACK", None)
    env.setdefault("OMP_NUM_THREADS", "2")
    env.setdefault("HF_HUB_OFFLINE", "1")

    tmp = Path(tempfile.mkdtemp())
    # The GPU machine's transformers, as far as Diffusers' is_transformers_available() and
    # USE_PEFT_BACKEND look (importlib.metadata); the import itself stays the refstack's stub.
    meta = tmp / "meta" / "transformers-4.46.0.dist-info"
    meta.mkdir(parents=True)
    (meta / "METADATA").write_text("Metadata-Version: 2.1\nName: transformers\nVersion: 4.46.0\n")
    env_gpu = dict(env, PYTHONPATH=env["PYTHONPATH"] + ":" + str(meta.parent))
    files = set()

    def run_probe(action, args, env=env):
        record = tmp / "record.json"
        cmd = [a.python, __file__, "--probe", str(record), ":".join(srcs), action] + args
        r = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        sys.stderr.write(r.stderr if r.returncode else "".join(
            l + "\n" for l in r.stderr.splitlines() if l.startswith("  note:")))
        if r.returncode:
            sys.exit(f"trim_refstack: the probe `{action} {' '.join(args)}` failed (exit {r.returncode})")
        files.update(json.loads(record.read_text()))

    try:
        (tmp / "default.json").write_text(json.dumps(DEFAULT_CONFIG))
        for case, config, res, ranks in TINY_CASES:
            config = str(tmp / "default.json") if config == "DEFAULT" else config
            for rank in ranks:
                for mode, e in (("as here", env), ("as with transformers", env_gpu)):
                    print(f"probe: peer, {case}, LoRA rank {rank}, {mode}", flush=True)
                    run_probe("peer", ["--config", config, "--batch", "2", "--resolution", str(res),
                                       "--lora_rank", rank, "--steps", "1", "--warmup", "0",
                                       "--device", "cpu"], e)
        for mode, e in (("as here", env), ("as with transformers", env_gpu)):
            print(f"probe: the real sd15 and sdxl configs (empty weights) + add_adapter, {mode}",
                  flush=True)
            run_probe("build", [str(p) for p in REAL_CONFIGS], e)
        for mode, e in (("as here", env), ("as with transformers", env_gpu)):
            # diffusers_flux_step.py (gpu_train.sh's FLUX.1 comparison) needs torch 2's SDPA to
            # run, which the refstack's torch 1.13 lacks: its modules are imported instead.
            print(f"probe: import FluxTransformer2DModel's module, {mode}", flush=True)
            run_probe("import", ["diffusers.models.transformers.transformer_flux",
                                 "peft.tuners.lora"], e)
        n_run = len(files)
        root_of = lambda f: Path(next(s for s in srcs if str(f).startswith(s + os.sep)))
        extra = set()
        for f in files:
            for m in imported_modules(Path(f), root_of(f)):
                mf = module_file(m, srcs)
                if mf and str(mf) not in files:
                    extra.add(module_name(mf, root_of(mf)))
        print(f"probe: {len(extra)} more modules named by import statements of the {n_run} "
              "loaded files", flush=True)
        if extra:
            run_probe("import", sorted(extra), env_gpu)
            files.update(str(module_file(m, srcs)) for m in extra)
        files = with_package_inits(files, srcs)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    out = Path(a.out)
    for s in srcs:
        dest_src = out / Path(s).parent.name / "src"
        if dest_src.parent.exists():
            shutil.rmtree(dest_src.parent)
        for f in sorted(x for x in files if x.startswith(s + os.sep)):
            d = dest_src / Path(f).relative_to(s)
            d.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(f, d)
        lic = Path(s).parent / "LICENSE"
        if lic.is_file():
            shutil.copy2(lic, dest_src.parent / "LICENSE")
        kept = sum(1 for x in files if x.startswith(s + os.sep))
        total = sum(1 for _ in Path(s).rglob("*.py"))
        print(f"{Path(s).parent.name}: {kept} of {total} .py files; du {du(s)} -> {du(dest_src)}")
    print(f"total: du {du(out)} in {out}")


if __name__ == "__main__":
    main()
