#!/usr/bin/env python3
"""Makes tests/golden/qwen_image/lora/: LoRA files for the tiny Qwen-Image transformer
(../tiny_qwen_image/transformer) in the layouts people trade, and references of what Diffusers' own
QwenImageLoraLoaderMixin (QwenImagePipeline.lora_state_dict / load_lora_weights / fuse_lora) does
with them.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 + PEFT 0.20.1.dev0 at
../shared/refstack2/src), after make_transformer.py:
    ../shared/refstack2/run python3 tests/golden/qwen_image/make_lora.py tests/golden/qwen_image
Re-running writes byte-identical files (float32, one CPU thread, seeded weights, sorted keys).

Writes, under OUT/lora/:
  diffusers.safetensors      as train_dreambooth_lora_qwen_image.py saves it: PEFT LoraConfig(r=4,
                             lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_k",
                             "to_q", "to_v", "to_out.0"]) added with transformer.add_adapter, its
                             weights then overwritten with seeded randoms, get_peft_model_state_dict,
                             QwenImagePipeline.save_lora_weights(..., transformer_lora_adapter_metadata=
                             peft_config["default"].to_dict()) (the script's _collate_lora_metadata)
  comfyui.safetensors        the same adapter as diffusion_model.<module>.lora_down.weight /
                             .lora_up.weight / .alpha (float32 scalar 8); no header metadata
  kohya.safetensors          the same as lora_unet_<module with "." -> "_">.lora_down.weight /
                             .lora_up.weight / .alpha; header metadata {"format": "pt"} (only modules
                             whose kohya name Diffusers converts back to the module: all of them here)
  extra_targets.safetensors  a second adapter (Diffusers form, r=2, lora_alpha=2) on feed-forward,
                             modulation, input / output, final-norm and timestep-embedder Linears as
                             well as one attention Linear
  peft_default.safetensors   diffusers.safetensors' A and B under PEFT's raw names, as the adapted
                             transformer's own state_dict() has them: <module>.lora_A.default.weight /
                             .lora_B.default.weight (no "transformer." prefix: with it Diffusers fails,
                             see converter_probes), header metadata {"format": "pt"} only, so no alpha
  expected.safetensors       base.out; per file F: F.out (load_lora_weights, unfused, scale 1),
                             F.fused_out (fuse_lora(lora_scale=0.5) on a fresh load), F.fused.<param>
                             (every transformer parameter the fuse changed; for diffusers,
                             extra_targets and peft_default only: comfyui's and kohya's are checked
                             bit-identical to diffusers')
  lora_cases.json            per file: keys and shapes, header metadata, what lora_state_dict made of
                             the keys, the PEFT targets / r / alpha Diffusers ended up with, how much
                             the LoRA moves the output; kohya names of every Linear; converter probes
                             on other key spellings

Forward inputs: tiny_qwen_image/forward.safetensors case "a" (hidden_states [2, 24, 64],
encoder_hidden_states [2, 7, 64] with its int64 mask, timestep [2], img_shapes [2, 1, 3] -> a list
(batch) of lists of (frame, h, w) tuples); out = transformer(..., return_dict=False)[0] [2, 24, 64].

Checks (the outputs do not depend on them): base.out equals tiny_qwen_image/forward.safetensors
a.out; lora_state_dict turns comfyui and kohya into diffusers' keys with lora_A * scale_down,
lora_B * scale_up whose product is alpha / r * B @ A, and peft_default into diffusers' keys with
the tensors untouched; each out equals a plain (PEFT-free) transformer with W + s * B @ A (s the
scale Diffusers loads with: alpha / r, or 1 where the alpha is lost) and each fused parameter
equals W + 0.5 s B @ A; kohya names of every Linear module of the transformer are converted back
to the module name.
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
# 1. diffusers.loaders leaves out QwenImageLoraLoaderMixin and pipeline_qwenimage.py cannot
#    import: set import_utils' _transformers_available (as make_transformer.py does).
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
from diffusers import QwenImageTransformer2DModel  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

assert _lora_base.USE_PEFT_BACKEND and _loaders_peft.USE_PEFT_BACKEND

# The training script's default targets (args.lora_layers None) and its LoraConfig (--rank 4, but
# --lora_alpha 8 instead of the default 4, so that the scale alpha / r = 2 shows). A and B at std
# 0.2 / 0.1 (s B @ A about 1.6 x the base weights' std 0.05): the attention branch is gated by
# img_mod / txt_mod, so at Z-Image's 0.1 / 0.05 the LoRA moved the output by only 0.012.
MAIN = dict(r=4, lora_alpha=8, target_modules=["to_k", "to_q", "to_v", "to_out.0"],
            seed=20261220, std_a=0.2, std_b=0.1)
# A second adapter on other Linear modules (full names: PEFT matches a target when the module
# name equals it or ends with "." + it). Kept to one block per module kind for size.
EXTRA = dict(r=2, lora_alpha=2, target_modules=[
    "transformer_blocks.0.attn.add_k_proj",
    "transformer_blocks.1.img_mlp.net.0.proj", "transformer_blocks.1.img_mlp.net.2",
    "transformer_blocks.0.txt_mlp.net.0.proj", "transformer_blocks.0.txt_mlp.net.2",
    "transformer_blocks.0.img_mod.1", "transformer_blocks.1.txt_mod.1",
    "img_in", "txt_in", "proj_out", "norm_out.linear",
    "time_text_embed.timestep_embedder.linear_1"], seed=20261221, std_a=0.1, std_b=0.1)
FUSE_SCALE = 0.5
FILES = ["diffusers", "comfyui", "kohya", "extra_targets", "peft_default"]
CASE = "a"


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
    return QwenImageTransformer2DModel.from_pretrained(os.path.join(tiny, "transformer"),
                                                       dtype=torch.float32).eval()


def load_pipe(tiny):
    pipe = QwenImagePipeline.from_pretrained(tiny, text_encoder=None, tokenizer=None,
                                             dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    pipe.transformer.eval()
    return pipe


def make_adapter(tiny, cfg, out_dir, weight_name):
    """The training script's path: add_adapter(LoraConfig), (training: here seeded weights),
    get_peft_model_state_dict, QwenImagePipeline.save_lora_weights with the adapter metadata.
    Also returns the adapter's entries of the model's own state_dict() (PEFT's raw names)."""
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
    raw_peft = {k: v.clone() for k, v in tr.state_dict().items() if ".lora_" in k}
    meta = tr.peft_config["default"].to_dict()  # = training_utils._collate_lora_metadata
    # to_dict leaves target_modules a set, which write_lora_layers turns into list(set): an order
    # that changes with Python's hash seed. Sorted here so that re-runs are byte-identical.
    for k, v in list(meta.items()):
        if isinstance(v, set):
            meta[k] = sorted(v)
    QwenImagePipeline.save_lora_weights(out_dir, transformer_lora_layers=layers,
                                        transformer_lora_adapter_metadata=meta,
                                        weight_name=weight_name)
    sort_header_metadata(os.path.join(out_dir, weight_name))
    return {k: v.clone() for k, v in layers.items()}, raw_peft


def to_comfyui(layers, alpha):
    out = {}
    for k, v in layers.items():
        m, kind = k.rsplit(".lora_", 1)
        out[f"diffusion_model.{m}.lora_{'down' if kind == 'A.weight' else 'up'}.weight"] = v
        out[f"diffusion_model.{m}.alpha"] = torch.tensor(float(alpha), dtype=torch.float32)
    return out


def kohya_name(module):
    return "lora_unet_" + module.replace(".", "_")


def to_kohya(layers, alpha, modules):
    out = {}
    for k, v in layers.items():
        m, kind = k.rsplit(".lora_", 1)
        if m not in modules:
            continue
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


def lora_scalings(tr):
    return sorted({s for m in tr.modules() if isinstance(m, BaseTunerLayer) for s in m.scaling.values()})


def forward_inputs(fwd):
    p = CASE + "."
    mask = fwd.get(p + "encoder_hidden_states_mask")
    shapes = [[tuple(int(v) for v in s) for s in row] for row in fwd[p + "img_shapes"].tolist()]
    return dict(hidden_states=fwd[p + "hidden_states"], encoder_hidden_states=fwd[p + "encoder_hidden_states"],
                encoder_hidden_states_mask=mask, timestep=fwd[p + "timestep"], img_shapes=shapes)


def run_forward(tr, fwd):
    kw = forward_inputs(fwd)
    kw = {k: (v.clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
    with torch.no_grad():
        return tr(**kw, return_dict=False)[0].clone()


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
    return (a.double() - b.double()).abs().max().item()


def converter_probes(tiny):
    """What QwenImagePipeline.lora_state_dict makes of other spellings (rank-1 dummies, alpha 2
    unless said), and whether pipe.load_lora_weights then finds the modules (and at what scale)."""
    A, B, al = torch.ones(1, 64), torch.ones(64, 1), torch.tensor(2.0)
    m = "transformer_blocks.0.attn.to_q"
    km = kohya_name(m)
    probes = {
        "comfyui_no_alpha": {f"diffusion_model.{m}.lora_down.weight": A,
                             f"diffusion_model.{m}.lora_up.weight": B},
        "kohya_no_alpha": {f"{km}.lora_down.weight": A, f"{km}.lora_up.weight": B},
        "kohya_rank4_alpha1": {f"{km}.lora_down.weight": torch.ones(4, 64),
                               f"{km}.lora_up.weight": torch.ones(64, 4),
                               f"{km}.alpha": torch.tensor(1.0)},
        "diffusion_model_lora_A_with_alpha": {f"diffusion_model.{m}.lora_A.weight": A,
                                              f"diffusion_model.{m}.lora_B.weight": B,
                                              f"diffusion_model.{m}.alpha": al},
        "diffusion_model_lora_A_no_alpha": {f"diffusion_model.{m}.lora_A.weight": A,
                                            f"diffusion_model.{m}.lora_B.weight": B},
        "transformer_lora_A_with_alpha": {f"transformer.{m}.lora_A.weight": A,
                                          f"transformer.{m}.lora_B.weight": B,
                                          f"transformer.{m}.alpha": al},
        "peft_default_transformer_prefix": {f"transformer.{m}.lora_A.default.weight": A,
                                            f"transformer.{m}.lora_B.default.weight": B},
        "peft_default_bare": {f"{m}.lora_A.default.weight": A, f"{m}.lora_B.default.weight": B},
        "peft_default_with_alpha": {f"{m}.lora_A.default.weight": A, f"{m}.lora_B.default.weight": B,
                                    f"{m}.alpha": al},
        "comfyui_and_lora_A_mixed": {f"diffusion_model.{m}.lora_down.weight": A,
                                     f"diffusion_model.{m}.lora_up.weight": B,
                                     f"diffusion_model.{m}.alpha": al,
                                     "diffusion_model.transformer_blocks.0.attn.to_k.lora_A.weight": A,
                                     "diffusion_model.transformer_blocks.0.attn.to_k.lora_B.weight": B},
        # not a module of Qwen-Image: shows that convert_key strips len("transformer_blocks_")
        # characters from any kohya name outside its six-entry top-level table
        "kohya_unlisted_top_level_hypothetical": {
            "lora_unet_time_text_embed_guidance_embedder_linear_1.lora_down.weight": A,
            "lora_unet_time_text_embed_guidance_embedder_linear_1.lora_up.weight": B,
            "lora_unet_time_text_embed_guidance_embedder_linear_1.alpha": al},
    }
    res = {}
    for name, sd in probes.items():
        entry = {"in": sorted(sd)}
        try:
            out = QwenImagePipeline.lora_state_dict({k: v.clone() for k, v in sd.items()})
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
            entry["load_lora_weights_peft_scaling"] = lora_scalings(pipe.transformer)
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
    out = QwenImagePipeline.lora_state_dict(sd)
    got = sorted(k[len("transformer."):-len(".lora_A.weight")] for k in out if k.endswith(".lora_A.weight"))
    wrong = sorted(set(mods) ^ set(got))
    # per module: what its own kohya name converts to (one module at a time)
    converted = {}
    for n in sorted(mods):
        one = {k: v for k, v in sd.items() if k.startswith(kohya_name(n) + ".")}
        o = QwenImagePipeline.lora_state_dict(one)
        converted[n] = [k[len("transformer."):-len(".lora_A.weight")] for k in o if k.endswith(".lora_A.weight")][0]
    bad = sorted(n for n, c in converted.items() if c != n)
    return {"modules": len(mods), "round_trip_ok": not wrong and not bad, "mismatches": sorted(set(wrong) | set(bad)),
            "wrongly_converted": {n: converted[n] for n in bad},
            "examples": {kohya_name(n): converted[n] for n in sorted(mods)}}


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    here = os.path.dirname(os.path.abspath(__file__))
    tiny = os.path.join(here, "tiny_qwen_image")
    root = os.path.join(out, "lora")
    os.makedirs(root, exist_ok=True)
    fwd = load_file(os.path.join(tiny, "forward.safetensors"))
    base_sd = {k: v.clone() for k, v in load_transformer(tiny).state_dict().items()}
    kohya_check = kohya_name_check(load_transformer(tiny))

    # ---- the files --------------------------------------------------------------------------
    main_layers, main_raw = make_adapter(tiny, MAIN, root, "diffusers.safetensors")
    extra_layers, _ = make_adapter(tiny, EXTRA, root, "extra_targets.safetensors")
    main_modules = sorted({k.rsplit(".lora_", 1)[0] for k in main_layers})
    kohya_ok = [m for m in main_modules if m not in kohya_check["wrongly_converted"]]
    kohya_left_out = [m for m in main_modules if m in kohya_check["wrongly_converted"]]
    save_st(to_comfyui(main_layers, MAIN["lora_alpha"]), os.path.join(root, "comfyui.safetensors"), None)
    save_st(to_kohya(main_layers, MAIN["lora_alpha"], set(kohya_ok)),
            os.path.join(root, "kohya.safetensors"), {"format": "pt"})
    # PEFT's raw names: the same tensors as get_peft_model_state_dict with ".default" inserted
    assert sorted(main_raw) == sorted(k.replace(".weight", ".default.weight") for k in main_layers)
    for k, v in main_layers.items():
        assert torch.equal(main_raw[k.replace(".weight", ".default.weight")], v)
    save_st(main_raw, os.path.join(root, "peft_default.safetensors"), {"format": "pt"})
    paths = {f: os.path.join(root, f + ".safetensors") for f in FILES}
    spec = {"diffusers": MAIN, "comfyui": MAIN, "kohya": MAIN, "extra_targets": EXTRA,
            "peft_default": MAIN}
    s_main = MAIN["lora_alpha"] / MAIN["r"]
    # the scale Diffusers ends up applying (peft_default: no alpha anywhere, so alpha = r)
    s_load = {"diffusers": s_main, "comfyui": s_main, "kohya": s_main,
              "extra_targets": EXTRA["lora_alpha"] / EXTRA["r"], "peft_default": 1.0}
    # the scaling PEFT's layers get (comfyui / kohya: alpha / r is folded into lora_A, so 1)
    peft_scaling = {"diffusers": s_main, "comfyui": 1.0, "kohya": 1.0,
                    "extra_targets": EXTRA["lora_alpha"] / EXTRA["r"], "peft_default": 1.0}
    raw = {f: load_file(p) for f, p in paths.items()}
    assert set(raw["diffusers"]) == {"transformer." + k for k in main_layers}
    for k, v in main_layers.items():
        assert torch.equal(raw["diffusers"]["transformer." + k], v)
    cases = {"diffusers_version": diffusers.__version__, "peft_version": peft.__version__,
             "fuse_lora_scale": FUSE_SCALE, "forward_case": CASE, "files": {},
             "kohya_modules_left_out": kohya_left_out}

    # ---- lora_state_dict: the conversion -----------------------------------------------------
    ref_sd = raw["diffusers"]
    for f in FILES:
        sd, meta = QwenImagePipeline.lora_state_dict(paths[f], return_lora_metadata=True)
        keys, header = describe_file(paths[f])
        info = {"keys": keys, "header_metadata": header,
                "rank": spec[f]["r"], "alpha": spec[f]["lora_alpha"],
                "file_scale_alpha_over_r": spec[f]["lora_alpha"] / spec[f]["r"],
                "loaded_scale": s_load[f],
                "lora_state_dict": {"converted": sorted(sd) != sorted(raw[f]),
                                    "metadata_returned": meta is not None,
                                    "keys": {k: list(v.shape) for k, v in sorted(sd.items())}}}
        if f in ("comfyui", "kohya"):
            want_keys = sorted(k for k in ref_sd if k[len("transformer."):].rsplit(".lora_", 1)[0] in kohya_ok) \
                if f == "kohya" else sorted(ref_sd)
            assert sorted(sd) == want_keys, (f, sorted(set(sd) ^ set(want_keys))[:6])
            assert meta is None
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
        elif f == "peft_default":
            assert sorted(sd) == sorted(ref_sd) and meta is None
            assert all(torch.equal(sd[k], ref_sd[k]) for k in sd)
            info["lora_state_dict"]["tensors_equal_diffusers"] = True
            print("peft_default: lora_state_dict -> diffusers keys, tensors untouched, no metadata")
        else:
            assert not info["lora_state_dict"]["converted"] and meta is not None
        cases["files"][f] = info

    # ---- references ---------------------------------------------------------------------------
    exp = {}
    pipe = load_pipe(tiny)
    base_out = run_forward(pipe.transformer, fwd)
    assert torch.equal(base_out, fwd[f"{CASE}.out"])
    exp["base.out"] = base_out
    print(f"base.out equals tiny_qwen_image/forward.safetensors {CASE}.out exactly")

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
        scalings = lora_scalings(tr)
        assert scalings == [peft_scaling[f]], (f, scalings)
        info["loaded"] = {"adapter_name": names[0], "peft_r": pc.r, "peft_lora_alpha": pc.lora_alpha,
                          "rank_pattern": pc.rank_pattern, "alpha_pattern": pc.alpha_pattern,
                          "peft_scaling": scalings, "targets": targets}
        y = run_forward(tr, fwd)
        exp[f"{f}.out"] = y

        # independent: a plain transformer with W + s B @ A from the file's own A, B
        # (comfyui / kohya: their lora_down / lora_up are A / B and alpha / rank = s_main)
        s = s_load[f]
        src = main_layers if f in ("comfyui", "kohya", "peft_default") else raw[f]
        deltas = effective_deltas(src, lambda m, s=s: s)
        if f == "kohya":
            deltas = {m: d for m, d in deltas.items() if m in kohya_ok}
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
        if f == "comfyui" or (f == "kohya" and not kohya_left_out):
            same = all(torch.equal(fsd[k], fused_ref[k]) for k in changed) and sorted(fused_ref) == changed
            assert same, f
            info["fused_params_stored_as"] = "diffusers"
            assert torch.equal(y, exp["diffusers.out"]), f
            info["out_bitwise_equal_to_diffusers"] = True
            info["fused_out_bitwise_equal_to_diffusers"] = torch.equal(yf, exp["diffusers.fused_out"])
        else:
            for k in changed:
                exp[f"{f}.fused.{k}"] = fsd[k]
            info["fused_params_stored_as"] = f
        exp[f"{f}.fused_out"] = yf
        info["fused_params"] = changed
        info["max_abs_diff"] = {
            "out_vs_base_out": maxdiff(y, base_out),
            "fused_out_vs_base_out": maxdiff(yf, base_out),
            "fused_out_vs_out": maxdiff(yf, y),
            "max_abs_base_out": base_out.abs().max().item(),
            "check_out_vs_plain_W_plus_sBA": d_plain,
            "check_fused_param_vs_W_plus_half_sBA": worst_w,
            "check_fused_out_vs_plain_forward": d_fused_plain,
        }
        if f == "peft_default":
            info["max_abs_diff"]["out_vs_diffusers_out"] = maxdiff(y, exp["diffusers.out"])
            # scale 1 unfused = diffusers' W + 0.5 * 2 B @ A fused: the same model, other rounding
            d_cross = maxdiff(y, exp["diffusers.fused_out"])
            assert d_cross < 2e-5, d_cross
            info["max_abs_diff"]["check_out_vs_diffusers_fused_out"] = d_cross
        print(f"{f}: {len(targets)} targets, r {pc.r} alpha {pc.lora_alpha} scaling {scalings}; "
              f"|out - base| {info['max_abs_diff']['out_vs_base_out']:.4f}, "
              f"|fused_out - base| {info['max_abs_diff']['fused_out_vs_base_out']:.4f}; "
              f"vs plain W + sBA {d_plain:.1e}, fused W {worst_w:.1e}, fused out {d_fused_plain:.1e}")

    cases["kohya_names_of_every_linear"] = kohya_check
    print(f"kohya names: {kohya_check['modules']} Linears, round trip ok {kohya_check['round_trip_ok']}, "
          f"wrong {kohya_check['wrongly_converted']}")
    cases["converter_probes"] = converter_probes(tiny)
    for name, e in cases["converter_probes"].items():
        print(f"probe {name}: " + ("error " + e["error"][:90] if "error" in e else
              ("load error " + e["load_lora_weights_error"][:90] if "load_lora_weights_error" in e else
               f"loads {e['load_lora_weights_targets']} scaling {e['load_lora_weights_peft_scaling']}")))
    save_st(exp, os.path.join(root, "expected.safetensors"), {"format": "pt"})
    with open(os.path.join(root, "lora_cases.json"), "w") as fh:
        fh.write(json.dumps(cases, indent=2, sort_keys=True) + "\n")
    print(f"wrote {root}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_lora.py OUT_DIR  (writes OUT_DIR/lora)")
    main(sys.argv[1])
