#!/usr/bin/env python3
"""Makes tests/golden/wan/lora/: LoRA files for the tiny Wan 2.1 transformers
(../tiny_wan/transformer, ../tiny_wan/transformer_i2v) in the layouts people trade, and references of
what Diffusers' own WanLoraLoaderMixin (WanPipeline.lora_state_dict / load_lora_weights /
fuse_lora) does with them.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 + PEFT 0.20.1.dev0 at
../shared/refstack2/src), after make_transformer.py:
    OMP_NUM_THREADS=1 ../shared/refstack2/run python3 tests/golden/wan/make_lora.py tests/golden/wan
Re-running writes byte-identical files (float32, one CPU thread, seeded weights, sorted keys,
sorted header metadata).

Writes, under OUT/lora/:
  diffusers.safetensors    T2V adapter as a Diffusers training script saves it: PEFT LoraConfig(r=4,
                           lora_alpha=8, init_lora_weights="gaussian", target_modules=["to_q", "to_k",
                           "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]) added with
                           transformer.add_adapter, its weights overwritten with seeded randoms,
                           get_peft_model_state_dict, WanPipeline.save_lora_weights(...,
                           transformer_lora_adapter_metadata=peft_config["default"].to_dict()):
                           keys transformer.<module>.lora_A.weight / .lora_B.weight, alpha only in
                           the header's "lora_adapter_metadata" JSON
  comfyui.safetensors      the same adapter in the original Wan names (ComfyUI / musubi "default"
                           export): diffusion_model.blocks.N.{self_attn,cross_attn}.{q,k,v,o} /
                           ffn.{0,2} + .lora_down.weight / .lora_up.weight / .alpha (float32 scalar
                           8); no header metadata
  kohya.safetensors        the same as musubi-tuner's kohya names: lora_unet_<original name with
                           "." -> "_">.lora_down.weight / .lora_up.weight / .alpha; {"format": "pt"}
  comfyui_i2v.safetensors  an I2V adapter (r=4) on transformer_i2v in the original names: every
                           module the T2V one has, plus cross_attn.k_img / v_img and, outside the
                           blocks, img_emb.proj.1 / .3, text_embedding.0 / .2, time_embedding.0 / .2,
                           time_projection.1 and head.head. Block modules carry .alpha 8; the
                           non-block ones carry NO alpha, because Diffusers' converter does not
                           consume alpha keys outside the blocks and raises ValueError on them (see
                           cases.json probes) -> they load at scale 1
  expected.safetensors     outputs `out` of WanTransformer3DModel on tiny_wan/forward.safetensors
                           cases t2v_f5 (T2V) / i2v (I2V): base, and per file after load_lora_weights
                           (unfused) and after fuse_lora(lora_scale=...); see cases.json "entries"
  cases.json               entries (expected key -> file, transformer, forward case, fused, scale);
                           per file: keys and shapes, header metadata, what lora_state_dict made of
                           them, the PEFT r / alpha / scaling Diffusers ended up with, targets, how
                           far the LoRA moves the output; the name mapping table; converter probes

Checks (the outputs do not depend on them): base outputs equal tiny_wan/forward.safetensors'
t2v_f5.out / i2v.out; lora_state_dict turns comfyui and kohya into diffusers.safetensors' keys with
B @ A equal to alpha / r * B @ A of diffusers.safetensors exactly, and their outputs equal
diffusers.safetensors' bit for bit; every output equals a plain (PEFT-free) transformer with
W + lora_scale * s * B @ A (s = alpha / r; 1 for the I2V file's non-block modules); fused weights
equal W + lora_scale * s * B @ A.
"""
import json
import os
import struct
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

