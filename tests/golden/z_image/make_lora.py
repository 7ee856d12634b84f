#!/usr/bin/env python3
"""Makes tests/golden/z_image/lora/: LoRA files for the tiny Z-Image transformer
(../tiny_z_image/transformer) in the layouts people trade, and references of what Diffusers' own
ZImageLoraLoaderMixin (ZImagePipeline.lora_state_dict / load_lora_weights / fuse_lora) does with
them.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 + PEFT 0.20.1.dev0 at
../shared/refstack2/src), after make_transformer.py:
    ../shared/refstack2/run python3 tests/golden/z_image/make_lora.py tests/golden/z_image
Re-running writes byte-identical files (float32, one CPU thread, seeded weights, sorted keys).

Writes, under OUT/lora/:
  diffusers.safetensors      as train_dreambooth_lora_z_image.py saves it: PEFT LoraConfig(r=4,
                             lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_k",
                             "to_q", "to_v", "to_out.0"]) added with transformer.add_adapter, its
                             weights then overwritten with seeded randoms, get_peft_model_state_dict,
                             ZImagePipeline.save_lora_weights(..., transformer_lora_adapter_metadata=
                             peft_config["default"].to_dict()) (the script's _collate_lora_metadata)
  comfyui.safetensors        the same adapter as diffusion_model.<module>.lora_down.weight /
                             .lora_up.weight / .alpha (float32 scalar 8); no header metadata
  kohya.safetensors          the same as lora_unet_<module with "." -> "_">.lora_down.weight /
                             .lora_up.weight / .alpha; header metadata {"format": "pt"}
  extra_targets.safetensors  a second adapter (Diffusers form, r=2, lora_alpha=2) on feed-forward,
                             adaLN, embedder and final-layer Linears as well as one attention Linear
  expected.safetensors       base.out.<i>; per file F: F.out.<i> (load_lora_weights, unfused, scale 1),
                             F.fused_out.<i> (fuse_lora(lora_scale=0.5) on a fresh load), F.fused.<param>
                             (every transformer parameter the fuse changed; for diffusers and
                             extra_targets only: comfyui's and kohya's are checked bit-identical
                             to diffusers')
  lora_cases.json            per file: keys and shapes, header metadata, what lora_state_dict made of
                             the keys, the PEFT targets / r / alpha Diffusers ended up with, how much
                             the LoRA moves the output; converter probes on other key spellings

Checks (the outputs do not depend on them): base.out equals tiny_z_image/forward.safetensors
a.out; lora_state_dict turns comfyui and kohya into diffusers' keys with lora_A * scale_down,
lora_B * scale_up whose product is alpha / r * B @ A; each out equals a plain (PEFT-free)
transformer with W + s * B @ A (s = alpha / r) and each fused parameter equals W + 0.5 s B @ A;
kohya names of every Linear module of the transformer are converted back to the module name.
"""
import json
import os
import struct
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# refstack2 has only a stub of transformers, which Diffusers finds but reports unavailable (no
# dist-info). Two consequences, both handled by flipping flags before anything imports
# diffusers.loaders (Diffusers' code itself is untouched):
# 1. diffusers.loaders leaves out ZImageLoraLoaderMixin and pipeline_z_image.py cannot import:
#    set import_utils' _transformers_available (as make_transformer.py does).
# 2. USE_PEFT_BACKEND (diffusers/utils/constants.py: peft >= MIN_PEFT_VERSION AND transformers >=
#    MIN_TRANSFORMERS_VERSION) is False, so load_lora_weights (@require_peft_backend, which reads
#    diffusers.utils.USE_PEFT_BACKEND at call time), ModelMixin.load_lora_adapter / fuse_lora
#    (loaders/peft.py) and LoraBaseMixin.fuse_lora (loaders/lora_base.py; both bind the name at
#    import) refuse to run. Set it True in diffusers.utils.constants and diffusers.utils before
#    diffusers.loaders is imported, so loaders.peft and loaders.lora_base bind True; asserted below.
#    PEFT itself needs nothing of transformers here.
import diffusers.utils.import_utils as _iu  # noqa: E402  (loads diffusers lazily, no loaders yet)
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"
import diffusers.utils as _du  # noqa: E402
import diffusers.utils.constants as _dc  # noqa: E402
_du.USE_PEFT_BACKEND = _dc.USE_PEFT_BACKEND = True

