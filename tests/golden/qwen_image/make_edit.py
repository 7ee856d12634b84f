#!/usr/bin/env python3
"""Makes tests/golden/qwen_image/edit/ (PIL resize references, the Qwen2.5-VL image processor and
vision tower, the text encoder with images) and tests/golden/qwen_image/tiny_qwen_image/edit_e2e.*
(Diffusers' QwenImageEditPipeline / QwenImageEditPlusPipeline end to end), for the Qwen-Image-Edit
family. Uses text_encoder/ (its `visual.*` weights), tokenizer/ and tiny_qwen_image/ (transformer,
vae, scheduler); re-making any of them means re-making this.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0, Pillow 11.1, numpy):
    ../shared/refstack2/run python3 tests/golden/qwen_image/make_edit.py tests/golden/qwen_image
Re-running writes byte-identical files (float32 on one CPU thread, fixed seeds, deterministic
algorithms, safetensors with sorted keys and the single metadata entry {"format": "pt"}, JSON with
sorted keys).

refstack2 has no transformers: the processor and the model are plain-torch / numpy transcriptions
of transformers' qwen2_vl/image_processing_qwen2_vl.py (the SLOW, PIL-based Qwen2VLImageProcessor),
image_transforms.py (resize / rescale / normalize), qwen2_5_vl/processing_qwen2_5_vl.py and
qwen2_5_vl/modeling_qwen2_5_vl.py (Qwen2_5_VisionTransformerPretrainedModel, Qwen2_5_VLModel.forward
with pixel_values, eager attention); the language model, get_rope_index and the BPE tokenizer are
make_text_encoder.py's and make_prompts.py's (imported). The pipelines are Diffusers' own,
unmodified, with duck-typed processor / text-encoder stand-ins built on the transcription.

Outputs (see README.md, "## Edit (make_edit.py)", for every key and the semantics):
  edit/resize_cases.safetensors + resize_cases.json      PIL Image.resize references (uint8 RGB)
  edit/vision_expected.safetensors + vision_cases.json   processor, vision tower, encoder with images
  tiny_qwen_image/edit_e2e.safetensors + edit_e2e.json   Edit / Edit Plus pipelines end to end

Checks (the outputs do not depend on them): a second, loop-based float64 formulation of the
processor's patch flattening (explicit per-patch index arithmetic), of the vision tower (tokens kept
in the ORIGINAL order, attention over an explicit key list of the same image / same window, RoPE by
explicit pair rotation, merger per group of 4) and of the language model with image embeddings
(make_text_encoder.loop_forward fed the float64 image embeddings); each image of a batch run alone
equals its rows; the encoder with no pixel_values equals make_text_encoder.text_forward exactly;
in the pipelines, the processor / text-encoder stand-ins saw exactly the texts, resized images and
ids recorded here, the transformer's first call got exactly the prompt embeddings, the noise
(randn with the case's seed) and the VAE latents of the resized images predicted here.
"""
import copy
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# make_prompts flips Diffusers' transformers-availability flag before diffusers.loaders is imported
import make_prompts  # noqa: E402
import make_text_encoder as mte  # noqa: E402
import diffusers  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import QwenImageEditPlusPipeline  # noqa: E402

# ---- Qwen-Image-Edit's processor/preprocessor_config.json (Qwen2VLImageProcessor) -----------------
MIN_PIXELS, MAX_PIXELS = 3136, 12845056
PATCH, MERGE, TEMPORAL = 14, 2, 2
FACTOR = PATCH * MERGE  # 28
MEAN = [0.48145466, 0.4578275, 0.40821073]  # OPENAI_CLIP_MEAN
STD = [0.26862954, 0.26130258, 0.27577711]  # OPENAI_CLIP_STD
RESCALE = 1 / 255
PROC_RESAMPLE = Image.Resampling.BICUBIC  # Qwen2VLImageProcessor's default resample (3)
IMAGE_PAD = "<|image_pad|>"
EDIT_DROP = make_prompts.EDIT_DROP_IDX  # 64


def jdump(obj):
    return make_prompts.compact_scalar_lists(
        json.dumps(obj, ensure_ascii=False, indent=2, sort_keys=True)) + "\n"


def write_json(path, obj):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(jdump(obj))


def write_st(path, tensors):
    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)}, path,
              metadata={"format": "pt"})


def u8(arr):
    return torch.from_numpy(np.ascontiguousarray(arr, dtype=np.uint8).copy())


# ---- test images --------------------------------------------------------------------------------

def random_image(w, h, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.int64).to(torch.uint8).numpy()


def gradient_image(w, h, phase=0.0):
    y, x = np.mgrid[0:h, 0:w].astype(np.float64)
    r = 255.0 * x / max(w - 1, 1)
    g = 255.0 * y / max(h - 1, 1)
    b = 127.5 + 127.5 * np.sin((x + y + phase) / 9.0)
    return np.clip(np.rint(np.stack([r, g, b], -1)), 0, 255).astype(np.uint8)


def textured_image(w, h, seed):
    """Gradient plus seeded noise (+-24): smooth structure with detail."""
    g = torch.Generator().manual_seed(seed)
    noise = torch.randint(-24, 25, (h, w, 3), generator=g, dtype=torch.int64).numpy()
    return np.clip(gradient_image(w, h, phase=seed % 17).astype(np.int64) + noise, 0, 255).astype(np.uint8)


# ==== 1. PIL resize references ===================================================================

RESIZE_SOURCES = {  # name -> (kind, w, h, seed)
    "rand_37x23": ("random", 37, 23, 3701),
    "grad_37x23": ("gradient", 37, 23, 0),
    "rand_100x60": ("random", 100, 60, 3702),
    "grad_100x60": ("gradient", 100, 60, 0),
    "rand_64x64": ("random", 64, 64, 3703),
    "grad_64x64": ("gradient", 64, 64, 0),
}
RESIZE_SHAPES = [  # (tag, source, dst w, dst h)
    ("down", "rand_100x60", 41, 27), ("down", "grad_100x60", 41, 27),
    ("down_strong", "rand_100x60", 13, 7),
    ("up", "rand_37x23", 64, 50), ("up", "grad_37x23", 64, 50),
    ("height_only", "rand_64x64", 64, 37), ("width_only", "grad_64x64", 23, 64),
    ("width1", "rand_100x60", 1, 60), ("height1", "grad_37x23", 37, 1),
    ("mixed", "rand_37x23", 80, 11),  # up in width, down in height
    ("identity", "rand_37x23", 37, 23),
]
RESIZE_FILTERS = {"lanczos": Image.Resampling.LANCZOS, "bicubic": Image.Resampling.BICUBIC}