# refstack2 has only a stub of transformers (see tests/golden/qwen_image/make_lora.py): flip
# Diffusers' transformers-availability flag and USE_PEFT_BACKEND before diffusers.loaders is
# imported, so that loaders.peft / loaders.lora_base bind True. Diffusers' code is untouched.
import diffusers.utils.import_utils as _iu  # noqa: E402
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"
import diffusers.utils as _du  # noqa: E402
import diffusers.utils.constants as _dc  # noqa: E402
_du.USE_PEFT_BACKEND = _dc.USE_PEFT_BACKEND = True

import diffusers  # noqa: E402
import diffusers.loaders.lora_base as _lora_base  # noqa: E402
import diffusers.loaders.lora_pipeline as _lora_pipeline  # noqa: E402
import diffusers.loaders.peft as _loaders_peft  # noqa: E402
import peft  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402
from diffusers.pipelines.wan.pipeline_wan import WanPipeline  # noqa: E402
from peft import LoraConfig  # noqa: E402
from peft.tuners.tuners_utils import BaseTunerLayer  # noqa: E402
from peft.utils import get_peft_model_state_dict  # noqa: E402

_lora_pipeline.USE_PEFT_BACKEND = True
assert _lora_base.USE_PEFT_BACKEND and _loaders_peft.USE_PEFT_BACKEND

R, ALPHA = 4, 8
S = ALPHA / R
STD_A, STD_B = 0.2, 0.1
SEED_T2V, SEED_I2V = 20270301, 20270302
HALF = 0.5
BLOCK_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
I2V_EXTRA_TARGETS = ["add_k_proj", "add_v_proj",
                     "condition_embedder.image_embedder.ff.net.0.proj",
                     "condition_embedder.image_embedder.ff.net.2",
                     "condition_embedder.text_embedder.linear_1", "condition_embedder.text_embedder.linear_2",
                     "condition_embedder.time_embedder.linear_1", "condition_embedder.time_embedder.linear_2",
                     "condition_embedder.time_proj", "proj_out"]

# Diffusers module <- original Wan module, as _convert_non_diffusers_wan_lora_to_diffusers maps them
# (N = block index). "alpha" says whether that converter consumes an .alpha key for the row.
BLOCK_MAP = [("self_attn.q", "attn1.to_q"), ("self_attn.k", "attn1.to_k"), ("self_attn.v", "attn1.to_v"),
             ("self_attn.o", "attn1.to_out.0"),
             ("cross_attn.q", "attn2.to_q"), ("cross_attn.k", "attn2.to_k"), ("cross_attn.v", "attn2.to_v"),
             ("cross_attn.o", "attn2.to_out.0"),
             ("cross_attn.k_img", "attn2.add_k_proj"), ("cross_attn.v_img", "attn2.add_v_proj"),
             ("ffn.0", "ffn.net.0.proj"), ("ffn.2", "ffn.net.2")]
TOP_MAP = [("time_projection.1", "condition_embedder.time_proj"),
           ("head.head", "proj_out"),
           ("text_embedding.0", "condition_embedder.text_embedder.linear_1"),
           ("text_embedding.2", "condition_embedder.text_embedder.linear_2"),
           ("time_embedding.0", "condition_embedder.time_embedder.linear_1"),
           ("time_embedding.2", "condition_embedder.time_embedder.linear_2"),
           ("img_emb.proj.1", "condition_embedder.image_embedder.ff.net.0.proj"),
           ("img_emb.proj.3", "condition_embedder.image_embedder.ff.net.2")]
B2O = {d: o for o, d in BLOCK_MAP}
T2O = {d: o for o, d in TOP_MAP}


def original_name(module):
    if module.startswith("blocks."):
        _, n, rest = module.split(".", 2)
        return f"blocks.{n}.{B2O[rest]}"
    return T2O[module]


def kohya_name(module):
    return "lora_unet_" + original_name(module).replace(".", "_")


def save_st(tensors, path, metadata):
    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)}, path,
              metadata=metadata)