import diffusers  # noqa: E402
import diffusers.loaders.lora_base as _lora_base  # noqa: E402
import diffusers.loaders.peft as _loaders_peft  # noqa: E402
import peft  # noqa: E402
from diffusers import ZImageTransformer2DModel  # noqa: E402
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

assert _lora_base.USE_PEFT_BACKEND and _loaders_peft.USE_PEFT_BACKEND

# The training script's default targets (args.lora_layers None) and its LoraConfig.
MAIN = dict(r=4, lora_alpha=8, target_modules=["to_k", "to_q", "to_v", "to_out.0"],
            seed=20261210, std_a=0.1, std_b=0.05)
# A second adapter on other Linear modules (full names: PEFT matches a target when the module
# name equals it or ends with "." + it). t_embedder.mlp.2 (64 x 1024) is left out for size.
EXTRA = dict(r=2, lora_alpha=2, target_modules=[
    "layers.0.attention.to_v", "layers.1.feed_forward.w1", "layers.1.feed_forward.w2",
    "layers.1.feed_forward.w3", "layers.0.adaLN_modulation.0", "noise_refiner.0.feed_forward.w2",
    "all_final_layer.2-1.linear", "all_final_layer.2-1.adaLN_modulation.1", "all_x_embedder.2-1",
    "cap_embedder.1"], seed=20261211, std_a=0.1, std_b=0.1)
FUSE_SCALE = 0.5
FILES = ["diffusers", "comfyui", "kohya", "extra_targets"]


def save_st(tensors, path, metadata):
    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)}, path,
              metadata=metadata)


def sort_header_metadata(path):
    """safetensors (0.5) serialises __metadata__ from a Rust HashMap, so with two or more entries
    (Diffusers writes "format" and "lora_adapter_metadata") their order changes from run to run.
    Rewrite the header with the entries sorted: the same JSON object, the same length and
    padding, the tensors untouched; checked by re-encoding the original header first."""
    with open(path, "rb") as fh:
        data = fh.read()
    n = struct.unpack("<Q", data[:8])[0]
    raw = data[8:8 + n]
    text = raw.rstrip(b" ")
    head = json.loads(text)  # dicts keep the file's order

    def enc(h):
        return json.dumps(h, separators=(",", ":"), ensure_ascii=False).encode()
    assert enc(head) == text, "header re-encoding differs from safetensors' own"
    head["__metadata__"] = dict(sorted(head["__metadata__"].items()))
    new = enc(head)
    assert len(new) == len(text)
    with open(path, "wb") as fh:
        fh.write(data[:8] + new + raw[len(text):] + data[8 + n:])


def load_transformer(tiny):
    return ZImageTransformer2DModel.from_pretrained(os.path.join(tiny, "transformer"),
                                                    dtype=torch.float32).eval()