def make_resize_cases(out_dir):
    srcs = {}
    for name, (kind, w, h, seed) in RESIZE_SOURCES.items():
        srcs[name] = random_image(w, h, seed) if kind == "random" else gradient_image(w, h)
    tensors, cases = {}, []
    for fname, filt in RESIZE_FILTERS.items():
        for tag, src, dw, dh in RESIZE_SHAPES:
            name = f"{fname}.{tag}_{src}_to_{dw}x{dh}"
            out = np.array(Image.fromarray(srcs[src], mode="RGB").resize((dw, dh), resample=filt))
            assert out.shape == (dh, dw, 3) and out.dtype == np.uint8
            if tag == "identity":
                assert np.array_equal(out, srcs[src])
            tensors[f"{name}.src"] = u8(srcs[src])
            tensors[f"{name}.out"] = u8(out)
            sh, sw = srcs[src].shape[:2]
            cases.append({"name": name, "filter": fname.upper(), "pil_resample": int(filt),
                          "source": src, "src_size_wh": [sw, sh], "dst_size_wh": [dw, dh],
                          "src_shape": [sh, sw, 3], "out_shape": [dh, dw, 3]})
    write_st(os.path.join(out_dir, "resize_cases.safetensors"), tensors)
    doc = {"call": "np.array(PIL.Image.fromarray(src, mode='RGB').resize((w, h), resample=filter)) "
                   "with box None and reducing_gap None (Pillow's defaults; what transformers' "
                   "image_transforms.resize and Diffusers' VaeImageProcessor.resize call)",
           "pillow_version": Image.__version__ if hasattr(Image, "__version__") else None,
           "sources": {k: {"kind": v[0], "size_wh": [v[1], v[2]], "seed": v[3]}
                       for k, v in RESIZE_SOURCES.items()},
           "source_note": "random: torch.randint(0, 256, (h, w, 3), generator="
                          "torch.Generator().manual_seed(seed)); gradient: r = 255 x / (w - 1), "
                          "g = 255 y / (h - 1), b = 127.5 + 127.5 sin((x + y) / 9), rounded "
                          "(the tensors are stored, regenerate nothing)",
           "keys": "<name>.src uint8 [H, W, 3], <name>.out uint8 [h, w, 3]",
           "cases": cases}
    write_json(os.path.join(out_dir, "resize_cases.json"), doc)
    print(f"resize: {len(cases)} cases")
    return len(cases)


# ==== 2a. Qwen2VLImageProcessor (slow, PIL) ======================================================