def sort_header_metadata(path):
    """safetensors serialises __metadata__ from a Rust HashMap (order varies run to run with two or
    more entries): rewrite the header with the entries sorted (same JSON, same length)."""
    with open(path, "rb") as fh:
        data = fh.read()
    n = struct.unpack("<Q", data[:8])[0]
    raw = data[8:8 + n]
    text = raw.rstrip(b" ")
    head = json.loads(text)

    def enc(h):
        return json.dumps(h, separators=(",", ":"), ensure_ascii=False).encode()
    assert enc(head) == text, "header re-encoding differs from safetensors' own"
    head["__metadata__"] = dict(sorted(head["__metadata__"].items()))
    new = enc(head)
    assert len(new) == len(text)
    with open(path, "wb") as fh:
        fh.write(data[:8] + new + raw[len(text):] + data[8 + n:])


def load_transformer(tiny, folder):
    return WanTransformer3DModel.from_pretrained(os.path.join(tiny, folder), torch_dtype=torch.float32).eval()


def make_pipe(tiny, folder):
    tr = load_transformer(tiny, folder)
    return WanPipeline(tokenizer=None, text_encoder=None, vae=None, scheduler=None, transformer=tr)


def run_forward(tr, fwd, case):
    kw = dict(hidden_states=fwd[f"{case}.hidden_states"].clone(), timestep=fwd[f"{case}.timestep"].clone(),
              encoder_hidden_states=fwd[f"{case}.encoder_hidden_states"].clone(), return_dict=False)
    if f"{case}.encoder_hidden_states_image" in fwd:
        kw["encoder_hidden_states_image"] = fwd[f"{case}.encoder_hidden_states_image"].clone()
    with torch.no_grad():
        return tr(**kw)[0].clone()


def maxdiff(a, b):
    return (a.double() - b.double()).abs().max().item()


def make_adapter(tiny, folder, targets, seed):
    """add_adapter(LoraConfig) + seeded A, B (in parameter-name order) -> get_peft_model_state_dict
    (keys <module>.lora_A.weight / .lora_B.weight) and the adapter metadata (sets sorted)."""
    tr = load_transformer(tiny, folder)
    tr.add_adapter(LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, init_lora_weights="gaussian",
                              target_modules=targets))
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in tr.named_parameters():
            if ".lora_A." in name:
                p.copy_(STD_A * torch.randn(p.shape, generator=g, dtype=torch.float32))
            elif ".lora_B." in name:
                p.copy_(STD_B * torch.randn(p.shape, generator=g, dtype=torch.float32))
    layers = {k: v.clone() for k, v in get_peft_model_state_dict(tr).items()}
    meta = tr.peft_config["default"].to_dict()
    for k, v in list(meta.items()):
        if isinstance(v, set):
            meta[k] = sorted(v)
    return layers, meta


def to_original(layers, prefix, alpha_of, name_of):
    out = {}
    for k, v in layers.items():
        m, kind = k.rsplit(".lora_", 1)
        base = prefix + name_of(m)
        out[f"{base}.lora_{'down' if kind == 'A.weight' else 'up'}.weight"] = v
        a = alpha_of(m)
        if a is not None:
            out[f"{base}.alpha"] = torch.tensor(float(a), dtype=torch.float32)
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


def plain_forward(tiny, folder, base_sd, deltas, factor, fwd, case):
    tr = load_transformer(tiny, folder)
    sd = {k: v.clone() for k, v in base_sd.items()}
    for m, dlt in deltas.items():
        sd[m + ".weight"] = (sd[m + ".weight"].double() + factor * dlt).float()
    tr.load_state_dict(sd)
    return run_forward(tr, fwd, case)


def deltas_of(layers, scale_of):
    d = {}
    for k in layers:
        if k.endswith(".lora_A.weight"):
            m = k[:-len(".lora_A.weight")]
            d[m] = scale_of(m) * (layers[m + ".lora_B.weight"].double() @ layers[k].double())
    return d