def load_pipe(tiny):
    pipe = ZImagePipeline.from_pretrained(tiny, text_encoder=None, tokenizer=None,
                                          dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.eval()
    return pipe


def make_adapter(tiny, cfg, out_dir, weight_name):
    """The training script's path: add_adapter(LoraConfig), (training: here seeded weights),
    get_peft_model_state_dict, ZImagePipeline.save_lora_weights with the adapter metadata."""
    tr = load_transformer(tiny)
    tr.add_adapter(LoraConfig(r=cfg["r"], lora_alpha=cfg["lora_alpha"], lora_dropout=0.0,
                              init_lora_weights="gaussian", target_modules=cfg["target_modules"]))
    g = torch.Generator().manual_seed(cfg["seed"])
    with torch.no_grad():  # init "gaussian" leaves lora_B zero: overwrite A and B, in name order
        for name, p in tr.named_parameters():
            if ".lora_A." in name:
                p.copy_(cfg["std_a"] * torch.randn(p.shape, generator=g, dtype=torch.float32))
            elif ".lora_B." in name:
                p.copy_(cfg["std_b"] * torch.randn(p.shape, generator=g, dtype=torch.float32))
    layers = get_peft_model_state_dict(tr)
    meta = tr.peft_config["default"].to_dict()  # = training_utils._collate_lora_metadata
    # to_dict leaves target_modules a set, which write_lora_layers turns into list(set): an order
    # that changes with Python's hash seed. Sorted here so that re-runs are byte-identical.
    for k, v in list(meta.items()):
        if isinstance(v, set):
            meta[k] = sorted(v)
    ZImagePipeline.save_lora_weights(out_dir, transformer_lora_layers=layers,
                                     transformer_lora_adapter_metadata=meta,
                                     weight_name=weight_name)
    sort_header_metadata(os.path.join(out_dir, weight_name))
    return {k: v.clone() for k, v in layers.items()}


def to_comfyui(layers, alpha):
    out = {}
    for k, v in layers.items():
        m, kind = k.rsplit(".lora_", 1)
        out[f"diffusion_model.{m}.lora_{'down' if kind == 'A.weight' else 'up'}.weight"] = v
        out[f"diffusion_model.{m}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return out


def kohya_name(module):
    return "lora_unet_" + module.replace(".", "_")


def to_kohya(layers, alpha):
    out = {}
    for k, v in layers.items():
        m, kind = k.rsplit(".lora_", 1)
        out[f"{kohya_name(m)}.lora_{'down' if kind == 'A.weight' else 'up'}.weight"] = v
        out[f"{kohya_name(m)}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return out


def describe_file(path):
    with safe_open(path, "pt") as f:
        meta = f.metadata()
        keys = {k: {"shape": list(f.get_slice(k).get_shape()), "dtype": f.get_slice(k).get_dtype()}
                for k in sorted(f.keys())}
    if meta and "lora_adapter_metadata" in meta:
        meta = dict(meta, lora_adapter_metadata_parsed=json.loads(meta["lora_adapter_metadata"]))
    return keys, meta


def lora_modules(tr):
    return sorted(n for n, m in tr.named_modules() if isinstance(m, BaseTunerLayer))


def run_forward(tr, fwd):
    x = [fwd["a.x.0"].clone(), fwd["a.x.1"].clone()]
    cap = [fwd["a.cap_feats.0"].clone(), fwd["a.cap_feats.1"].clone()]
    with torch.no_grad():
        y = tr(x, fwd["a.t"].clone(), cap, return_dict=False)[0]
    return [yi.clone() for yi in y]


def effective_deltas(sd, scale_of):
    """module -> s * B @ A (float64) from a Diffusers-form state dict (lora_A / lora_B)."""
    d = {}
    for k in sd:
        if k.endswith(".lora_A.weight"):
            m = k[len("transformer."):-len(".lora_A.weight")] if k.startswith("transformer.") else \
                k[:-len(".lora_A.weight")]
            b = sd[k.replace(".lora_A.", ".lora_B.")]
            d[m] = scale_of(m) * (b.double() @ sd[k].double())
    return d


def plain_forward(tiny, base_sd, deltas, factor, fwd):
    """A PEFT-free transformer with W + factor * delta loaded with load_state_dict."""
    tr = load_transformer(tiny)
    sd = {k: v.clone() for k, v in base_sd.items()}
    for m, dlt in deltas.items():
        sd[m + ".weight"] = (sd[m + ".weight"].double() + factor * dlt).float()
    tr.load_state_dict(sd)
    return run_forward(tr, fwd), sd


def maxdiff(a, b):
    return max((x.double() - y.double()).abs().max().item() for x, y in zip(a, b))


def converter_probes(tiny):
    """What ZImagePipeline.lora_state_dict makes of other spellings (rank-1 dummies, alpha 2), and
    whether pipe.load_lora_weights then finds the modules."""
    A, B, al = torch.ones(1, 64), torch.ones(64, 1), torch.tensor(2.0)
    probes = {
        "comfyui_bare_out": {"diffusion_model.layers.0.attention.out.lora_down.weight": A,
                             "diffusion_model.layers.0.attention.out.lora_up.weight": B,
                             "diffusion_model.layers.0.attention.out.alpha": al},
        "kohya_bare_out": {"lora_unet_layers_0_attention_out.lora_down.weight": A,
                           "lora_unet_layers_0_attention_out.lora_up.weight": B,
                           "lora_unet_layers_0_attention_out.alpha": al},
        "diffusion_model_lora_A_with_alpha": {
            "diffusion_model.layers.0.attention.to_q.lora_A.weight": A,
            "diffusion_model.layers.0.attention.to_q.lora_B.weight": B,
            "diffusion_model.layers.0.attention.to_q.alpha": al},
        "diffusion_model_lora_A_no_alpha": {
            "diffusion_model.layers.0.attention.to_q.lora_A.weight": A,
            "diffusion_model.layers.0.attention.to_q.lora_B.weight": B},
        "transformer_lora_A_with_alpha": {"transformer.layers.0.attention.to_q.lora_A.weight": A,
                                          "transformer.layers.0.attention.to_q.lora_B.weight": B,
                                          "transformer.layers.0.attention.to_q.alpha": al},
        "peft_default_adapter_name": {"layers.0.attention.to_q.lora_A.default.weight": A,
                                      "layers.0.attention.to_q.lora_B.default.weight": B},
        "dot_format": {"diffusion_model.layers.0.attention.to.q.lora.down.weight": A,
                       "diffusion_model.layers.0.attention.to.q.lora.up.weight": B,
                       "diffusion_model.layers.0.attention.to.q.alpha": al},
        "dot_format_no_alpha": {"diffusion_model.layers.0.attention.to.q.lora.down.weight": A,
                                "diffusion_model.layers.0.attention.to.q.lora.up.weight": B},
        "comfyui_fused_qkv": {"diffusion_model.layers.0.attention.qkv.lora_down.weight": A,
                              "diffusion_model.layers.0.attention.qkv.lora_up.weight": torch.ones(192, 1),
                              "diffusion_model.layers.0.attention.qkv.alpha": al},
    }
    res = {}
    for name, sd in probes.items():
        entry = {"in": sorted(sd)}
        try:
            out = ZImagePipeline.lora_state_dict({k: v.clone() for k, v in sd.items()})
            entry["out"] = {k: {"shape": list(v.shape), "scale": round(float(v.flatten()[0]), 6)}
                            for k, v in sorted(out.items())}
        except Exception as e:  # noqa: BLE001  (recorded: what Diffusers does with it)
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
            res[name] = entry
            continue
        pipe = load_pipe(tiny)
        try:
            pipe.load_lora_weights({k: v.clone() for k, v in sd.items()})
            entry["load_lora_weights_targets"] = lora_modules(pipe.transformer)
        except Exception as e:  # noqa: BLE001
            entry["load_lora_weights_error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res[name] = entry
    return res


def kohya_name_check(tr):
    """lora_unet_<module with _> for every Linear of the transformer: what Diffusers makes of it."""
    A, B = torch.ones(1, 1), torch.ones(1, 1)
    sd, mods = {}, []
    for n, m in tr.named_modules():
        if isinstance(m, torch.nn.Linear):
            mods.append(n)
            sd[kohya_name(n) + ".lora_down.weight"] = A
            sd[kohya_name(n) + ".lora_up.weight"] = B
            sd[kohya_name(n) + ".alpha"] = torch.tensor(1.0)
    out = ZImagePipeline.lora_state_dict(sd)
    got = sorted(k[len("transformer."):-len(".lora_A.weight")] for k in out if k.endswith(".lora_A.weight"))
    wrong = sorted(set(mods) ^ set(got))
    return {"modules": len(mods), "round_trip_ok": not wrong, "mismatches": wrong,
            "examples": {kohya_name(n): n for n in sorted(mods)}}


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    here = os.path.dirname(os.path.abspath(__file__))
    tiny = os.path.join(here, "tiny_z_image")
    root = os.path.join(out, "lora")
    os.makedirs(root, exist_ok=True)
    fwd = load_file(os.path.join(tiny, "forward.safetensors"))
    base_sd = {k: v.clone() for k, v in load_transformer(tiny).state_dict().items()}

    # ---- the files --------------------------------------------------------------------------
    main_layers = make_adapter(tiny, MAIN, root, "diffusers.safetensors")
    extra_layers = make_adapter(tiny, EXTRA, root, "extra_targets.safetensors")
    save_st(to_comfyui(main_layers, MAIN["lora_alpha"]), os.path.join(root, "comfyui.safetensors"), None)
    save_st(to_kohya(main_layers, MAIN["lora_alpha"]), os.path.join(root, "kohya.safetensors"),
            {"format": "pt"})
    paths = {f: os.path.join(root, f + ".safetensors") for f in FILES}
    spec = {"diffusers": MAIN, "comfyui": MAIN, "kohya": MAIN, "extra_targets": EXTRA}
    raw = {f: load_file(p) for f, p in paths.items()}
    assert set(raw["diffusers"]) == {"transformer." + k for k in main_layers}
    for k, v in main_layers.items():
        assert torch.equal(raw["diffusers"]["transformer." + k], v)
    cases = {"diffusers_version": diffusers.__version__, "peft_version": peft.__version__,
             "fuse_lora_scale": FUSE_SCALE, "files": {}}

    # ---- lora_state_dict: the conversion -----------------------------------------------------
    ref_sd = raw["diffusers"]
    s_main = MAIN["lora_alpha"] / MAIN["r"]
    for f in FILES:
        sd, meta = ZImagePipeline.lora_state_dict(paths[f], return_lora_metadata=True)
        keys, header = describe_file(paths[f])
        info = {"keys": keys, "header_metadata": header,
                "rank": spec[f]["r"], "alpha": spec[f]["lora_alpha"],
                "file_scale_alpha_over_r": spec[f]["lora_alpha"] / spec[f]["r"],
                "lora_state_dict": {"converted": sorted(sd) != sorted(raw[f]),
                                    "metadata_returned": meta is not None,
                                    "keys": {k: list(v.shape) for k, v in sorted(sd.items())}}}
        if f in ("comfyui", "kohya"):
            assert sorted(sd) == sorted(ref_sd), (f, sorted(set(sd) ^ set(ref_sd))[:6])
            worst, fac = 0.0, set()
            for k in sd:
                if k.endswith(".lora_A.weight"):
                    kb = k.replace(".lora_A.", ".lora_B.")
                    fa = (sd[k] / ref_sd[k]).unique().tolist()
                    fb = (sd[kb] / ref_sd[kb]).unique().tolist()
                    assert len(fa) == 1 and len(fb) == 1, (k, fa, fb)
                    fac.add((fa[0], fb[0]))
                    prod = sd[kb] @ sd[k]
                    want = s_main * (ref_sd[kb] @ ref_sd[k])
                    assert torch.equal(prod, want), k
                    worst = max(worst, (prod - want).abs().max().item())
            assert len(fac) == 1
            (sdn, sup), = fac
            info["lora_state_dict"].update({"scale_down": sdn, "scale_up": sup,
                                            "B_A_product_vs_alpha_over_r_B_A_max_abs_diff": worst})
            print(f"{f}: lora_state_dict -> diffusers keys, lora_A x {sdn}, lora_B x {sup}, "
                  f"product = alpha/r B@A exactly")
        else:
            assert not info["lora_state_dict"]["converted"] and meta is not None
        cases["files"][f] = info

    # ---- references ---------------------------------------------------------------------------
    exp = {}
    pipe = load_pipe(tiny)
    base_out = run_forward(pipe.transformer, fwd)
    for i, y in enumerate(base_out):
        assert torch.equal(y, fwd[f"a.out.{i}"]), i
        exp[f"base.out.{i}"] = y
    print("base.out equals tiny_z_image/forward.safetensors a.out exactly")

    fused_ref = None
    for f in FILES:
        info = cases["files"][f]
        pipe = load_pipe(tiny)
        pipe.load_lora_weights(paths[f])
        tr = pipe.transformer
        names = list(tr.peft_config)
        assert len(names) == 1
        pc = tr.peft_config[names[0]]
        targets = lora_modules(tr)
        lin = {n: m for n, m in tr.named_modules() if isinstance(m, BaseTunerLayer)}
        scalings = sorted({m.scaling[names[0]] for m in lin.values()})
        info["loaded"] = {"adapter_name": names[0], "peft_r": pc.r, "peft_lora_alpha": pc.lora_alpha,
                          "rank_pattern": pc.rank_pattern, "alpha_pattern": pc.alpha_pattern,
                          "peft_scaling": scalings, "targets": targets}
        y = run_forward(tr, fwd)
        for i, yi in enumerate(y):
            exp[f"{f}.out.{i}"] = yi

        # independent: a plain transformer with W + (alpha / r) B @ A from the file's own A, B
        # (comfyui / kohya: their lora_down / lora_up are A / B and alpha / rank = s_main)
        s = spec[f]["lora_alpha"] / spec[f]["r"]
        deltas = effective_deltas(main_layers if f in ("comfyui", "kohya") else raw[f], lambda m, s=s: s)
        assert sorted(deltas) == targets, (sorted(deltas)[:4], targets[:4])
        yp, _ = plain_forward(tiny, base_sd, deltas, 1.0, fwd)
        d_plain = maxdiff(y, yp)
        assert d_plain < 2e-5, (f, d_plain)

        # fused at 0.5 on a fresh load
        pipe = load_pipe(tiny)
        pipe.load_lora_weights(paths[f])
        pipe.fuse_lora(lora_scale=FUSE_SCALE)
        tr = pipe.transformer
        fsd = {}
        for k, v in tr.state_dict().items():
            if ".lora_" in k:
                continue
            fsd[k.replace(".base_layer.", ".")] = v.clone()
        assert sorted(fsd) == sorted(base_sd)
        changed = sorted(k for k in fsd if not torch.equal(fsd[k], base_sd[k]))
        assert changed == sorted(m + ".weight" for m in targets), changed[:4]
        yf = run_forward(tr, fwd)
        worst_w = 0.0
        for k in changed:
            want = base_sd[k].double() + FUSE_SCALE * deltas[k[:-len(".weight")]]
            worst_w = max(worst_w, (fsd[k].double() - want).abs().max().item())
        assert worst_w < 1e-6, worst_w
        yfp, _ = plain_forward(tiny, base_sd, {k[:-len(".weight")]: (fsd[k].double() - base_sd[k].double())
                                               for k in changed}, 1.0, fwd)
        d_fused_plain = maxdiff(yf, yfp)
        assert d_fused_plain < 1e-5, d_fused_plain
        if f == "diffusers":
            fused_ref = {k: fsd[k] for k in changed}
        if f in ("comfyui", "kohya"):
            same = all(torch.equal(fsd[k], fused_ref[k]) for k in changed) and sorted(fused_ref) == changed
            assert same, f
            info["fused_params_stored_as"] = "diffusers"
            assert all(torch.equal(a, exp[f"diffusers.out.{i}"]) for i, a in enumerate(y)), f
            info["out_bitwise_equal_to_diffusers"] = True
            info["fused_out_bitwise_equal_to_diffusers"] = all(
                torch.equal(a, exp[f"diffusers.fused_out.{i}"]) for i, a in enumerate(yf))
        else:
            for k in changed:
                exp[f"{f}.fused.{k}"] = fsd[k]
            info["fused_params_stored_as"] = f
        for i, yi in enumerate(yf):
            exp[f"{f}.fused_out.{i}"] = yi
        info["fused_params"] = changed
        info["max_abs_diff"] = {
            "out_vs_base_out": maxdiff(y, base_out),
            "fused_out_vs_base_out": maxdiff(yf, base_out),
            "fused_out_vs_out": maxdiff(yf, y),
            "max_abs_base_out": max(b.abs().max().item() for b in base_out),
            "check_out_vs_plain_W_plus_sBA": d_plain,
            "check_fused_param_vs_W_plus_half_sBA": worst_w,
            "check_fused_out_vs_plain_forward": d_fused_plain,
        }
        print(f"{f}: {len(targets)} targets, r {pc.r} alpha {pc.lora_alpha} scaling {scalings}; "
              f"|out - base| {info['max_abs_diff']['out_vs_base_out']:.4f}, "
              f"|fused_out - base| {info['max_abs_diff']['fused_out_vs_base_out']:.4f}; "
              f"vs plain W + sBA {d_plain:.1e}, fused W {worst_w:.1e}")

    cases["kohya_names_of_every_linear"] = kohya_name_check(load_transformer(tiny))
    assert cases["kohya_names_of_every_linear"]["round_trip_ok"], cases["kohya_names_of_every_linear"]
    cases["converter_probes"] = converter_probes(tiny)
    save_st(exp, os.path.join(root, "expected.safetensors"), {"format": "pt"})
    with open(os.path.join(root, "lora_cases.json"), "w") as fh:
        fh.write(json.dumps(cases, indent=2, sort_keys=True) + "\n")
    print(f"wrote {root}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_lora.py OUT_DIR  (writes OUT_DIR/lora)")
    main(sys.argv[1])