def smart_resize(height, width, factor=FACTOR, min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS):
    """image_processing_qwen2_vl.smart_resize (Python round: half to even)."""
    if max(height, width) / min(height, width) > 200:
        raise ValueError("absolute aspect ratio must be smaller than 200")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def process_one(img):
    """Qwen2VLImageProcessor._preprocess for ONE image (PIL or uint8 HWC array) ->
    (flatten_patches float32 [grid_h * grid_w, 1176], (1, grid_h, grid_w), resized uint8 HWC)."""
    if isinstance(img, Image.Image):
        img = img.convert("RGB")  # do_convert_rgb (a no-op on RGB)
        arr = np.array(img)
    else:
        arr = np.asarray(img)
    assert arr.dtype == np.uint8 and arr.ndim == 3 and arr.shape[2] == 3
    height, width = arr.shape[:2]
    rh, rw = smart_resize(height, width)
    # image_transforms.resize: uint8 -> PIL (no rescale), PIL resize((w, h), BICUBIC), back to uint8.
    # Pillow returns a copy when the size does not change.
    resized = np.array(Image.fromarray(arr, mode="RGB").resize((rw, rh), resample=PROC_RESAMPLE))
    # rescale: float64 multiply by 1/255, then cast to float32
    x = (resized.astype(np.float64) * RESCALE).astype(np.float32)
    # normalize (channels last): (x - mean) / std with mean / std as float32 arrays
    x = (x - np.array(MEAN, dtype=np.float32)) / np.array(STD, dtype=np.float32)
    x = x.transpose(2, 0, 1)  # to ChannelDimension.FIRST
    patches = torch.from_numpy(np.array([x]))
    patches = patches.expand(TEMPORAL, -1, -1, -1)  # one frame tiled to temporal_patch_size
    c = patches.size(1)
    gt, gh, gw = patches.size(0) // TEMPORAL, rh // PATCH, rw // PATCH
    flat = (patches.reshape(gt, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
            .permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
            .reshape(gt * gh * gw, c * TEMPORAL * PATCH * PATCH))
    return flat.contiguous(), (gt, gh, gw), resized


def image_processor(images):
    """Qwen2VLImageProcessor.preprocess(images): each image on its own, rows concatenated."""
    pv, grids, resized = [], [], []
    for img in images:
        p, g, r = process_one(img)
        pv.append(p)
        grids.append(g)
        resized.append(r)
    return torch.cat(pv, 0), torch.tensor(grids, dtype=torch.int64), resized


def loop_patchify(resized, grid):
    """Second formulation: float64 normalisation and explicit index arithmetic per patch / value."""
    _, gh, gw = grid
    mean, std = np.array(MEAN), np.array(STD)
    img = (resized.astype(np.float64) / 255.0 - mean) / std  # [H, W, 3]
    out = np.zeros((gh * gw, 3 * TEMPORAL * PATCH * PATCH))
    row = 0
    for bh in range(gh // MERGE):
        for bw in range(gw // MERGE):
            for mh in range(MERGE):
                for mw in range(MERGE):
                    y0, x0 = (bh * MERGE + mh) * PATCH, (bw * MERGE + mw) * PATCH
                    for c in range(3):
                        for t in range(TEMPORAL):  # both frames are the image
                            base = (c * TEMPORAL + t) * PATCH * PATCH
                            block = img[y0:y0 + PATCH, x0:x0 + PATCH, c]
                            out[row, base:base + PATCH * PATCH] = block.reshape(-1)  # py, px
                    row += 1
    return torch.from_numpy(out)


# ==== 2b. Qwen2_5_VisionTransformerPretrainedModel ================================================

def vis_rot_pos_ids(grid):
    """rot_pos_emb's (h, w) position ids, in merge-block order."""
    pos = []
    for t, h, w in grid.tolist():
        hp = torch.arange(h).unsqueeze(1).expand(-1, w)
        hp = hp.reshape(h // MERGE, MERGE, w // MERGE, MERGE).permute(0, 2, 1, 3).flatten()
        wp = torch.arange(w).unsqueeze(0).expand(h, -1)
        wp = wp.reshape(h // MERGE, MERGE, w // MERGE, MERGE).permute(0, 2, 1, 3).flatten()
        pos.append(torch.stack([hp, wp], dim=-1).repeat(t, 1))
    return torch.cat(pos, dim=0)


def vis_rot_pos_emb(grid, head_dim):
    dim = head_dim // 2  # Qwen2_5_VisionRotaryEmbedding(head_dim // 2), theta 10000
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    pos_ids = vis_rot_pos_ids(grid)
    max_grid = int(grid[:, 1:].max())
    seq = torch.arange(max_grid, dtype=inv_freq.dtype)
    full = torch.outer(seq, inv_freq)
    return full[pos_ids].flatten(1), pos_ids


def vis_window_index(grid, window_size):
    """get_window_index: window_index over merged tokens, cu_window_seqlens (before unique)."""
    window_index, cu_window_seqlens, wid = [], [0], 0
    ws = window_size // MERGE // PATCH
    for gt, gh, gw in grid.tolist():
        lh, lw = gh // MERGE, gw // MERGE
        index = torch.arange(gt * lh * lw).reshape(gt, lh, lw)
        pad_h = ws - lh % ws  # a whole window of padding when lh is a multiple of ws
        pad_w = ws - lw % ws
        nwh, nww = (lh + pad_h) // ws, (lw + pad_w) // ws
        ip = F.pad(index, (0, pad_w, 0, pad_h), "constant", -100)
        ip = ip.reshape(gt, nwh, ws, nww, ws).permute(0, 1, 3, 2, 4).reshape(gt, nwh * nww, ws, ws)
        seqlens = (ip != -100).sum([2, 3]).reshape(-1)
        ip = ip.reshape(-1)
        window_index.append(ip[ip != -100] + wid)
        cu_window_seqlens.extend((seqlens.cumsum(0) * MERGE * MERGE + cu_window_seqlens[-1]).tolist())
        wid += gt * lh * lw
    return torch.cat(window_index, dim=0), cu_window_seqlens


def rotate_half_any(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def vis_attention(w, p, x, cu, cos, sin, nh):
    S = x.shape[0]
    q, k, v = F.linear(x, w[p + "qkv.weight"], w[p + "qkv.bias"]).reshape(S, 3, nh, -1) \
        .permute(1, 0, 2, 3).unbind(0)
    hd = q.shape[-1]
    # apply_rotary_pos_emb_vision (in float32)
    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    q, k = q.float(), k.float()
    q = (q * c + rotate_half_any(q) * s).to(x.dtype)
    k = (k * c + rotate_half_any(k) * s).to(x.dtype)
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (q, k, v))  # [1, nh, S, hd]
    lengths = (cu[1:] - cu[:-1]).tolist()
    outs = []
    for qq, kk, vv in zip(q.split(lengths, 2), k.split(lengths, 2), v.split(lengths, 2)):
        a = torch.matmul(qq, kk.transpose(2, 3)) * hd ** -0.5  # eager, no mask
        a = F.softmax(a, dim=-1, dtype=torch.float32).to(qq.dtype)
        outs.append(torch.matmul(a, vv).transpose(1, 2).contiguous())
    o = torch.cat(outs, dim=1).reshape(S, -1)
    return F.linear(o, w[p + "proj.weight"], w[p + "proj.bias"])


def vision_forward(w, vc, pixel_values, grid):
    """Qwen2_5_VisionTransformerPretrainedModel.forward(pixel_values, grid_thw) -> ([N / 4, 64],
    intermediates)."""
    hid, nh = vc["hidden_size"], vc["num_heads"]
    unit = MERGE * MERGE
    x = pixel_values.view(-1, vc["in_channels"], vc["temporal_patch_size"], PATCH, PATCH)
    x = F.conv3d(x, w["visual.patch_embed.proj.weight"],
                 stride=(vc["temporal_patch_size"], PATCH, PATCH)).view(-1, hid)
    patch_embeds = x
    rpe, pos_ids = vis_rot_pos_emb(grid, hid // nh)
    window_index, cu_win_raw = vis_window_index(grid, vc["window_size"])
    cu_win = torch.unique_consecutive(torch.tensor(cu_win_raw, dtype=torch.int32))
    S = x.shape[0]
    x = x.reshape(S // unit, unit, -1)[window_index].reshape(S, -1)
    rpe = rpe.reshape(S // unit, unit, -1)[window_index].reshape(S, -1)
    emb = torch.cat((rpe, rpe), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    cu = torch.repeat_interleave(grid[:, 1] * grid[:, 2], grid[:, 0]).cumsum(0, dtype=torch.int32)
    cu = F.pad(cu, (1, 0), value=0)
    for i in range(vc["depth"]):
        b = f"visual.blocks.{i}."
        cu_now = cu if i in vc["fullatt_block_indexes"] else cu_win
        x = x + vis_attention(w, b + "attn.", mte.rms_norm(x, w[b + "norm1.weight"]), cu_now, cos, sin, nh)
        h = mte.rms_norm(x, w[b + "norm2.weight"])
        x = x + F.linear(F.silu(F.linear(h, w[b + "mlp.gate_proj.weight"], w[b + "mlp.gate_proj.bias"])) *
                         F.linear(h, w[b + "mlp.up_proj.weight"], w[b + "mlp.up_proj.bias"]),
                         w[b + "mlp.down_proj.weight"], w[b + "mlp.down_proj.bias"])
    # Qwen2_5_VLPatchMerger: ln_q (RMSNorm 1e-6), view to hidden * 4, Linear, GELU (exact), Linear
    h = mte.rms_norm(x, w["visual.merger.ln_q.weight"]).view(-1, hid * unit)
    h = F.linear(h, w["visual.merger.mlp.0.weight"], w["visual.merger.mlp.0.bias"])
    h = F.linear(F.gelu(h), w["visual.merger.mlp.2.weight"], w["visual.merger.mlp.2.bias"])
    out = h[torch.argsort(window_index)]
    return out, {"patch_embeds": patch_embeds, "window_index": window_index,
                 "cu_window_seqlens_raw": cu_win_raw, "cu_window_seqlens": cu_win,
                 "cu_seqlens": cu, "rot_pos_ids": pos_ids}


def vision_loop(w, vc, pixel_values, grid):
    """Second formulation, float64: tokens stay in the original (merge-block) order; each token
    attends to an explicit key list (same image; same image AND same window of 4 x 4 merged tokens
    on windowed layers); RoPE by explicit rotation of the pairs (j, j + 8); merger per 4 tokens."""
    w = {k: v.double() for k, v in w.items() if k.startswith("visual.")}
    hid, nh = vc["hidden_size"], vc["num_heads"]
    hd = hid // nh
    ws = vc["window_size"] // MERGE // PATCH
    # token metadata, by explicit arithmetic on the row index
    meta = []
    for img, (gt, gh, gw) in enumerate(grid.tolist()):
        for p in range(gt * gh * gw):
            q = p % (gh * gw)
            blk, sub = divmod(q, MERGE * MERGE)
            bh, bw = divmod(blk, gw // MERGE)
            mh, mw = divmod(sub, MERGE)
            meta.append((img, bh * MERGE + mh, bw * MERGE + mw, (bh // ws, bw // ws)))
    N = len(meta)
    x = pixel_values.double() @ w["visual.patch_embed.proj.weight"].reshape(hid, -1).T
    half = hd // 2
    freqs = [10000.0 ** (-2.0 * j / half) for j in range(half // 2)]  # 4 frequencies

    def angle(j, t):  # dims j < half/2 rotate with h, the next half/2 with w
        return meta[t][1] * freqs[j] if j < half // 2 else meta[t][2] * freqs[j - half // 2]

    def rope(vec, t):
        out = vec.clone()
        for j in range(half):
            a = angle(j, t)
            c, s = math.cos(a), math.sin(a)
            out[j] = vec[j] * c - vec[j + half] * s
            out[j + half] = vec[j + half] * c + vec[j] * s
        return out

    def norm(v, weight):
        return weight * v / torch.sqrt((v * v).mean(-1, keepdim=True) + 1e-6)

    for i in range(vc["depth"]):
        b = f"visual.blocks.{i}."
        full = i in vc["fullatt_block_indexes"]
        h = norm(x, w[b + "norm1.weight"])
        qkv = (h @ w[b + "attn.qkv.weight"].T + w[b + "attn.qkv.bias"]).view(N, 3, nh, hd)
        ctx = torch.zeros(N, nh, hd, dtype=torch.float64)
        for hh in range(nh):
            qs = torch.stack([rope(qkv[t, 0, hh], t) for t in range(N)])
            ks = torch.stack([rope(qkv[t, 1, hh], t) for t in range(N)])
            vs = qkv[:, 2, hh]
            for t in range(N):
                keys = [s for s in range(N) if meta[s][0] == meta[t][0] and (full or meta[s][3] == meta[t][3])]
                sc = ks[keys] @ qs[t] / math.sqrt(hd)
                pr = torch.exp(sc - sc.max())
                ctx[t, hh] = (pr / pr.sum()) @ vs[keys]
        x = x + ctx.reshape(N, hid) @ w[b + "attn.proj.weight"].T + w[b + "attn.proj.bias"]
        h = norm(x, w[b + "norm2.weight"])
        g = h @ w[b + "mlp.gate_proj.weight"].T + w[b + "mlp.gate_proj.bias"]
        u = h @ w[b + "mlp.up_proj.weight"].T + w[b + "mlp.up_proj.bias"]
        x = x + (g / (1 + torch.exp(-g)) * u) @ w[b + "mlp.down_proj.weight"].T + w[b + "mlp.down_proj.bias"]
    outs = []
    for gi in range(N // 4):
        v = torch.cat([norm(x[4 * gi + r], w["visual.merger.ln_q.weight"]) for r in range(4)])
        v = v @ w["visual.merger.mlp.0.weight"].T + w["visual.merger.mlp.0.bias"]
        v = 0.5 * v * (1 + torch.erf(v / math.sqrt(2)))
        outs.append(v @ w["visual.merger.mlp.2.weight"].T + w["visual.merger.mlp.2.bias"])
    return torch.stack(outs)


# ==== 2c. Qwen2_5_VLProcessor text side, 2d. the encoder with images ==============================

def expand_image_tokens(texts, grid):
    """processing_qwen2_5_vl: each <|image_pad|> (in text order, across the batch) becomes
    grid_t * grid_h * grid_w / merge**2 copies."""
    out, index = [], 0
    for t in texts:
        while IMAGE_PAD in t:
            n = int(grid[index].prod()) // (MERGE * MERGE)
            t = t.replace(IMAGE_PAD, "<|placeholder|>" * n, 1)
            index += 1
        out.append(t.replace("<|placeholder|>", IMAGE_PAD))
    assert grid is None or index == len(grid), "images and <|image_pad|> counts differ"
    return out


def tokenize_pad(tok, texts):
    """tokenizer(texts, padding=True): no truncation, right padding with <|endoftext|>."""
    enc = [tok.encode(t) for t in texts]
    S = max(len(e) for e in enc)
    ids = torch.full((len(texts), S), tok.pad_id, dtype=torch.int64)
    mask = torch.zeros((len(texts), S), dtype=torch.int64)
    for i, e in enumerate(enc):
        ids[i, :len(e)] = torch.tensor(e, dtype=torch.int64)
        mask[i, :len(e)] = 1
    return ids, mask


def processor_call(tok, text, images):
    texts = [text] if isinstance(text, str) else list(text)
    imgs = [] if images is None else (list(images) if isinstance(images, (list, tuple)) else [images])
    pv = grid = None
    resized = []
    if imgs:
        pv, grid, resized = image_processor(imgs)
    ids, mask = tokenize_pad(tok, expand_image_tokens(texts, grid))
    return dict(input_ids=ids, attention_mask=mask, pixel_values=pv, image_grid_thw=grid,
                texts=texts, resized=resized)


def encoder_forward(w, cfg, input_ids, attention_mask, pixel_values=None, image_grid_thw=None):
    """Qwen2_5_VLForConditionalGeneration(input_ids, attention_mask, pixel_values, image_grid_thw,
    output_hidden_states=True): hidden_states (4), position_ids, rope_deltas, extras."""
    x = F.embedding(input_ids, w["model.embed_tokens.weight"])
    extras = {}
    if pixel_values is not None:
        img, vx = vision_forward(w, cfg["vision_config"], pixel_values.float(), image_grid_thw)
        extras.update(vx, image_embeds=img)
        m = input_ids == cfg["image_token_id"]
        assert int(m.sum()) == img.shape[0], "Image features and image tokens do not match"
        x = x.masked_scatter(m.unsqueeze(-1).expand_as(x), img.to(x.dtype))
    extras["inputs_embeds"] = x
    position_ids, deltas = mte.get_rope_index(cfg, input_ids, attention_mask, image_grid_thw)
    cos, sin = mte.rotary(x, position_ids)
    cmask = mte.causal_mask(attention_mask, x.dtype)
    hidden = []
    for i in range(mte.L):  # as make_text_encoder.text_forward
        hidden.append(x)
        p = f"model.layers.{i}."
        x = x + mte.attention(w, p + "self_attn.", mte.rms_norm(x, w[p + "input_layernorm.weight"]),
                              cos, sin, cmask)
        h = mte.rms_norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + F.linear(F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) *
                         F.linear(h, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
    hidden.append(mte.rms_norm(x, w["model.norm.weight"]))
    return hidden, position_ids, deltas, extras


class _EmbedOverride:
    """Stands in for embed_tokens.weight in make_text_encoder.loop_forward: `.double()` then
    `[input_ids]` give the given float64 embeddings (image rows replaced)."""

    def __init__(self, embeds):
        self.embeds = embeds

    def double(self):
        return self

    def __getitem__(self, ids):
        assert ids.shape == self.embeds.shape[:2]
        return self.embeds.clone()


def loop_encoder(w, cfg, input_ids, attention_mask, image_embeds64):
    x = w["model.embed_tokens.weight"].double()[input_ids]
    m = (input_ids == cfg["image_token_id"]).tolist()
    k = 0
    for b in range(input_ids.shape[0]):  # row-major order over (batch, position)
        for t in range(input_ids.shape[1]):
            if m[b][t]:
                x[b, t] = image_embeds64[k]
                k += 1
    assert k == image_embeds64.shape[0]
    w2 = dict(w)
    w2["model.embed_tokens.weight"] = _EmbedOverride(x)
    return x, w2


# ---- vision / encoder cases ----------------------------------------------------------------------

VISION_IMAGES = {  # name -> (w, h, seed)
    "img_70x45": (70, 45, 701),
    "img_40x30": (40, 30, 702),
    "img_56x84": (56, 84, 703),
    "img_196x140": (196, 140, 704),
    "img_224x112": (224, 112, 705),
}
VISION_CASES = [  # (case, images)
    ("round_70x45", ["img_70x45"]),
    ("minpix_40x30", ["img_40x30"]),
    ("exact_56x84", ["img_56x84"]),
    ("batch2", ["img_70x45", "img_56x84"]),
    ("pad_196x140", ["img_196x140"]),
    ("multiple_224x112", ["img_224x112"]),
]
ENCODER_CASES = [
    dict(name="edit", kind="QwenImageEditPipeline", prompts=["make it red"], images=["img_196x140"]),
    dict(name="plus", kind="QwenImageEditPlusPipeline", prompts=["put the cat from picture 1 into picture 2"],
         images=["img_70x45", "img_56x84"]),
    # a padded batch of two Edit texts, one image each: masked_scatter runs across the rows,
    # get_rope_index takes image_grid_thw rows in order across the batch
    dict(name="edit_batch_pad", kind="QwenImageEditPipeline",
         prompts=["make it red", "turn the sky purple and add a few bright stars"],
         images=["img_70x45", "img_56x84"]),
]


def render(kind, prompt, n_images):
    if kind == "QwenImageEditPipeline":
        return make_prompts.EDIT_TEMPLATE.format(prompt)
    base = "".join(make_prompts.EDIT_PLUS_IMG.format(i + 1) for i in range(n_images))
    return make_prompts.EDIT_PLUS_TEMPLATE.format(base + prompt)


def pad_runs(row, token_id):
    """[[start, length], ...] of the runs of token_id in a list of ids."""
    runs = []
    for j, t in enumerate(row):
        if t == token_id:
            if runs and runs[-1][0] + runs[-1][1] == j:
                runs[-1][1] += 1
            else:
                runs.append([j, 1])
    return runs


def max_diff(a, b):
    return (a.double() - b.double()).abs().max().item()


def make_vision(out_dir, w, cfg, tok):
    vc = cfg["vision_config"]
    imgs = {k: textured_image(*v) for k, v in VISION_IMAGES.items()}
    tensors, cases, diffs = {}, {}, {}
    for name, (iw, ih, seed) in VISION_IMAGES.items():
        tensors[f"images.{name}"] = u8(imgs[name])
    singles = {}
    with torch.no_grad():
        for case, names in VISION_CASES:
            pv, grid, resized = image_processor([imgs[n] for n in names])
            emb, vx = vision_forward(w, vc, pv, grid)
            assert emb.shape == (pv.shape[0] // 4, vc["out_hidden_size"])
            # second formulations
            pv_loop = torch.cat([loop_patchify(r, tuple(g)) for r, g in zip(resized, grid.tolist())])
            d_pv = max_diff(pv, pv_loop)
            emb64 = vision_loop(w, vc, pv, grid)
            d_emb = max_diff(emb, emb64)
            assert d_pv < 1e-6 and d_emb < 1e-5, (case, d_pv, d_emb)
            diffs[case] = {"pixel_values_vs_float64_loops": d_pv, "image_embeds_vs_float64_loops": d_emb}
            if len(names) == 1:
                singles[names[0]] = (pv, emb)
            else:  # each image alone equals its rows of the batch
                r0 = r1 = 0
                d_alone = 0.0
                for n in names:
                    p1, e1 = singles[n]
                    assert torch.equal(pv[r0:r0 + p1.shape[0]], p1)
                    d_alone = max(d_alone, max_diff(emb[r1:r1 + e1.shape[0]], e1))
                    r0, r1 = r0 + p1.shape[0], r1 + e1.shape[0]
                assert d_alone < 1e-5
                diffs[case]["batch_vs_alone"] = d_alone
            tensors[f"{case}.pixel_values"] = pv
            tensors[f"{case}.image_grid_thw"] = grid
            tensors[f"{case}.image_embeds"] = emb
            tensors[f"{case}.patch_embeds"] = vx["patch_embeds"]
            tensors[f"{case}.window_index"] = vx["window_index"]
            tensors[f"{case}.cu_window_seqlens"] = vx["cu_window_seqlens"]
            tensors[f"{case}.cu_seqlens"] = vx["cu_seqlens"]
            tensors[f"{case}.rot_pos_ids"] = vx["rot_pos_ids"]
            for i, (n, r) in enumerate(zip(names, resized)):
                if r.shape != imgs[n].shape:
                    tensors[f"{case}.resized.{i}"] = u8(r)
            cases[case] = {
                "images": names,
                "source_sizes_wh": [[imgs[n].shape[1], imgs[n].shape[0]] for n in names],
                "smart_resize_hw": [list(smart_resize(*imgs[n].shape[:2])) for n in names],
                "resized": [r.shape != imgs[n].shape for n, r in zip(names, resized)],
                "image_grid_thw": grid.tolist(),
                "llm_grid_hw": [[g[1] // 2, g[2] // 2] for g in grid.tolist()],
                "pixel_values_shape": list(pv.shape),
                "image_embeds_shape": list(emb.shape),
                "cu_seqlens": vx["cu_seqlens"].tolist(),
                "cu_window_seqlens_before_unique": vx["cu_window_seqlens_raw"],
                "cu_window_seqlens": vx["cu_window_seqlens"].tolist(),
                "window_index": vx["window_index"].tolist(),
                "max_abs_diffs": diffs[case],
            }
            print(f"vision {case}: grid {grid.tolist()} pv {tuple(pv.shape)} cu_win "
                  f"{vx['cu_window_seqlens'].tolist()} diffs pv {d_pv:.2e} emb {d_emb:.2e}")

        enc_cases = {}
        for c in ENCODER_CASES:
            name, kind = c["name"], c["kind"]
            texts = [render(kind, p, len(c["images"])) for p in c["prompts"]]
            call = processor_call(tok, texts, [imgs[n] for n in c["images"]])
            ids, mask, pv, grid = call["input_ids"], call["attention_mask"], call["pixel_values"], call["image_grid_thw"]
            hs, pos, deltas, ex = encoder_forward(w, cfg, ids, mask, pv, grid)
            # second formulation: float64 vision loops, then the float64 language-model loops
            emb64 = vision_loop(w, vc, pv, grid)
            x64, w2 = loop_encoder(w, cfg, ids, mask, emb64)
            ref, P = mte.loop_forward(w2, cfg, ids, mask, grid.tolist())
            assert torch.equal(pos.permute(1, 2, 0), torch.tensor(P)), name
            real = mask.bool()
            d_real = max_diff(hs[-1][real], ref[-1][real])
            d_all = max(max_diff(a, r) for a, r in zip(hs, ref))
            d_in = max_diff(ex["inputs_embeds"], x64)
            assert d_real < 1e-5 and d_all < 1e-5, (name, d_real, d_all)
            # without pixel_values the same code equals make_text_encoder.text_forward exactly
            hs_np, _, _, _ = encoder_forward(w, cfg, ids, mask, None, grid)
            hs_te, _, _ = mte.text_forward(w, cfg, ids, mask, grid)
            assert all(torch.equal(a, b) for a, b in zip(hs_np, hs_te))
            # pixel_values are those of the vision cases' images
            from_case = {("img_196x140",): "pad_196x140", ("img_70x45", "img_56x84"): "batch2"}.get(
                tuple(c["images"]))
            if from_case is not None:
                assert torch.equal(pv, tensors[f"{from_case}.pixel_values"])
            else:
                tensors[f"{name}.pixel_values"] = pv
            tensors[f"{name}.input_ids"] = ids
            tensors[f"{name}.attention_mask"] = mask
            tensors[f"{name}.image_grid_thw"] = grid
            tensors[f"{name}.position_ids"] = pos.contiguous()
            tensors[f"{name}.rope_deltas"] = deltas
            tensors[f"{name}.inputs_embeds"] = ex["inputs_embeds"]
            tensors[f"{name}.hidden_states_last"] = hs[-1]
            enc_cases[name] = {
                "pipeline_template": kind, "prompts": c["prompts"], "images": c["images"],
                "pixel_values_from": from_case or f"{name}.pixel_values (stored)",
                "rendered": texts, "expanded_lengths": [int(m.sum()) for m in mask],
                "image_grid_thw": grid.tolist(),
                "image_tokens_per_image": [int(g.prod()) // 4 for g in grid],
                "image_pad_runs_start_length": [pad_runs(r, cfg["image_token_id"]) for r in ids.tolist()],
                "input_ids_shape": list(ids.shape), "rope_deltas": deltas.flatten().tolist(),
                "max_abs_diffs": {"hidden_states_last_real_vs_float64_loops": d_real,
                                  "all_hidden_states_every_position_vs_float64_loops": d_all,
                                  "inputs_embeds_vs_float64": d_in},
            }
            diffs[f"encoder.{name}"] = enc_cases[name]["max_abs_diffs"]
            print(f"encoder {name}: ids {tuple(ids.shape)} lengths {enc_cases[name]['expanded_lengths']} "
                  f"grid {grid.tolist()} deltas {deltas.flatten().tolist()} diffs real {d_real:.2e} "
                  f"all {d_all:.2e} inputs {d_in:.2e}")
    write_st(os.path.join(out_dir, "vision_expected.safetensors"), tensors)
    doc = {
        "processor": {"class": "Qwen2VLImageProcessor (slow, PIL)", "min_pixels": MIN_PIXELS,
                      "max_pixels": MAX_PIXELS, "patch_size": PATCH, "merge_size": MERGE,
                      "temporal_patch_size": TEMPORAL, "image_mean": MEAN, "image_std": STD,
                      "rescale_factor": "1/255", "resample": "BICUBIC (3)", "do_convert_rgb": True},
        "vision_config": vc,
        "image_token_id": cfg["image_token_id"], "vision_start_token_id": cfg["vision_start_token_id"],
        "vision_end_token_id": cfg["vision_end_token_id"], "pad_token_id": tok.pad_id,
        "images": {k: {"size_wh": [v[0], v[1]], "seed": v[2]} for k, v in VISION_IMAGES.items()},
        "vision_cases": cases,
        "encoder_cases": enc_cases,
        "templates": {"QwenImageEditPipeline": make_prompts.EDIT_TEMPLATE,
                      "QwenImageEditPlusPipeline": make_prompts.EDIT_PLUS_TEMPLATE,
                      "edit_plus_image_prompt": make_prompts.EDIT_PLUS_IMG},
    }
    write_json(os.path.join(out_dir, "vision_cases.json"), doc)
    return diffs


# ==== 3. Diffusers' Edit pipelines end to end ======================================================

class _Batch(dict):
    def __getattr__(self, k):
        try:
            return self[k]
        except KeyError as e:
            raise AttributeError(k) from e

    def to(self, device):
        return self


class Processor:
    """Qwen2_5_VLProcessor(text=, images=, padding=True, return_tensors="pt")."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def __call__(self, text=None, images=None, padding=None, return_tensors=None, **kw):
        assert padding is True and return_tensors == "pt" and not kw
        r = processor_call(self.tok, text, images)
        self.calls.append(dict(texts=r["texts"], images=[np.array(i) for i in (
            images if isinstance(images, list) else [images])], input_ids=r["input_ids"],
            attention_mask=r["attention_mask"], image_grid_thw=r["image_grid_thw"]))
        out = _Batch(input_ids=r["input_ids"], attention_mask=r["attention_mask"])
        if r["pixel_values"] is not None:
            out.update(pixel_values=r["pixel_values"], image_grid_thw=r["image_grid_thw"])
        return out


class VLTextEncoder:
    dtype = torch.float32

    def __init__(self, w, cfg):
        self.w, self.cfg, self.calls = w, cfg, []

    def __call__(self, input_ids, attention_mask, pixel_values=None, image_grid_thw=None,
                 output_hidden_states=False):
        assert output_hidden_states
        self.calls.append(dict(input_ids=input_ids.clone(), attention_mask=attention_mask.clone(),
                               image_grid_thw=None if image_grid_thw is None else image_grid_thw.clone()))
        with torch.no_grad():
            hs, _, _, _ = encoder_forward(self.w, self.cfg, input_ids, attention_mask, pixel_values,
                                          image_grid_thw)
        return type("Out", (), {"hidden_states": tuple(hs)})()


def calculate_dimensions(target_area, ratio):  # pipeline_qwenimage_edit(_plus).calculate_dimensions
    width = math.sqrt(target_area * ratio)
    height = width / ratio
    return round(width / 32) * 32, round(height / 32) * 32


E2E_SOURCES = {"src_300x200": (300, 200, 301), "src_160x240": (160, 240, 302)}
E2E_CASES = [
    dict(name="edit_one", pipeline="QwenImageEditPipeline", images=["src_300x200"],
         prompt="make it red", negative_prompt=None, true_cfg_scale=1.0, height=48, width=64,
         num_inference_steps=2, seed=0),
    dict(name="edit_cfg", pipeline="QwenImageEditPipeline", images=["src_300x200"],
         prompt="make it red", negative_prompt=" ", true_cfg_scale=4.0, height=48, width=64,
         num_inference_steps=2, seed=0),
    dict(name="plus_two", pipeline="QwenImageEditPlusPipeline", images=["src_300x200", "src_160x240"],
         prompt="put the two pictures side by side", negative_prompt=None, true_cfg_scale=1.0,
         height=48, width=64, num_inference_steps=2, seed=2),
]


def pack(lat):  # QwenImagePipeline._pack_latents of [B, C, 1, H, W] (frame 1)
    B, C, _, H, W = lat.shape
    return lat.view(B, C, H // 2, 2, W // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, H // 2 * W // 2, C * 4)


def restated_embeds(tok, w, cfg, texts, images):
    """_get_qwen_prompt_embeds of the Edit pipelines, restated."""
    r = processor_call(tok, texts, images)
    hs, _, _, _ = encoder_forward(w, cfg, r["input_ids"], r["attention_mask"], r["pixel_values"],
                                  r["image_grid_thw"])
    kept = [hs[-1][i][r["attention_mask"][i].bool()][EDIT_DROP:] for i in range(len(texts))]
    L = max(k.shape[0] for k in kept)
    e = torch.zeros(len(texts), L, hs[-1].shape[-1])
    m = torch.zeros(len(texts), L, dtype=torch.int64)
    for i, k in enumerate(kept):
        e[i, :k.shape[0]], m[i, :k.shape[0]] = k, 1
    return r, e, m


def make_e2e(root, w, cfg, tok):
    srcs = {k: textured_image(*v) for k, v in E2E_SOURCES.items()}
    base = QwenImagePipeline.from_pretrained(root, text_encoder=None, tokenizer=None)
    proc, te = Processor(tok), VLTextEncoder(w, cfg)
    pipes = {}
    for cls in (QwenImageEditPipeline, QwenImageEditPlusPipeline):
        p = cls(scheduler=base.scheduler, vae=base.vae, text_encoder=te, tokenizer=None, processor=proc,
                transformer=base.transformer)
        p.set_progress_bar_config(disable=True)
        assert p.prompt_template_encode_start_idx == EDIT_DROP and p.vae_scale_factor == 8
        pipes[cls.__name__] = p
    assert pipes["QwenImageEditPipeline"].prompt_template_encode == make_prompts.EDIT_TEMPLATE
    assert pipes["QwenImageEditPlusPipeline"].prompt_template_encode == make_prompts.EDIT_PLUS_TEMPLATE
    vae = base.vae
    lmean = torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
    lstd = torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)

    calls = []

    def hook(mod, args, kwargs, o):
        m = kwargs.get("encoder_hidden_states_mask")
        calls.append(dict(hidden_states=kwargs["hidden_states"].clone(),
                          encoder_hidden_states=kwargs["encoder_hidden_states"].clone(),
                          mask=None if m is None else m.clone(), timestep=kwargs["timestep"].clone(),
                          img_shapes=[[list(s) for s in smp] for smp in kwargs["img_shapes"]]))
    base.transformer.register_forward_hook(hook, with_kwargs=True)

    tensors, meta, stored = {}, {}, {}
    for case in E2E_CASES:
        name, pname = case["name"], case["pipeline"]
        pipe = pipes[pname]
        pil = [Image.fromarray(srcs[n], mode="RGB") for n in case["images"]]
        image_arg = pil[0] if pname == "QwenImageEditPipeline" else pil
        cfg_on = case["true_cfg_scale"] > 1 and case["negative_prompt"] is not None

        def run(output_type):
            calls.clear()
            proc.calls.clear()
            te.calls.clear()
            with torch.no_grad():
                out = pipe(image=image_arg, prompt=case["prompt"], negative_prompt=case["negative_prompt"],
                           true_cfg_scale=case["true_cfg_scale"], height=case["height"],
                           width=case["width"], num_inference_steps=case["num_inference_steps"],
                           generator=torch.Generator("cpu").manual_seed(case["seed"]),
                           output_type=output_type, return_dict=False)[0]
            return out, list(calls), list(proc.calls), list(te.calls)

        lat, lcalls, pcalls, tcalls = run("latent")
        img_np, icalls, _, _ = run("np")
        img = torch.from_numpy(img_np)
        timesteps = pipe.scheduler.timesteps.tolist()
        sigmas = pipe.scheduler.sigmas.tolist()
        hl, wl = 2 * (case["height"] // 16), 2 * (case["width"] // 16)
        n_t = hl * wl // 4
        assert lat.shape == (1, n_t, 64) and img.shape == (1, 8 * hl, 8 * wl, 3)
        assert len(lcalls) == case["num_inference_steps"] * (2 if cfg_on else 1)
        assert all(torch.equal(a["hidden_states"], b["hidden_states"]) for a, b in zip(lcalls, icalls))

        # ---- restatement of what the pipeline does before the transformer
        if pname == "QwenImageEditPipeline":
            sw, sh = pil[0].size
            cw, ch = calculate_dimensions(1024 * 1024, sw / sh)
            cond_sizes, vae_sizes = [(cw, ch)], [(cw, ch)]
            cond_imgs = [np.array(pil[0].resize((cw, ch), resample=Image.Resampling.LANCZOS))]
            vae_imgs = cond_imgs
            texts = [make_prompts.EDIT_TEMPLATE.format(case["prompt"])]
            neg_texts = [make_prompts.EDIT_TEMPLATE.format(case["negative_prompt"])] if cfg_on else None
        else:
            cond_sizes = [calculate_dimensions(384 * 384, p.size[0] / p.size[1]) for p in pil]
            vae_sizes = [calculate_dimensions(1024 * 1024, p.size[0] / p.size[1]) for p in pil]
            cond_imgs = [np.array(p.resize(s, resample=Image.Resampling.LANCZOS)) for p, s in zip(pil, cond_sizes)]
            vae_imgs = [np.array(p.resize(s, resample=Image.Resampling.LANCZOS)) for p, s in zip(pil, vae_sizes)]
            base_txt = "".join(make_prompts.EDIT_PLUS_IMG.format(i + 1) for i in range(len(pil)))
            texts = [make_prompts.EDIT_PLUS_TEMPLATE.format(base_txt + case["prompt"])]
            neg_texts = [make_prompts.EDIT_PLUS_TEMPLATE.format(base_txt + case["negative_prompt"])] if cfg_on else None
        with torch.no_grad():
            r, pe, pm = restated_embeds(tok, w, cfg, texts, cond_imgs)
            nr = ne = nm = None
            if cfg_on:
                nr, ne, nm = restated_embeds(tok, w, cfg, neg_texts, cond_imgs)
            # the stand-ins saw exactly these texts, images and ids
            expect = [(texts, r)] + ([(neg_texts, nr)] if cfg_on else [])
            assert len(pcalls) == len(expect) and len(tcalls) == len(expect)
            for pc, tc, (tx, rr) in zip(pcalls, tcalls, expect):
                assert pc["texts"] == tx
                assert len(pc["images"]) == len(cond_imgs) and all(
                    np.array_equal(a, b) for a, b in zip(pc["images"], cond_imgs))
                assert torch.equal(tc["input_ids"], rr["input_ids"]) and torch.equal(tc["attention_mask"], rr["attention_mask"])
                assert torch.equal(tc["image_grid_thw"], rr["image_grid_thw"])
            # the transformer's first call(s): embeddings (mask None: all ones), noise, image latents
            first = lcalls[0]
            assert torch.equal(first["encoder_hidden_states"], pe) and first["mask"] is None and bool(pm.all())
            if cfg_on:
                assert torch.equal(lcalls[1]["encoder_hidden_states"], ne) and lcalls[1]["mask"] is None
                assert torch.equal(lcalls[1]["hidden_states"], first["hidden_states"])
            noise = torch.randn((1, 1, 16, hl, wl), generator=torch.Generator().manual_seed(case["seed"]))
            noise = noise.view(1, 16, hl // 2, 2, wl // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(1, n_t, 64)
            assert torch.equal(first["hidden_states"][:, :n_t], noise)
            img_lat = []
            for vi in vae_imgs:
                x = torch.from_numpy(vi.astype(np.float32) / 255.0).permute(2, 0, 1)[None] * 2.0 - 1.0
                z = vae.encode(x.unsqueeze(2)).latent_dist.mode()
                img_lat.append(pack((z - lmean) / lstd))
            img_lat = torch.cat(img_lat, dim=1)
            d_lat = max_diff(first["hidden_states"][:, n_t:], img_lat)
            assert torch.equal(first["hidden_states"][:, n_t:], img_lat), d_lat

        # ---- store
        for i, n in enumerate(case["images"]):
            key = f"{name}.source.{i}"
            tensors[key] = u8(srcs[n])
        tensors[f"{name}.input_ids"] = r["input_ids"]
        tensors[f"{name}.attention_mask"] = r["attention_mask"]
        tensors[f"{name}.image_grid_thw"] = r["image_grid_thw"]
        tensors[f"{name}.prompt_embeds"] = pe
        tensors[f"{name}.prompt_embeds_mask"] = pm
        if cfg_on:
            tensors[f"{name}.negative_input_ids"] = nr["input_ids"]
            tensors[f"{name}.negative_attention_mask"] = nr["attention_mask"]
            tensors[f"{name}.negative_prompt_embeds"] = ne
            tensors[f"{name}.negative_prompt_embeds_mask"] = nm
        # first_call.hidden_states = cat([noise_latents, image_latents.0, image_latents.1, ...], dim=1)
        tensors[f"{name}.first_call.noise_latents"] = first["hidden_states"][:, :n_t]
        o = n_t
        for i, (vw, vh) in enumerate(vae_sizes):
            n_i = (vh // 16) * (vw // 16)
            tensors[f"{name}.first_call.image_latents.{i}"] = first["hidden_states"][:, o:o + n_i]
            o += n_i
        assert o == first["hidden_states"].shape[1]
        tensors[f"{name}.first_call.timestep"] = first["timestep"]
        tensors[f"{name}.first_call.img_shapes"] = torch.tensor(first["img_shapes"], dtype=torch.int64)
        tensors[f"{name}.latents"] = lat
        tensors[f"{name}.image"] = img
        # identical tensors of an earlier case are dropped (edit_cfg repeats edit_one's inputs)
        dedup = {}
        for k in [k for k in tensors if k.startswith(name + ".")]:
            suffix = k[len(name) + 1:]
            if tensors[k].numel() * tensors[k].element_size() < 4096:
                continue  # small tensors stay with their case
            for prev, ptens in stored.items():
                if suffix in ptens and ptens[suffix].dtype == tensors[k].dtype and \
                        ptens[suffix].shape == tensors[k].shape and torch.equal(ptens[suffix], tensors[k]):
                    dedup[suffix] = f"{prev}.{suffix}"
                    break
        stored[name] = {k[len(name) + 1:]: v for k, v in tensors.items() if k.startswith(name + ".")}
        for suffix in dedup:
            del tensors[f"{name}.{suffix}"]

        info = {
            "arguments": {"pipeline": pname, "image": [f"{n} ({E2E_SOURCES[n][0]} x {E2E_SOURCES[n][1]}, "
                                                       f"PIL RGB)" for n in case["images"]],
                          "image_passed_as": "PIL.Image" if pname == "QwenImageEditPipeline" else "list of PIL.Image",
                          "prompt": case["prompt"], "negative_prompt": case["negative_prompt"],
                          "true_cfg_scale": case["true_cfg_scale"], "height": case["height"],
                          "width": case["width"], "num_inference_steps": case["num_inference_steps"],
                          "seed": case["seed"], "generator": "torch.Generator('cpu').manual_seed(seed)",
                          "num_images_per_prompt": 1, "guidance_scale": None, "sigmas": None,
                          "max_sequence_length": 512, "dtype": "float32", "output_type": ["latent", "np"]},
            "do_true_cfg": cfg_on,
            "source_sizes_wh": [list(p.size) for p in pil],
            "condition_sizes_wh": [list(s) for s in cond_sizes],
            "vae_sizes_wh": [list(s) for s in vae_sizes],
            "processor_smart_resize_hw": [list(smart_resize(c.shape[0], c.shape[1])) for c in cond_imgs],
            "image_grid_thw": r["image_grid_thw"].tolist(),
            "image_tokens": [int(g.prod()) // 4 for g in r["image_grid_thw"]],
            "rendered": texts, "negative_rendered": neg_texts,
            "text_lengths": [int(m.sum()) for m in r["attention_mask"]],
            "negative_text_lengths": None if nr is None else [int(m.sum()) for m in nr["attention_mask"]],
            "ids_first_64_dropped": r["input_ids"][0, :EDIT_DROP].tolist(),
            "image_pad_runs_start_length": pad_runs(r["input_ids"][0].tolist(), cfg["image_token_id"]),
            "prompt_embeds_shape": list(pe.shape),
            "negative_prompt_embeds_shape": None if ne is None else list(ne.shape),
            "transformer_mask": "None (all-ones mask dropped by encode_prompt)",
            "latent_hw": [hl, wl], "target_tokens": n_t,
            "first_call": {"hidden_states_shape": list(first["hidden_states"].shape),
                           "encoder_hidden_states_shape": list(first["encoder_hidden_states"].shape),
                           "encoder_hidden_states_equals": f"{name}.prompt_embeds",
                           "hidden_states_is": "cat([first_call.noise_latents, first_call.image_latents.0, "
                                               "...], dim=1)",
                           "img_shapes": first["img_shapes"], "timestep": first["timestep"].tolist(),
                           "noise_part": "hidden_states[:, :target_tokens] = _pack_latents(torch.randn("
                                         "(1, 1, 16, h, w), generator=Generator().manual_seed(seed)))",
                           "image_latents_part": "hidden_states[:, target_tokens:] = concat over images of "
                                                 "_pack_latents((vae.encode(2 * x / 255 - 1).mode() - mean) / std)"},
            "transformer_calls": len(lcalls),
            "scheduler_timesteps": timesteps, "scheduler_sigmas": sigmas,
            "latents_shape": list(lat.shape), "image_shape": list(img.shape),
            "deduplicated_keys": dedup,
            "vae_latents_max_abs_diff_vs_restated": d_lat,
        }
        if name == "edit_cfg":
            info["latents_max_abs_diff_vs_edit_one"] = max_diff(lat, stored["edit_one"]["latents"])
            info["image_max_abs_diff_vs_edit_one"] = max_diff(img, stored["edit_one"]["image"])
        meta[name] = info
        print(f"e2e {name}: cond {cond_sizes} vae {vae_sizes} grid {r['image_grid_thw'].tolist()} text "
              f"{info['text_lengths']} embeds {tuple(pe.shape)} first hs {tuple(first['hidden_states'].shape)} "
              f"img_shapes {first['img_shapes']} timesteps {timesteps} |lat| {lat.abs().max().item():.3f}"
              f" dedup {sorted(dedup)}")
    write_st(os.path.join(root, "edit_e2e.safetensors"), tensors)
    doc = {"diffusers_version": diffusers.__version__,
           "pipelines": "QwenImageEditPipeline / QwenImageEditPlusPipeline (unmodified) built from "
                        "QwenImagePipeline.from_pretrained(tiny_qwen_image, text_encoder=None, "
                        "tokenizer=None)'s scheduler, vae, transformer, with processor / text_encoder "
                        "stand-ins (make_edit.Processor, make_edit.VLTextEncoder) and tokenizer=None",
           "sources": {k: {"size_wh": [v[0], v[1]], "seed": v[2]} for k, v in E2E_SOURCES.items()},
           "edit_template": make_prompts.EDIT_TEMPLATE, "edit_plus_template": make_prompts.EDIT_PLUS_TEMPLATE,
           "edit_plus_image_prompt": make_prompts.EDIT_PLUS_IMG, "drop_idx": EDIT_DROP,
           "condition_area": {"QwenImageEditPipeline": 1024 * 1024, "QwenImageEditPlusPipeline": 384 * 384},
           "vae_area": 1024 * 1024,
           "scheduler_config": {k: v for k, v in sorted(base.scheduler.config.items()) if not k.startswith("_")},
           "storage_note": "keys listed in a case's deduplicated_keys are not stored under that case: "
                           "they equal the named key of an earlier case exactly",
           "cases": meta}
    write_json(os.path.join(root, "edit_e2e.json"), doc)
    return meta


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    edit_dir = os.path.join(out, "edit")
    os.makedirs(edit_dir, exist_ok=True)
    tok = make_prompts.Tokenizer(os.path.join(out, "tokenizer"))
    w, cfg = make_prompts.load_text_encoder(os.path.join(out, "text_encoder"))
    make_resize_cases(edit_dir)
    make_vision(edit_dir, w, cfg, tok)
    if os.environ.get("MAKE_EDIT_SKIP_E2E") != "1":
        make_e2e(os.path.join(out, "tiny_qwen_image"), w, cfg, tok)
    print("done")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_edit.py OUT_DIR  (tests/golden/qwen_image)")
    main(sys.argv[1])