def converter_probes():
    """WanPipeline.lora_state_dict on small hand-made dicts (rank 4 unless said)."""
    A, B = torch.ones(4, 32), torch.ones(32, 4)
    q = "blocks.0.self_attn.q"
    full_block = {}
    for o, _ in BLOCK_MAP:
        if "img" in o:
            continue
        kn = f"lora_unet_blocks_0_{o.replace('.', '_')}"
        full_block.update({f"{kn}.lora_down.weight": A, f"{kn}.lora_up.weight": B, f"{kn}.alpha": torch.tensor(8.0)})
    probes = {
        "comfyui_no_alpha": {f"diffusion_model.{q}.lora_down.weight": A, f"diffusion_model.{q}.lora_up.weight": B},
        "comfyui_alpha1_rank4": {f"diffusion_model.{q}.lora_down.weight": A,
                                 f"diffusion_model.{q}.lora_up.weight": B,
                                 f"diffusion_model.{q}.alpha": torch.tensor(1.0)},
        "comfyui_alpha3_rank4": {f"diffusion_model.{q}.lora_down.weight": A,
                                 f"diffusion_model.{q}.lora_up.weight": B,
                                 f"diffusion_model.{q}.alpha": torch.tensor(3.0)},
        "comfyui_lora_A_B_names_with_alpha": {f"diffusion_model.{q}.lora_A.weight": A,
                                              f"diffusion_model.{q}.lora_B.weight": B,
                                              f"diffusion_model.{q}.alpha": torch.tensor(8.0)},
        "comfyui_diff_b_bias": {f"diffusion_model.{q}.lora_down.weight": A,
                                f"diffusion_model.{q}.lora_up.weight": B,
                                f"diffusion_model.{q}.diff_b": torch.ones(32)},
        "comfyui_alpha_on_text_embedding": {
            f"diffusion_model.{q}.lora_down.weight": A, f"diffusion_model.{q}.lora_up.weight": B,
            "diffusion_model.text_embedding.0.lora_down.weight": A,
            "diffusion_model.text_embedding.0.lora_up.weight": B,
            "diffusion_model.text_embedding.0.alpha": torch.tensor(8.0)},
        "comfyui_alpha_on_head": {
            f"diffusion_model.{q}.lora_down.weight": A, f"diffusion_model.{q}.lora_up.weight": B,
            "diffusion_model.head.head.lora_down.weight": A,
            "diffusion_model.head.head.lora_up.weight": torch.ones(64, 4),
            "diffusion_model.head.head.alpha": torch.tensor(8.0)},
        "comfyui_top_level_only_no_blocks": {
            "diffusion_model.head.head.lora_down.weight": A,
            "diffusion_model.head.head.lora_up.weight": torch.ones(64, 4)},
        "comfyui_unknown_module": {f"diffusion_model.{q}.lora_down.weight": A,
                                   f"diffusion_model.{q}.lora_up.weight": B,
                                   "diffusion_model.patch_embedding.lora_down.weight": A,
                                   "diffusion_model.patch_embedding.lora_up.weight": B},
        "kohya_full_block_alpha8": full_block,
        "kohya_no_alpha": {k: v for k, v in full_block.items() if not k.endswith(".alpha")},
        "kohya_one_module_only": {f"lora_unet_blocks_0_self_attn_q.lora_down.weight": A,
                                  f"lora_unet_blocks_0_self_attn_q.lora_up.weight": B,
                                  f"lora_unet_blocks_0_self_attn_q.alpha": torch.tensor(8.0)},
        "kohya_with_img_emb": dict(full_block, **{"lora_unet_img_emb_proj_1.lora_down.weight": A,
                                                  "lora_unet_img_emb_proj_1.lora_up.weight": B,
                                                  "lora_unet_img_emb_proj_1.alpha": torch.tensor(8.0)}),
    }
    res = {}
    for name, sd in probes.items():
        entry = {"input_keys": sorted(sd)}
        try:
            out = WanPipeline.lora_state_dict({k: v.clone() for k, v in sd.items()})
            conv = {}
            for k, v in sorted(out.items()):
                e = {"shape": list(v.shape)}
                if v.dim() == 2 and k.endswith((".lora_A.weight", ".lora_B.weight")):
                    u = v.unique().tolist()
                    e["factor"] = u[0] if len(u) == 1 else u
                conv[k] = e
            entry["converted"] = conv
        except Exception as e:  # noqa: BLE001
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        res[name] = entry
    return res


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    here = os.path.dirname(os.path.abspath(__file__))
    tiny = os.path.join(here, "tiny_wan")
    root = os.path.join(out, "lora")
    os.makedirs(root, exist_ok=True)
    fwd = load_file(os.path.join(tiny, "forward.safetensors"))
    base_sd = {f: {k: v.clone() for k, v in load_transformer(tiny, f).state_dict().items()}
               for f in ("transformer", "transformer_i2v")}

    # ---- the files ------------------------------------------------------------------------------
    t2v, t2v_meta = make_adapter(tiny, "transformer", BLOCK_TARGETS, SEED_T2V)
    WanPipeline.save_lora_weights(root, transformer_lora_layers=t2v, transformer_lora_adapter_metadata=t2v_meta,
                                  weight_name="diffusers.safetensors")
    sort_header_metadata(os.path.join(root, "diffusers.safetensors"))
    save_st(to_original(t2v, "diffusion_model.", lambda m: ALPHA, original_name),
            os.path.join(root, "comfyui.safetensors"), None)
    save_st(to_original(t2v, "", lambda m: ALPHA, kohya_name), os.path.join(root, "kohya.safetensors"),
            {"format": "pt"})
    i2v, _ = make_adapter(tiny, "transformer_i2v", BLOCK_TARGETS + I2V_EXTRA_TARGETS, SEED_I2V)
    save_st(to_original(i2v, "diffusion_model.", lambda m: ALPHA if m.startswith("blocks.") else None,
                        original_name), os.path.join(root, "comfyui_i2v.safetensors"), None)

    paths = {f: os.path.join(root, f + ".safetensors") for f in ("diffusers", "comfyui", "kohya", "comfyui_i2v")}
    raw_d = load_file(paths["diffusers"])
    assert sorted(raw_d) == sorted("transformer." + k for k in t2v)
    assert all(torch.equal(raw_d["transformer." + k], v) for k, v in t2v.items())

    # the scale each module ends up with (alpha / r; the I2V file's non-block modules: no alpha -> 1)
    s_t2v = lambda m: S  # noqa: E731
    s_i2v = lambda m: S if m.startswith("blocks.") else 1.0  # noqa: E731
    # PEFT's scaling after loading: diffusers keeps alpha in the config; the original layouts have
    # alpha / r folded into lora_A by the converter, and PEFT gets alpha = r
    peft_scaling = {"diffusers": [S], "comfyui": [1.0], "kohya": [1.0], "comfyui_i2v": [1.0]}

    cases = {"diffusers_version": diffusers.__version__, "peft_version": peft.__version__,
             "rank": R, "alpha": ALPHA, "std_a": STD_A, "std_b": STD_B,
             "mapping_original_to_diffusers": {
                 "blocks": {f"blocks.N.{o}": f"blocks.N.{d}" for o, d in BLOCK_MAP},
                 "top_level": {o: d for o, d in TOP_MAP}},
             "files": {}, "entries": {}}

    # ---- lora_state_dict: the conversion ------------------------------------------------------
    for f, p in paths.items():
        keys, header = describe_file(p)
        sd, meta = WanPipeline.lora_state_dict(p, return_lora_metadata=True)
        info = {"keys": keys, "header_metadata": header,
                "lora_state_dict": {"metadata_returned": meta,
                                    "keys": {k: list(v.shape) for k, v in sorted(sd.items())}}}
        if f in ("comfyui", "kohya"):
            assert sorted(sd) == sorted(raw_d) and meta is None, f
            fac = set()
            for k in sd:
                if k.endswith(".lora_A.weight"):
                    kb = k.replace(".lora_A.", ".lora_B.")
                    fa, fb = (sd[k] / raw_d[k]).unique().tolist(), (sd[kb] / raw_d[kb]).unique().tolist()
                    assert len(fa) == 1 and len(fb) == 1
                    fac.add((fa[0], fb[0]))
                    assert torch.equal(sd[kb] @ sd[k], S * (raw_d[kb] @ raw_d[k])), k
            (fa, fb), = fac
            info["lora_state_dict"].update({"lora_A_factor": fa, "lora_B_factor": fb})
            print(f"{f}: lora_state_dict -> diffusers keys, lora_A x {fa}, lora_B x {fb}")
        elif f == "comfyui_i2v":
            assert sorted(sd) == sorted("transformer." + k for k in i2v) and meta is None
            facs = {}
            for k in sd:
                m = k[len("transformer."):].rsplit(".lora_", 1)[0]
                fct = (sd[k] / i2v[k[len("transformer."):]]).unique().tolist()
                assert len(fct) == 1
                want = (S if m.startswith("blocks.") and ".lora_A." in k else 1.0)
                assert fct[0] == want, (k, fct)
                facs[k] = fct[0]
            info["lora_state_dict"]["factors"] = facs
        else:
            assert sorted(sd) == sorted(raw_d) and meta is not None
            assert all(torch.equal(sd[k], raw_d[k]) for k in sd)
        cases["files"][f] = info

    # ---- references -----------------------------------------------------------------------------
    exp = {}
    for folder, case in (("transformer", "t2v_f5"), ("transformer_i2v", "i2v")):
        y = run_forward(make_pipe(tiny, folder).transformer, fwd, case)
        assert torch.equal(y, fwd[f"{case}.out"]), case
        exp[f"base.{case}.out"] = y
        cases["entries"][f"base.{case}.out"] = {"file": None, "transformer": folder, "forward_case": case,
                                                "fused": False, "lora_scale": None}
    print("base outputs equal tiny_wan/forward.safetensors t2v_f5.out / i2v.out")

    runs = [  # name, file, transformer, case, fuse scale, module -> s, adapter layers (A, B of file)
        ("diffusers", "diffusers", "transformer", "t2v_f5", 1.0, s_t2v, t2v),
        ("diffusers_scale0.5", "diffusers", "transformer", "t2v_f5", HALF, s_t2v, t2v),
        ("comfyui", "comfyui", "transformer", "t2v_f5", 1.0, s_t2v, t2v),
        ("kohya", "kohya", "transformer", "t2v_f5", 1.0, s_t2v, t2v),
        ("comfyui_i2v", "comfyui_i2v", "transformer_i2v", "i2v", 1.0, s_i2v, i2v),
        # a T2V LoRA on the I2V transformer: _maybe_expand_t2v_lora_for_i2v adds zero add_k / add_v
        ("diffusers_on_i2v", "diffusers", "transformer_i2v", "i2v", 1.0, s_t2v, t2v),
    ]
    for name, f, folder, case, scale, s_of, layers in runs:
        pipe = make_pipe(tiny, folder)
        pipe.load_lora_weights(paths[f])
        tr = pipe.transformer
        (adapter,) = list(tr.peft_config)
        pc = tr.peft_config[adapter]
        targets = lora_modules(tr)
        scalings = lora_scalings(tr)
        assert scalings == peft_scaling[f], (name, scalings)
        deltas = deltas_of(layers, s_of)
        want_targets = sorted(deltas)
        if name == "diffusers_on_i2v":
            want_targets = sorted(want_targets + [f"blocks.{i}.attn2.add_{c}_proj" for i in range(2) for c in "kv"])
        assert targets == want_targets, (name, targets)
        y_unfused = run_forward(tr, fwd, case)
        pipe.fuse_lora(lora_scale=scale)
        y = run_forward(tr, fwd, case)
        fsd = {k.replace(".base_layer.", "."): v.clone() for k, v in tr.state_dict().items() if ".lora_" not in k}
        bsd = base_sd[folder]
        assert sorted(fsd) == sorted(bsd)
        changed = sorted(k for k in fsd if not torch.equal(fsd[k], bsd[k]))
        assert changed == sorted(m + ".weight" for m in deltas), (name, changed)
        worst_w = max((fsd[m + ".weight"].double() - (bsd[m + ".weight"].double() + scale * d)).abs().max().item()
                      for m, d in deltas.items())
        assert worst_w < 1e-6, (name, worst_w)
        y_plain = plain_forward(tiny, folder, bsd, deltas, scale, fwd, case)
        d_plain = maxdiff(y, y_plain)
        assert d_plain < 2e-5, (name, d_plain)
        key = f"{name}.{case}.out"
        exp[key] = y
        cases["entries"][key] = {"file": f + ".safetensors", "transformer": folder, "forward_case": case,
                                 "fused": True, "lora_scale": scale}
        info = {"adapter_name": adapter, "peft_r": pc.r, "peft_lora_alpha": pc.lora_alpha,
                "rank_pattern": pc.rank_pattern, "alpha_pattern": pc.alpha_pattern, "peft_scaling": scalings,
                "targets": targets, "fused_params": changed,
                "max_abs_diff": {"out_vs_base": maxdiff(y, exp[f"base.{case}.out"]),
                                 "max_abs_base": exp[f"base.{case}.out"].abs().max().item(),
                                 "check_out_vs_plain_W_plus_scale_s_BA": d_plain,
                                 "check_fused_W_vs_W_plus_scale_s_BA": worst_w}}
        if scale == 1.0:
            ukey = f"{name}.{case}.unfused_out"
            exp[ukey] = y_unfused
            cases["entries"][ukey] = {"file": f + ".safetensors", "transformer": folder, "forward_case": case,
                                      "fused": False, "lora_scale": 1.0}
            d_uf = maxdiff(y_unfused, y)
            assert d_uf < 2e-5, (name, d_uf)
            info["max_abs_diff"]["unfused_vs_fused"] = d_uf
        if name in ("comfyui", "kohya"):
            assert torch.equal(y, exp["diffusers.t2v_f5.out"]), name
            info["fused_out_bitwise_equal_to_diffusers"] = True
            info["unfused_out_bitwise_equal_to_diffusers"] = torch.equal(y_unfused, exp["diffusers.t2v_f5.unfused_out"])
            info["max_abs_diff"]["unfused_vs_diffusers_unfused"] = maxdiff(y_unfused, exp["diffusers.t2v_f5.unfused_out"])
        cases.setdefault("runs", {})[name] = info
        print(f"{name}: {len(targets)} targets, r {pc.r} alpha {pc.lora_alpha} scaling {scalings}, fuse {scale}; "
              f"|out - base| {info['max_abs_diff']['out_vs_base']:.4f}; vs plain {d_plain:.1e}, W {worst_w:.1e}")

    cases["converter_probes"] = converter_probes()
    for n, e in cases["converter_probes"].items():
        print(f"probe {n}: " + (e["error"][:100] if "error" in e else
                                ", ".join(f"{k.split('transformer.')[-1]} x{v.get('factor')}"
                                          for k, v in e["converted"].items())[:160]))
    save_st(exp, os.path.join(root, "expected.safetensors"), {"format": "pt"})
    with open(os.path.join(root, "cases.json"), "w") as fh:
        fh.write(json.dumps(cases, indent=2, sort_keys=True) + "\n")
    print(f"wrote {root}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_lora.py OUT_DIR  (writes OUT_DIR/lora)")
    main(sys.argv[1])
