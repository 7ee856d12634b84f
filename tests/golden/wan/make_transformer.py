#!/usr/bin/env python3
"""Makes tests/golden/wan/tiny_wan/{transformer, transformer_i2v, transformer_ti2v}/ (tiny
WanTransformer3DModel folders in the Wan 2.1 T2V, Wan 2.1 I2V and Wan 2.2 TI2V-5B layouts) and
tiny_wan/forward.safetensors + forward.json (references of WanTransformer3DModel.forward).

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 at ../shared/refstack2/src):
    OMP_NUM_THREADS=1 ../shared/refstack2/run python3 tests/golden/wan/make_transformer.py tests/golden/wan
Re-running writes byte-identical files (float32 on one CPU thread; weights written by Diffusers'
own save_pretrained; the references by safetensors' save_file with sorted keys and the single
metadata entry {"format": "pt"}; JSON with sorted keys).

Everything is Diffusers' code run unmodified: each model is built from its config, every parameter
is overwritten with seeded random values (Diffusers leaves the LayerNorm / RMSNorm weights at one,
biases at zero and draws scale_shift_table from the global RNG; seeded non-trivial values make
every path count), saved with save_pretrained and loaded back with from_pretrained before any
reference is computed. Hooks only observe.

Checks (the files do not depend on them): an independent float64 formulation from the state dict
(ref_forward, the semantics of README.md) matches every float32 case; each sample of the batch-2
case run alone equals the batched output; the per-token-timestep case with one value everywhere
equals the [B] timestep case.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

# refstack2 has only a stub of transformers; see ../qwen_image/make_transformer.py. Nothing here
# needs diffusers.loaders' transformers paths, but importing diffusers the same way keeps the
# environment identical to the other fixture scripts.
import diffusers.utils.import_utils as _iu  # noqa: E402
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"

import diffusers  # noqa: E402
from diffusers import WanTransformer3DModel  # noqa: E402

# Wan 2.1 T2V layout (real 1.3B: 12 heads x 128, ffn 8960, 30 layers, text_dim 4096, freq_dim 256)
# narrowed: 2 heads x 16 = inner 32. attention_head_dim 16 gives the RoPE split
# h = w = 2 * (16 // 6) = 4 and t = 16 - 8 = 8 (real 128: 42, 42, 44).
T2V = dict(
    patch_size=[1, 2, 2], num_attention_heads=2, attention_head_dim=16, in_channels=16,
    out_channels=16, text_dim=32, freq_dim=32, ffn_dim=64, num_layers=2, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None,
    rope_max_seq_len=1024, pos_embed_seq_len=None,
)
# Wan 2.1 I2V layout: in_channels 16 noise + 4 mask + 16 condition latents = 36, CLIP ViT-H
# penultimate features (real 1280, here 48) through condition_embedder.image_embedder, and the
# added K/V projections in every cross-attention (real added_kv_proj_dim = inner dim 5120).
I2V = dict(T2V, in_channels=36, image_dim=48, added_kv_proj_dim=32)
# Wan 2.2 TI2V-5B layout: 48-channel latents of the 2.2 VAE, no image branch.
TI2V = dict(T2V, in_channels=48, out_channels=48)

FOLDERS = {"transformer": T2V, "transformer_i2v": I2V, "transformer_ti2v": TI2V}
SEEDS = {"transformer": 20270101, "transformer_i2v": 20270102, "transformer_ti2v": 20270103}
SEED_INPUTS = 71
STD = 0.1  # linear / conv weights and every bias
NORM_STD = 0.05  # norm weights 1 + NORM_STD randn
TABLE_STD = 0.2  # scale_shift_table (Diffusers: randn / sqrt(dim) = 0.18 here)


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    norm_weights = set()
    for mname, m in model.named_modules():
        if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm)) and m.weight is not None:
            norm_weights.add(f"{mname}.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name in norm_weights:
                p.copy_(1.0 + NORM_STD * r)
            elif name.endswith("scale_shift_table"):
                p.copy_(TABLE_STD * r)
            else:
                p.copy_(STD * r)


def save_st(tensors, path):
    save_file({k: tensors[k].detach().float().clone().contiguous() for k in sorted(tensors)}, path,
              metadata={"format": "pt"})


def maxdiff(a, b):
    return (a.double() - b.double()).abs().max().item()


# ---- forward cases ------------------------------------------------------------------------------
# folder, B, C, F, H, W (latent sizes; H, W even for the 1x2x2 patch), S text tokens, timesteps
# (the scheduler's t in [0, 1000], float32), image tokens (I2V), per-token timestep rule.
CASES = {
    # one latent frame (an image), 2 x 3 patches
    "t2v_f1": dict(folder="transformer", B=1, F=1, H=4, W=6, S=8, t=[999.0]),
    # 5 latent frames, H 6 / W 10: 3 x 5 patches (odd patch counts), 75 tokens
    "t2v_f5": dict(folder="transformer", B=1, F=5, H=6, W=10, S=8, t=[500.0]),
    # batch 2 with different timesteps (one fractional)
    "t2v_b2": dict(folder="transformer", B=2, F=2, H=4, W=4, S=6, t=[900.0, 137.5]),
    # I2V: the text must be 512 tokens (the processor splits the image tokens off as the first
    # S_total - 512; see README), image context 257 tokens of width image_dim
    "i2v": dict(folder="transformer_i2v", B=1, F=2, H=4, W=6, S=512, t=[700.0], img=257),
    # Wan 2.2 TI2V-5B, one timestep per sample
    "ti2v": dict(folder="transformer_ti2v", B=1, F=3, H=4, W=6, S=8, t=[600.0]),
    # the same inputs, per-token timestep [B, F * H/2 * W/2] as the pipelines build it with
    # expand_timesteps: first latent frame's tokens t = 0 (the I2V condition frame), the rest t
    "ti2v_tokens": dict(folder="transformer_ti2v", B=1, F=3, H=4, W=6, S=8, t=[600.0],
                        per_token="first_frame_zero", same_inputs_as="ti2v"),
    # batch 2 per-token: sample 0 first-frame-zero, sample 1 all 250 (distinct rows)
    "ti2v_tokens_b2": dict(folder="transformer_ti2v", B=2, F=2, H=4, W=4, S=5, t=[800.0, 250.0],
                           per_token="b2_mixed"),
    # bfloat16 as from_pretrained(torch_dtype=bfloat16) loads it (_keep_in_fp32_modules stay
    # float32: rope, time_embedder, scale_shift_table, norm1/2/3), inputs of t2v_f5 rounded to bf16
    "t2v_bf16": dict(folder="transformer", B=1, F=5, H=6, W=10, S=8, t=[500.0], dtype="bf16_load",
                     same_inputs_as="t2v_f5"),
    # bfloat16 by model.to(torch.bfloat16): EVERYTHING bf16, the RoPE cos/sin buffers included
    "t2v_bf16_to": dict(folder="transformer", B=1, F=5, H=6, W=10, S=8, t=[500.0], dtype="bf16_to",
                        same_inputs_as="t2v_f5"),
}
INTER_CASES = ("t2v_f5", "i2v", "ti2v_tokens")


def make_inputs(name, case, cfg, g, made):
    if "same_inputs_as" in case:
        src = made[case["same_inputs_as"]]
        x, ctx, img = src["hidden_states"], src["encoder_hidden_states"], src.get("encoder_hidden_states_image")
    else:
        x = torch.randn((case["B"], cfg["in_channels"], case["F"], case["H"], case["W"]), generator=g)
        ctx = torch.randn((case["B"], case["S"], cfg["text_dim"]), generator=g)
        img = torch.randn((case["B"], case["img"], cfg["image_dim"]), generator=g) if "img" in case else None
    B, Fr, H, W = case["B"], case["F"], case["H"], case["W"]
    t = torch.tensor(case["t"], dtype=torch.float32)
    rule = case.get("per_token")
    if rule is not None:
        n_tok = Fr * (H // 2) * (W // 2)
        per_frame = (H // 2) * (W // 2)
        ts = t[:, None].expand(B, n_tok).clone()
        if rule == "first_frame_zero":
            ts[:, :per_frame] = 0.0
        elif rule == "b2_mixed":
            ts[0, :per_frame] = 0.0
        t = ts
    out = {"hidden_states": x, "encoder_hidden_states": ctx, "timestep": t}
    if img is not None:
        out["encoder_hidden_states_image"] = img
    return out


def run_model(model, inp, dtype):
    kw = dict(hidden_states=inp["hidden_states"].to(dtype), timestep=inp["timestep"].clone(),
              encoder_hidden_states=inp["encoder_hidden_states"].to(dtype), return_dict=False)
    if "encoder_hidden_states_image" in inp:
        kw["encoder_hidden_states_image"] = inp["encoder_hidden_states_image"].to(dtype)
    with torch.no_grad():
        return model(**kw)[0]


def capture(model, prefix, store):
    hs = []

    def hook(name, pick=None):
        def f(mod, args, out):
            o = out if pick is None else pick(out)
            store[f"{prefix}.{name}"] = o.detach().float().clone()
        return f

    def rope_hook(mod, args, out):
        store[f"{prefix}.rope_cos"] = out[0].float().clone()
        store[f"{prefix}.rope_sin"] = out[1].float().clone()

    def cond_hook(mod, args, out):
        temb, tproj, ctx, img = out
        store[f"{prefix}.temb"] = temb.float().clone()
        store[f"{prefix}.timestep_proj"] = tproj.float().clone()
        store[f"{prefix}.text_embedded"] = ctx.float().clone()
        if img is not None:
            store[f"{prefix}.image_embedded"] = img.float().clone()

    hs.append(model.rope.register_forward_hook(rope_hook))
    hs.append(model.condition_embedder.register_forward_hook(cond_hook))
    hs.append(model.patch_embedding.register_forward_hook(hook("patch_embedding")))
    for i, blk in enumerate(model.blocks):
        hs.append(blk.register_forward_hook(hook(f"block{i}.out")))
    hs.append(model.proj_out.register_forward_hook(hook("proj_out")))
    return lambda: [h.remove() for h in hs]


# ---- independent float64 formulation (a check; the files do not depend on it) -------------------

def ref_forward(w, cfg, x, t, ctx, img=None):
    """One sample in float64 from the state dict: x [C, F, H, W], t scalar or [N], ctx [S, text_dim],
    img [257, image_dim] or None -> [C_out, F, H, W]."""
    w = {k: v.double() for k, v in w.items()}
    NH, HD = cfg["num_attention_heads"], cfg["attention_head_dim"]
    D, eps = NH * HD, cfg["eps"]
    C, Fr, H, W = x.shape
    f, h, wd = Fr, H // 2, W // 2
    N = f * h * wd

    def lin(v, n):
        return v @ w[n + ".weight"].T + w[n + ".bias"]

    def ln(v, n=None, e=eps):
        return F.layer_norm(v, (v.shape[-1],), None if n is None else w[n + ".weight"],
                            None if n is None else w[n + ".bias"], e)

    def rms(v, n):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * w[n + ".weight"]

    def gelu_tanh(v):
        return F.gelu(v, approximate="tanh")

    # patchify: token (fi, hi, wi) f-major, channel vector of patch (c, ph, pw) c-major
    xp = x.double().reshape(C, f, 1, h, 2, wd, 2).permute(1, 3, 5, 0, 2, 4, 6).reshape(N, C * 4)
    tok = xp @ w["patch_embedding.weight"].reshape(D, C * 4).T + w["patch_embedding.bias"]

    # time: sinusoid of float32 t (cos first), two linears, 6 modulation vectors
    half = cfg["freq_dim"] // 2
    fr = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    tv = torch.as_tensor(t, dtype=torch.float32).reshape(-1)
    arg = (tv[:, None] * fr[None]).double()
    e = torch.cat([torch.cos(arg), torch.sin(arg)], -1)  # [T, freq_dim], T = 1 or N
    p = "condition_embedder."
    temb = lin(F.silu(lin(e, p + "time_embedder.linear_1")), p + "time_embedder.linear_2")  # [T, D]
    tproj = lin(F.silu(temb), p + "time_proj").reshape(-1, 6, D)  # [T, 6, D]

    c = lin(gelu_tanh(lin(ctx.double(), p + "text_embedder.linear_1")), p + "text_embedder.linear_2")
    if img is not None:
        q = ln(img.double(), p + "image_embedder.norm1", 1e-5)
        q = lin(F.gelu(lin(q, p + "image_embedder.ff.net.0.proj")), p + "image_embedder.ff.net.2")
        ci = ln(q, p + "image_embedder.norm2", 1e-5)

    # RoPE: per axis dims (t, h, w) = (HD - 2*2*(HD//6)... ), pairs (2j, 2j+1) rotated
    hdim = 2 * (HD // 6)
    tdim = HD - 2 * hdim
    ang = []
    for (ax, d) in ((0, tdim), (1, hdim), (2, hdim)):
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang.append(inv)
    pos = torch.stack(torch.meshgrid(torch.arange(f), torch.arange(h), torch.arange(wd), indexing="ij"), -1)
    pos = pos.reshape(N, 3).double()
    angles = torch.cat([pos[:, a:a + 1] * ang[a][None] for a in range(3)], -1)  # [N, HD/2]
    # the frequency table is float64, cos / sin rounded to float32 (as the buffers hold them)
    cos, sin = torch.cos(angles).float().double(), torch.sin(angles).float().double()

    def rope(v):  # v [N, NH, HD]
        ev, od = v[..., 0::2], v[..., 1::2]
        out = torch.empty_like(v)
        out[..., 0::2] = ev * cos[:, None] - od * sin[:, None]
        out[..., 1::2] = ev * sin[:, None] + od * cos[:, None]
        return out

    def attn(q, k, v):  # [L, NH, HD], [S, NH, HD]
        s = torch.einsum("lhd,shd->hls", q, k) / math.sqrt(HD)
        return torch.einsum("hls,shd->lhd", s.softmax(-1), v).reshape(q.shape[0], D)

    hcur = tok
    for b in range(cfg["num_layers"]):
        pb = f"blocks.{b}."
        mod = w[pb + "scale_shift_table"] + tproj  # [T, 6, D] (T = 1 broadcasts over tokens)
        sh1, sc1, g1, sh2, sc2, g2 = [mod[:, i] for i in range(6)]
        a = ln(hcur) * (1 + sc1) + sh1
        q = rope(rms(lin(a, pb + "attn1.to_q"), pb + "attn1.norm_q").reshape(N, NH, HD))
        k = rope(rms(lin(a, pb + "attn1.to_k"), pb + "attn1.norm_k").reshape(N, NH, HD))
        v = lin(a, pb + "attn1.to_v").reshape(N, NH, HD)
        hcur = hcur + lin(attn(q, k, v), pb + "attn1.to_out.0") * g1
        a = ln(hcur, pb + "norm2") if cfg["cross_attn_norm"] else hcur
        q = rms(lin(a, pb + "attn2.to_q"), pb + "attn2.norm_q").reshape(N, NH, HD)
        k = rms(lin(c, pb + "attn2.to_k"), pb + "attn2.norm_k").reshape(-1, NH, HD)
        v = lin(c, pb + "attn2.to_v").reshape(-1, NH, HD)
        o = attn(q, k, v)
        if img is not None:
            ki = rms(lin(ci, pb + "attn2.add_k_proj"), pb + "attn2.norm_added_k").reshape(-1, NH, HD)
            vi = lin(ci, pb + "attn2.add_v_proj").reshape(-1, NH, HD)
            o = o + attn(q, ki, vi)
        hcur = hcur + lin(o, pb + "attn2.to_out.0")
        a = ln(hcur) * (1 + sc2) + sh2
        ff = lin(gelu_tanh(lin(a, pb + "ffn.net.0.proj")), pb + "ffn.net.2")
        hcur = hcur + ff * g2
    mod = w["scale_shift_table"] + temb[:, None]  # [T, 2, D]: shift, scale (temb, not tproj)
    hcur = ln(hcur) * (1 + mod[:, 1]) + mod[:, 0]
    o = lin(hcur, "proj_out")  # [N, Cout * 4] ordered (pt, ph, pw, c): c fastest
    Co = cfg["out_channels"]
    return o.reshape(f, h, wd, 1, 2, 2, Co).permute(6, 0, 3, 1, 4, 2, 5).reshape(Co, Fr, H, W)


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    root = os.path.join(out, "tiny_wan")
    os.makedirs(root, exist_ok=True)
    for folder, cfg in FOLDERS.items():
        torch.manual_seed(0)  # Diffusers' scale_shift_table init draws from the global RNG
        m = WanTransformer3DModel(**cfg)
        randomize(m, SEEDS[folder])
        m.save_pretrained(os.path.join(root, folder))
        print(f"{folder}: {sum(p.numel() for p in m.parameters())} parameters")

    models = {f: WanTransformer3DModel.from_pretrained(os.path.join(root, f)).eval() for f in FOLDERS}
    sds = {f: {k: v.clone() for k, v in m.state_dict().items()} for f, m in models.items()}
    g = torch.Generator().manual_seed(SEED_INPUTS)
    res, made, meta = {}, {}, {}
    for name, case in CASES.items():
        folder = case["folder"]
        cfg = FOLDERS[folder]
        inp = make_inputs(name, case, cfg, g, made)
        made[name] = inp
        dt = case.get("dtype")
        if dt == "bf16_load":
            model = WanTransformer3DModel.from_pretrained(os.path.join(root, folder),
                                                          torch_dtype=torch.bfloat16).eval()
            dtype = torch.bfloat16
        elif dt == "bf16_to":
            model = WanTransformer3DModel.from_pretrained(os.path.join(root, folder)).eval().to(torch.bfloat16)
            dtype = torch.bfloat16
        else:
            model, dtype = models[folder], torch.float32
        remove = capture(model, name + ".inter", res) if name in INTER_CASES else None
        y = run_model(model, inp, dtype)
        if remove:
            remove()
        for k, v in inp.items():
            res[f"{name}.{k}"] = v.to(dtype).float() if k != "timestep" else v
        res[f"{name}.out"] = y.float()
        meta[name] = dict(folder=folder, dtype={"bf16_load": "bfloat16 (from_pretrained torch_dtype)",
                                                "bf16_to": "bfloat16 (model.to)"}.get(dt, "float32"),
                          shapes={k: list(v.shape) for k, v in inp.items()}, out=list(y.shape),
                          timestep=case["t"], per_token=case.get("per_token"))
        # float64 check
        if dtype == torch.float32:
            d = 0.0
            for bi in range(case["B"]):
                tb = inp["timestep"][bi]
                r = ref_forward(sds[folder], cfg, inp["hidden_states"][bi], tb, inp["encoder_hidden_states"][bi],
                                inp["encoder_hidden_states_image"][bi] if "encoder_hidden_states_image" in inp else None)
                d = max(d, maxdiff(r, y[bi]))
            meta[name]["float64_check_maxdiff"] = float(f"{d:.3g}")
            print(f"{name}: out {tuple(y.shape)} |out| <= {y.abs().max().item():.3f}; float64 ref {d:.2e}")
            assert d < 2e-5, d
        else:
            d = maxdiff(y.float(), res["t2v_f5.out"])
            meta[name]["vs_float32_maxdiff"] = float(f"{d:.3g}")
            print(f"{name}: vs float32 t2v_f5 {d:.3e} (|out| <= {res['t2v_f5.out'].abs().max().item():.3f})")

    # consistency checks
    m = models["transformer"]
    inp = made["t2v_b2"]
    for bi in range(2):
        one = {k: v[bi:bi + 1] for k, v in inp.items()}
        d = maxdiff(run_model(m, one, torch.float32), res["t2v_b2.out"][bi:bi + 1])
        print(f"t2v_b2 sample {bi} alone vs batched {d:.1e}")
        assert d < 1e-5
    inp = dict(made["ti2v"])
    inp["timestep"] = inp["timestep"][:, None].expand(1, 3 * 2 * 3).clone()
    d = maxdiff(run_model(models["transformer_ti2v"], inp, torch.float32), res["ti2v.out"])
    print(f"ti2v: per-token timestep all t vs [B] timestep {d:.1e}")
    assert d < 1e-5
    d = maxdiff(res["ti2v.out"], res["ti2v_tokens.out"])
    print(f"ti2v_tokens differs from ti2v by {d:.3f} (first frame at t=0)")
    assert d > 1e-3

    path = os.path.join(root, "forward.safetensors")
    save_st(res, path)
    with open(os.path.join(root, "forward.json"), "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"cases": meta, "configs": FOLDERS, "seeds": dict(SEEDS, inputs=SEED_INPUTS)},
                            indent=2, sort_keys=True) + "\n")
    print(f"forward.safetensors: {len(res)} tensors, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
