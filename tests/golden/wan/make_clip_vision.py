#!/usr/bin/env python3
"""Makes the Wan 2.1 image-to-video references WITH the CLIP image encoder (Wan2.1-I2V-14B-480P /
-720P style: `image_encoder/` = transformers' CLIPVisionModel, `image_processor/` =
CLIPImageProcessor; the transformer's `image_dim` / `added_kv_proj_dim` branch):
  tiny_wan_i2v21/model_index.json                 WanImageToVideoPipeline; image_encoder ["transformers",
                                                  "CLIPVisionModel"], image_processor ["transformers",
                                                  "CLIPImageProcessor"]; transformer_2 null; boundary_ratio
                                                  null; expand_timesteps false
  tiny_wan_i2v21/image_encoder/{config.json,model.safetensors}   a tiny CLIPVisionModel in transformers'
                                                  format (hidden 48 = transformer_i2v's image_dim)
  tiny_wan_i2v21/image_processor/preprocessor_config.json        CLIPImageProcessor (28 px)
  tiny_wan_i2v21/transformer/                     a copy of ../tiny_wan/transformer_i2v
  tiny_wan_i2v21/{vae,text_encoder,tokenizer,scheduler}/         copies of ../tiny_wan/*
  tiny_wan_i2v21/clip_cases.safetensors + .json   processor + vision tower references
  tiny_wan_i2v21/sample_i2v21.safetensors + .json WanImageToVideoPipeline.__call__ end to end
README.md ("## Wan 2.1 image to video: CLIP vision") documents every file.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0, Pillow 11.1, numpy) from the
project root:
    OMP_NUM_THREADS=1 ../shared/refstack2/run python3 tests/golden/wan/make_clip_vision.py tests/golden/wan
Re-running writes byte-identical files (float32 on one CPU thread, fixed seeds, deterministic
algorithms, safetensors with sorted keys and metadata {"format": "pt"}, JSON with sorted keys).

refstack2 has no transformers: the processor and the model are plain numpy / torch transcriptions
of transformers' (PIL-backed, "slow") CLIPImageProcessor (models/clip/image_processing_clip.py,
image_transforms.py: convert_to_rgb, get_resize_output_image_size, resize, center_crop, rescale,
normalize; = CLIPImageProcessorPil in transformers 5) and CLIPVisionModel (models/clip/
modeling_clip.py: CLIPVisionEmbeddings, pre_layrnorm, CLIPEncoderLayer with eager attention,
post_layernorm; output_hidden_states as recorded by transformers). The pipeline is Diffusers' own,
unmodified: WanImageToVideoPipeline.from_pretrained(..., image_encoder=None, image_processor=None,
text_encoder=None, tokenizer=None) and then duck-typed stand-ins built on the transcriptions are put
into the instance's __dict__ (bypassing __setattr__, so model_index is untouched); its
encode_image calls them exactly as it would call transformers' classes.

Checks (the outputs do not depend on them): a numpy restatement of Pillow's BICUBIC resize
(precompute_coeffs with the a = -0.5 cubic, 22-bit fixed point, horizontal then vertical 8-bit
passes) against the pixels PIL produced; the vision tower in float64 (same code) and a second,
loop-based float64 formulation (explicit patch gather, per-head attention with an explicit softmax,
LayerNorm by mean / biased variance, erf GELU) against the float32 outputs; each image of the
batch case run alone; in the pipeline, the image embeddings the transformer got (both CFG branches)
against the transcription's, and a plain restatement of the sampling loop bit for bit.
"""
import json
import logging
import math
import os
import shutil
import sys
import time
import types
import warnings

import numpy as np
import PIL
import PIL.Image
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_text_encoder as mte  # noqa: E402
import make_transformer as mtr  # noqa: E402  (flips the transformers flag before diffusers.loaders)
import make_pipeline as mpl  # noqa: E402  (write_json, save_st, maxdiff, Capture, write_model_index)
import make_i2v as mi2v  # noqa: E402  (pass_8bpc, PRECISION_BITS: Pillow's 8-bit resample passes)
import diffusers  # noqa: E402
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel  # noqa: E402
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline  # noqa: E402

FOLDER = "tiny_wan_i2v21"
COPIES = {"transformer": "transformer_i2v", "vae": "vae", "text_encoder": "text_encoder",
          "tokenizer": "tokenizer", "scheduler": "scheduler"}

# ---- the tiny CLIPVisionModel (transformers' CLIPVisionConfig fields) ------------------------------
# Real Wan2.1-I2V-14B-*-Diffusers image_encoder (open-clip ViT-H/14 converted): hidden_size 1280,
# intermediate_size 5120, num_hidden_layers 32, num_attention_heads 16, image_size 224, patch_size
# 14, hidden_act "gelu", layer_norm_eps 1e-5, projection_dim 1024 -> 257 tokens x 1280.
# Here hidden_size = tiny_wan/transformer_i2v's image_dim (48); 28 px / 14 px = 2 x 2 patches + 1
# class token = 5 tokens.
CLIP_CONFIG = {
    "architectures": ["CLIPVisionModel"],
    "attention_dropout": 0.0,
    "dropout": 0.0,
    "hidden_act": "gelu",
    "hidden_size": 48,
    "image_size": 28,
    "initializer_factor": 1.0,
    "initializer_range": 0.02,
    "intermediate_size": 64,
    "layer_norm_eps": 1e-05,
    "model_type": "clip_vision_model",
    "num_attention_heads": 2,
    "num_channels": 3,
    "num_hidden_layers": 3,
    "patch_size": 14,
    "projection_dim": 32,
    "torch_dtype": "float32",
}
SEED_CLIP = 20270141
OPENAI_CLIP_MEAN = [0.48145466, 0.4578275, 0.40821073]
OPENAI_CLIP_STD = [0.26862954, 0.26130258, 0.27577711]
PROC_CONFIG = {
    "crop_size": {"height": 28, "width": 28},
    "do_center_crop": True,
    "do_convert_rgb": True,
    "do_normalize": True,
    "do_rescale": True,
    "do_resize": True,
    "image_mean": OPENAI_CLIP_MEAN,
    "image_processor_type": "CLIPImageProcessor",
    "image_std": OPENAI_CLIP_STD,
    "resample": 3,
    "rescale_factor": 0.00392156862745098,
    "size": {"shortest_edge": 28},
}
# Wan's real preprocessor: the same with 224 (size.shortest_edge, crop_size) - used for one
# processor-only case (`real224_*`).
PROC_CONFIG_224 = dict(PROC_CONFIG, crop_size={"height": 224, "width": 224}, size={"shortest_edge": 224})

# ---- images ----------------------------------------------------------------------------------------
SEED_IMAGES = 20270142
# name -> (H, W, mode): uint8 torch.randint(0, 256, ...) from ONE generator, drawn in this order
SOURCES = {"image_h40_w60": (40, 60, "RGB"), "image_h28_w28": (28, 28, "RGB"), "gray_h100_w30": (100, 30, "L")}
CLIP_CASES = {  # case -> (list of sources, processor config name)
    "image_h40_w60": (["image_h40_w60"], "tiny"),
    "image_h28_w28": (["image_h28_w28"], "tiny"),
    "gray_h100_w30": (["gray_h100_w30"], "tiny"),
    "batch2": (["image_h40_w60", "image_h28_w28"], "tiny"),
}
PROC_ONLY_CASES = {"real224_image_h40_w60": (["image_h40_w60"], "real224")}
PROCS = {"tiny": PROC_CONFIG, "real224": PROC_CONFIG_224}

PROMPT = "the car drives away"
SAMPLE = dict(prompt=PROMPT, negative_prompt=None, image="image_h40_w60", height=32, width=48, num_frames=5,
              num_inference_steps=3, guidance_scale=5.0, seed=0, num_videos_per_prompt=1)


def write_json(path, obj):
    mpl.write_json(path, obj)


def maxdiff(a, b):
    return mpl.maxdiff(a, b)


# ---- 1. weights and folder -------------------------------------------------------------------------

def clip_param_shapes(cfg):
    """transformers' CLIPVisionModel state-dict names and shapes (position_ids is a non-persistent
    buffer: not in the file)."""
    D, I, P, C = cfg["hidden_size"], cfg["intermediate_size"], cfg["patch_size"], cfg["num_channels"]
    n_pos = (cfg["image_size"] // P) ** 2 + 1
    s = {"vision_model.embeddings.class_embedding": [D],
         "vision_model.embeddings.patch_embedding.weight": [D, C, P, P],
         "vision_model.embeddings.position_embedding.weight": [n_pos, D],
         "vision_model.pre_layrnorm.weight": [D], "vision_model.pre_layrnorm.bias": [D],
         "vision_model.post_layernorm.weight": [D], "vision_model.post_layernorm.bias": [D]}
    for i in range(cfg["num_hidden_layers"]):
        p = f"vision_model.encoder.layers.{i}."
        for proj in ("q_proj", "k_proj", "v_proj", "out_proj"):
            s[p + f"self_attn.{proj}.weight"] = [D, D]
            s[p + f"self_attn.{proj}.bias"] = [D]
        for ln in ("layer_norm1", "layer_norm2"):
            s[p + f"{ln}.weight"] = [D]
            s[p + f"{ln}.bias"] = [D]
        s[p + "mlp.fc1.weight"] = [I, D]
        s[p + "mlp.fc1.bias"] = [I]
        s[p + "mlp.fc2.weight"] = [D, I]
        s[p + "mlp.fc2.bias"] = [D]
    return s


WEIGHT_RULES = [  # (rule key (weight_rule), description, std); tensors drawn in sorted-name order
    ("layer_norm_weight", "1 + 0.05 * randn", 0.05),
    ("class_embedding", "0.5 * randn", 0.5),
    ("position_embedding", "0.5 * randn", 0.5),
    ("patch_embedding", "0.04 * randn", 0.04),
    ("other", "0.1 * randn (linear weights, every bias, layer-norm biases)", 0.1),
]


def weight_rule(name):
    if (name.endswith("norm.weight") or name.endswith("layrnorm.weight") or ".layer_norm1.weight" in name
            or ".layer_norm2.weight" in name):
        return "layer_norm_weight"
    for key in ("class_embedding", "position_embedding", "patch_embedding"):
        if key in name:
            return key
    return "other"


def make_clip_weights(cfg, seed):
    g = torch.Generator().manual_seed(seed)
    std = {k: s for k, _, s in WEIGHT_RULES}
    w = {}
    for name, shape in sorted(clip_param_shapes(cfg).items()):
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        rule = weight_rule(name)
        w[name] = 1.0 + std[rule] * r if rule == "layer_norm_weight" else std[rule] * r
    return w


def copy_tree(src, dst):
    if os.path.islink(dst):
        os.remove(dst)
    os.makedirs(dst, exist_ok=True)
    for f in sorted(os.listdir(src)):
        shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))


def make_folder(out):
    tiny = os.path.join(out, "tiny_wan")
    dst = os.path.join(out, FOLDER)
    os.makedirs(dst, exist_ok=True)
    for sub, src in COPIES.items():
        copy_tree(os.path.join(tiny, src), os.path.join(dst, sub))
    with open(os.path.join(dst, "transformer", "config.json")) as f:
        tcfg = json.load(f)
    assert tcfg["image_dim"] == CLIP_CONFIG["hidden_size"] and tcfg["added_kv_proj_dim"] is not None, tcfg
    assert tcfg["in_channels"] == 36 and tcfg["pos_embed_seq_len"] is None, tcfg
    enc_dir = os.path.join(dst, "image_encoder")
    os.makedirs(enc_dir, exist_ok=True)
    write_json(os.path.join(enc_dir, "config.json"), CLIP_CONFIG)
    w = make_clip_weights(CLIP_CONFIG, SEED_CLIP)
    save_file({k: w[k].contiguous() for k in sorted(w)}, os.path.join(enc_dir, "model.safetensors"),
              metadata={"format": "pt"})
    proc_dir = os.path.join(dst, "image_processor")
    os.makedirs(proc_dir, exist_ok=True)
    write_json(os.path.join(proc_dir, "preprocessor_config.json"), PROC_CONFIG)
    tr = WanTransformer3DModel.from_pretrained(os.path.join(dst, "transformer"))
    vae = AutoencoderKLWan.from_pretrained(os.path.join(dst, "vae"))
    sched = UniPCMultistepScheduler.from_pretrained(os.path.join(dst, "scheduler"))
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=sched,
                                   image_processor=None, image_encoder=None, transformer=tr,
                                   transformer_2=None, boundary_ratio=None, expand_timesteps=False)
    pipe.register_to_config(image_encoder=("transformers", "CLIPVisionModel"),
                            image_processor=("transformers", "CLIPImageProcessor"))
    mpl.write_model_index(pipe, dst)
    return tcfg, sum(v.numel() for v in w.values())


# ---- 2. images and Pillow's BICUBIC restated -----------------------------------------------------------

def make_sources():
    g = torch.Generator().manual_seed(SEED_IMAGES)
    src = {}
    for name, (h, w, mode) in SOURCES.items():
        shape = (h, w, 3) if mode == "RGB" else (h, w)
        src[name] = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8).numpy()
    return src


def to_pil(arr):
    return PIL.Image.fromarray(arr, mode="RGB" if arr.ndim == 3 else "L")


def bicubic(x):
    """Pillow's bicubic_filter (Resample.c), a = -0.5, support 2."""
    a = -0.5
    x = abs(x)
    if x < 1.0:
        return ((a + 2.0) * x - (a + 3.0)) * x * x + 1
    if x < 2.0:
        return (((x - 5) * x + 8) * x - 4) * a
    return 0.0


def coeffs_bicubic(in_size, out_size):
    """Pillow's precompute_coeffs for BICUBIC (support 2 x max(scale, 1)), box = the whole input,
    then normalize_coeffs_8bpc (round half away from zero to 22 fraction bits)."""
    scale = in_size / out_size
    fscale = max(scale, 1.0)
    support = 2.0 * fscale
    rows = []
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        ss = 1.0 / fscale
        xmin = max(int(center - support + 0.5), 0)
        xmax = min(int(center + support + 0.5), in_size) - xmin
        k = [bicubic((x + xmin - center + 0.5) * ss) for x in range(xmax)]
        ww = sum(k)
        k = [v / ww if ww != 0.0 else v for v in k]
        P = mi2v.PRECISION_BITS
        ki = [int(-0.5 + v * (1 << P)) if v < 0 else int(0.5 + v * (1 << P)) for v in k]
        rows.append((xmin, ki))
    return rows


def pil_bicubic_restated(arr, width, height):
    h0, w0 = arr.shape[:2]
    if (w0, h0) == (width, height):
        return arr.copy()
    if w0 != width:
        arr = mi2v.pass_8bpc(arr, coeffs_bicubic(w0, width), 1)
    if h0 != height:
        arr = mi2v.pass_8bpc(arr, coeffs_bicubic(h0, height), 0)
    return arr


# ---- 3. CLIPImageProcessor transcribed (the PIL path) ---------------------------------------------------

def resize_output_size(h, w, shortest_edge):
    """image_transforms.get_resize_output_image_size(default_to_square=False, max_size=None)."""
    short, long = (w, h) if w <= h else (h, w)
    new_short, new_long = shortest_edge, int(shortest_edge * long / short)
    return (new_long, new_short) if w <= h else (new_short, new_long)


def process_one(img, pc):
    rec = {}
    if pc["do_convert_rgb"] and img.mode != "RGB":  # convert_to_rgb: PIL images only
        img = img.convert("RGB")
    arr = np.array(img)  # to_numpy_array: HWC uint8 (input_data_format inferred: channels last)
    rec["rgb"] = arr
    h, w = arr.shape[:2]
    if pc["do_resize"]:
        oh, ow = resize_output_size(h, w, pc["size"]["shortest_edge"])
        # image_transforms.resize: uint8 -> to_pil_image without rescale -> PIL resize((W, H), resample)
        arr = np.array(PIL.Image.fromarray(arr).resize((ow, oh), resample=pc["resample"]))
        rec["resize_hw"] = [oh, ow]
        rec["resized"] = arr
    if pc["do_center_crop"]:
        ch, cw = pc["crop_size"]["height"], pc["crop_size"]["width"]
        oh, ow = arr.shape[:2]
        top, left = (oh - ch) // 2, (ow - cw) // 2  # image_transforms.center_crop
        assert top >= 0 and left >= 0, "the zero-padding branch of center_crop is not transcribed"
        arr = arr[top:top + ch, left:left + cw]
        rec["crop_top_left"] = [top, left]
        rec["cropped"] = arr
    x = arr
    if pc["do_rescale"]:  # image_transforms.rescale: float64 product, then float32
        x = (x.astype(np.float64) * pc["rescale_factor"]).astype(np.float32)
    if pc["do_normalize"]:  # image_transforms.normalize: float32 (x - mean) / std, channels last
        x = (x - np.array(pc["image_mean"], dtype=x.dtype)) / np.array(pc["image_std"], dtype=x.dtype)
    x = x.transpose(2, 0, 1)  # to_channel_dimension_format(FIRST)
    return x, rec


def clip_processor(images, pc):
    images = images if isinstance(images, (list, tuple)) else [images]
    outs, recs = zip(*[process_one(im, pc) for im in images])
    return torch.from_numpy(np.stack(outs)), list(recs)  # BatchFeature(tensor_type="pt")


# ---- 4. CLIPVisionModel transcribed ---------------------------------------------------------------

def clip_forward(w, cfg, pixel_values, dtype=torch.float32, softmax_dtype=torch.float32):
    """CLIPVisionModel.forward(pixel_values, output_hidden_states=True), eager attention (its softmax
    is ALWAYS float32, then cast back to the query dtype; softmax_dtype=float64 is only for the
    float64 check). Returns (hidden_states list [L + 1], last_hidden_state, pooler_output, extras)."""
    W = {k: v.to(dtype) for k, v in w.items()}
    D, H = cfg["hidden_size"], cfg["num_attention_heads"]
    hd, eps, P = D // H, cfg["layer_norm_eps"], cfg["patch_size"]
    x = pixel_values.to(dtype)
    B = x.shape[0]
    assert x.shape[-2:] == (cfg["image_size"], cfg["image_size"])
    pre = "vision_model."
    patch = F.conv2d(x, W[pre + "embeddings.patch_embedding.weight"], stride=P)  # no bias
    patch = patch.flatten(2).transpose(1, 2)  # [B, g*g, D], row-major over the patch grid
    cls = W[pre + "embeddings.class_embedding"].expand(B, 1, -1)
    emb = torch.cat([cls, patch], dim=1)
    n_pos = W[pre + "embeddings.position_embedding.weight"].shape[0]
    emb = emb + F.embedding(torch.arange(n_pos).expand(1, -1), W[pre + "embeddings.position_embedding.weight"])
    hs = F.layer_norm(emb, (D,), W[pre + "pre_layrnorm.weight"], W[pre + "pre_layrnorm.bias"], eps)
    states = [hs]
    for i in range(cfg["num_hidden_layers"]):
        p = f"{pre}encoder.layers.{i}."
        res = hs
        h = F.layer_norm(hs, (D,), W[p + "layer_norm1.weight"], W[p + "layer_norm1.bias"], eps)
        S = h.shape[1]

        def proj(name, t):
            return F.linear(t, W[p + f"self_attn.{name}.weight"], W[p + f"self_attn.{name}.bias"])
        q = proj("q_proj", h).view(B, S, -1, hd).transpose(1, 2)
        k = proj("k_proj", h).view(B, S, -1, hd).transpose(1, 2)
        v = proj("v_proj", h).view(B, S, -1, hd).transpose(1, 2)
        a = torch.matmul(q, k.transpose(-1, -2)) * (hd ** -0.5)
        a = F.softmax(a, dim=-1, dtype=softmax_dtype).to(q.dtype)
        o = torch.matmul(a, v).transpose(1, 2).contiguous().reshape(B, S, -1).contiguous()
        hs = res + proj("out_proj", o)
        res = hs
        h = F.layer_norm(hs, (D,), W[p + "layer_norm2.weight"], W[p + "layer_norm2.bias"], eps)
        h = F.linear(h, W[p + "mlp.fc1.weight"], W[p + "mlp.fc1.bias"])
        h = F.gelu(h)  # ACT2FN["gelu"] = GELUActivation = exact erf GELU
        h = F.linear(h, W[p + "mlp.fc2.weight"], W[p + "mlp.fc2.bias"])
        hs = res + h
        states.append(hs)
    last = hs
    pooled = F.layer_norm(last[:, 0, :], (D,), W[pre + "post_layernorm.weight"], W[pre + "post_layernorm.bias"], eps)
    return states, last, pooled, {"embeddings": emb, "patch_embeds": patch}


def clip_loop64(w, cfg, pixel_values):
    """A second formulation in float64: explicit patch gather (c, ky, kx order), per-token, per-head
    attention with exp(s - max) / sum, LayerNorm by mean and biased variance, erf GELU."""
    W = {k: v.double() for k, v in w.items()}
    D, H, P = cfg["hidden_size"], cfg["num_attention_heads"], cfg["patch_size"]
    hd, eps, g = D // H, cfg["layer_norm_eps"], cfg["image_size"] // P
    pre = "vision_model."

    def ln(v, name):
        mu = v.mean()
        var = ((v - mu) ** 2).mean()
        return (v - mu) / math.sqrt(float(var) + eps) * W[name + ".weight"] + W[name + ".bias"]

    def lin(v, name):
        return W[name + ".weight"] @ v + W[name + ".bias"]
    out = []
    for b in range(pixel_values.shape[0]):
        x = pixel_values[b].double()
        toks = [W[pre + "embeddings.class_embedding"]]
        wp = W[pre + "embeddings.patch_embedding.weight"].reshape(D, -1)
        for gy in range(g):
            for gx in range(g):
                toks.append(wp @ x[:, gy * P:(gy + 1) * P, gx * P:(gx + 1) * P].reshape(-1))
        toks = [t + W[pre + "embeddings.position_embedding.weight"][j] for j, t in enumerate(toks)]
        hs = [ln(t, pre + "pre_layrnorm") for t in toks]
        states = [torch.stack(hs)]
        for i in range(cfg["num_hidden_layers"]):
            p = f"{pre}encoder.layers.{i}."
            hn = [ln(t, p + "layer_norm1") for t in hs]
            q = [lin(t, p + "self_attn.q_proj") for t in hn]
            k = [lin(t, p + "self_attn.k_proj") for t in hn]
            v = [lin(t, p + "self_attn.v_proj") for t in hn]
            new = []
            for s in range(len(hs)):
                heads = []
                for hh in range(H):
                    sl = slice(hh * hd, (hh + 1) * hd)
                    sc = [float(q[s][sl] @ k[j][sl]) / math.sqrt(hd) for j in range(len(hs))]
                    m = max(sc)
                    e = [math.exp(c - m) for c in sc]
                    z = sum(e)
                    heads.append(sum((e[j] / z) * v[j][sl] for j in range(len(hs))))
                new.append(hs[s] + lin(torch.cat(heads), p + "self_attn.out_proj"))
            hs = new
            new = []
            for t in hs:
                u = lin(ln(t, p + "layer_norm2"), p + "mlp.fc1")
                u = torch.tensor([0.5 * float(c) * (1.0 + math.erf(float(c) / math.sqrt(2.0))) for c in u],
                                 dtype=torch.float64)
                new.append(t + lin(u, p + "mlp.fc2"))
            hs = new
            states.append(torch.stack(hs))
        out.append(torch.stack(states))
    return torch.stack(out, dim=1)  # [L + 1, B, S, D]


# ---- 5. the clip cases -------------------------------------------------------------------------------

def processor_arithmetic():
    """Exhaustive over the 256 uint8 values: which float32 formulas reproduce rescale + normalize."""
    x = np.arange(256)
    ref = (x.astype(np.float64) * PROC_CONFIG["rescale_factor"]).astype(np.float32)
    div = x.astype(np.float32) / np.float32(255)
    mul = x.astype(np.float32) * np.float32(1 / 255)
    res = {"rescale_f64_product_vs_f32_x_div_255_values_differing": int((ref != div).sum()),
           "rescale_f64_product_vs_f32_x_mul_f32_1_over_255_values_differing": int((ref != mul).sum())}
    m = np.array(OPENAI_CLIP_MEAN, dtype=np.float32)
    sd = np.array(OPENAI_CLIP_STD, dtype=np.float32)
    norm = (ref[:, None] - m) / sd
    res["normalize_div_std_vs_mul_f32_reciprocal_values_differing"] = int((norm != (ref[:, None] - m)
                                                                          * (np.float32(1) / sd)).sum())
    fused = (x.astype(np.float32)[:, None] - m * np.float32(255)) / (sd * np.float32(255))
    res["normalize_vs_fused_255_form_values_differing"] = int((norm != fused).sum())
    res["normalize_vs_fused_255_form_maxdiff"] = float(np.abs(norm - fused).max())
    res["values_total"] = 256 * 3
    return res


def make_clip_cases(w, sources, tensors, checks):
    cases = {}
    for name, (srcs, proc) in list(CLIP_CASES.items()) + list(PROC_ONLY_CASES.items()):
        pc = PROCS[proc]
        imgs = [to_pil(sources[s]) for s in srcs]
        pv, recs = clip_processor(imgs, pc)
        p = f"{name}."
        ch = {}
        px = []
        for j, (s, r) in enumerate(zip(srcs, recs)):
            if len(srcs) == 1:  # the batch case's images are the single cases' (not stored twice)
                tensors[p + "source"] = torch.from_numpy(sources[s].copy())
                tensors[p + "rgb"] = torch.from_numpy(r["rgb"].copy())
                tensors[p + "resized"] = torch.from_numpy(np.ascontiguousarray(r["resized"]))
                tensors[p + "cropped"] = torch.from_numpy(np.ascontiguousarray(r["cropped"]))
            oh, ow = r["resize_hw"]
            re = pil_bicubic_restated(r["rgb"], ow, oh)
            # the float path a C++ port might take: x / 255 in float32 instead of float64 * (1/255)
            c32 = torch.from_numpy(r["cropped"].astype(np.float32))
            alt = ((c32 / 255.0 - torch.tensor(pc["image_mean"])) / torch.tensor(pc["image_std"])).permute(2, 0, 1)
            # transformers 5's torchvision backend fuses rescale into normalize: (x - 255 mean) / (255 std)
            fused = ((c32 - torch.tensor(pc["image_mean"]) * (1.0 / pc["rescale_factor"]))
                     / (torch.tensor(pc["image_std"]) * (1.0 / pc["rescale_factor"]))).permute(2, 0, 1)
            px.append({
                "source": s,
                "source_hw": list(sources[s].shape[:2]), "source_mode": SOURCES[s][2],
                "resize_hw": [oh, ow], "crop_top_left": r["crop_top_left"],
                "pil_bicubic_restated_maxdiff": int(np.abs(re.astype(int) - r["resized"].astype(int)).max()),
                "gray_channels_equal": bool(np.array_equal(r["rgb"][..., 0], r["rgb"][..., 1])
                                            and np.array_equal(r["rgb"][..., 1], r["rgb"][..., 2])),
                "rgb_equals_source": bool(np.array_equal(r["rgb"], sources[s])) if sources[s].ndim == 3 else None,
                "x_over_255_float32_path_maxdiff": maxdiff(alt, pv[j]),
                "x_over_255_float32_path_values_differing": int((alt != pv[j]).sum()),
                "fused_torchvision_style_normalize_maxdiff": maxdiff(fused, pv[j]),
            })
            assert px[-1]["pil_bicubic_restated_maxdiff"] == 0, px[-1]
        tensors[p + "pixel_values"] = pv
        ch["pixels"] = px
        entry = {"sources": srcs, "processor": "image_processor/preprocessor_config.json" if proc == "tiny"
                 else "PROC_CONFIG_224 (Wan's real processor: shortest_edge 224, crop 224x224; not a file)",
                 "pixel_values_shape": list(pv.shape)}
        if name in CLIP_CASES:
            states, last, pooled, ex = clip_forward(w, CLIP_CONFIG, pv)
            hs = torch.stack(states)
            tensors[p + "embeddings"] = ex["embeddings"]
            tensors[p + "patch_embeds"] = ex["patch_embeds"]
            tensors[p + "hidden_states"] = hs
            tensors[p + "image_embeds"] = states[-2]
            tensors[p + "last_hidden_state"] = last
            tensors[p + "pooler_output"] = pooled
            s64, l64, pl64, _ = clip_forward(w, CLIP_CONFIG, pv.double(), torch.float64, torch.float64)
            loop = clip_loop64(w, CLIP_CONFIG, pv)
            ch["float64_same_code_hidden_states_maxdiff"] = maxdiff(torch.stack(s64), hs)
            ch["float64_same_code_pooler_maxdiff"] = maxdiff(pl64, pooled)
            ch["loop64_vs_float64_maxdiff"] = maxdiff(loop, torch.stack(s64))
            ch["loop64_vs_float32_maxdiff"] = maxdiff(loop, hs)
            ch["last_hidden_state_is_hidden_states_last"] = bool(torch.equal(last, states[-1]))
            ch["hidden_state_abs_max"] = float(hs.abs().max())
            assert ch["loop64_vs_float64_maxdiff"] < 1e-10 and ch["float64_same_code_hidden_states_maxdiff"] < 1e-4, ch
            if len(srcs) > 1:
                single = [tensors[f"{s}.hidden_states"] for s in srcs]
                ch["batch_rows_vs_single_maxdiff"] = max(maxdiff(hs[:, j:j + 1], single[j]) for j in range(len(srcs)))
                ch["batch_pixel_values_vs_single_equal"] = all(
                    torch.equal(pv[j:j + 1], tensors[f"{s}.pixel_values"]) for j, s in enumerate(srcs))
            entry["shapes"] = {k[len(p):]: list(v.shape) for k, v in tensors.items() if k.startswith(p)}
        else:
            entry["shapes"] = {k[len(p):]: list(v.shape) for k, v in tensors.items() if k.startswith(p)}
        entry["dtypes"] = {k[len(p):]: str(v.dtype).replace("torch.", "") for k, v in tensors.items() if k.startswith(p)}
        entry["per_image"] = [{k: v for k, v in d.items() if k in ("source", "source_hw", "source_mode",
                                                                     "resize_hw", "crop_top_left")} for d in px]
        cases[name] = entry
        checks[name] = ch
    return cases


# ---- 6. the pipeline with stand-ins ----------------------------------------------------------------

class ProcessorOutput(dict):
    """What BatchFeature gives encode_image: `.to(device)`, then `**` unpacking."""

    def to(self, device):
        return self


class ImageProcessorStandIn:
    def __init__(self, pc):
        self.pc, self.calls = pc, []

    def __call__(self, images=None, return_tensors=None, **kw):
        assert return_tensors == "pt" and not kw, (return_tensors, kw)
        ims = list(images) if isinstance(images, (list, tuple)) else [images]
        pv, recs = clip_processor(images, self.pc)
        self.calls.append({"images_arg_is_list": isinstance(images, (list, tuple)),
                           "sizes_wh": [list(im.size) for im in ims], "modes": [im.mode for im in ims],
                           "pixel_values": pv.clone()})
        return ProcessorOutput(pixel_values=pv)


class ImageEncoderStandIn:
    def __init__(self, w, cfg):
        self.w, self.cfg, self.calls = w, cfg, []

    def __call__(self, pixel_values=None, output_hidden_states=None, **kw):
        assert output_hidden_states is True and not kw, (output_hidden_states, kw)
        states, last, pooled, _ = clip_forward(self.w, self.cfg, pixel_values)
        self.calls.append({"pixel_values": pixel_values.clone(), "hidden_states": torch.stack(states)})
        return types.SimpleNamespace(hidden_states=tuple(states), last_hidden_state=last, pooler_output=pooled)


def load_pipe(out, tok, enc, proc, img_enc):
    folder = os.path.join(out, FOLDER)
    pipe = WanImageToVideoPipeline.from_pretrained(folder, text_encoder=None, tokenizer=None,
                                                   image_encoder=None, image_processor=None)
    assert pipe.transformer.config.image_dim == CLIP_CONFIG["hidden_size"] and pipe.transformer_2 is None
    pipe.__dict__.update(tokenizer=tok, text_encoder=enc, image_processor=proc, image_encoder=img_enc)
    pipe.set_progress_bar_config(disable=True)
    load = {"explicit_none": "ok"}
    try:  # without naming the image components: Diffusers tries transformers (a stub here)
        WanImageToVideoPipeline.from_pretrained(folder, text_encoder=None, tokenizer=None)
        load["image_components_not_named"] = "ok"
    except Exception as e:  # noqa: BLE001
        # which of the two components is named first varies from run to run (set order): type only
        assert "cannot be loaded as it does not seem to have any of the loading methods" in str(e), e
        load["image_components_not_named"] = (f"{type(e).__name__}: the component <transformers.CLIPVisionModel | "
                                              "CLIPImageProcessor> cannot be loaded (refstack2's transformers stub)")
    return pipe, load


def run_pipe(pipe, kw, seed, output_type):
    rec = {"calls": []}
    handles = []

    def pre(mod, args, kwargs):
        rec["calls"].append({k: (kwargs[k].clone() if isinstance(kwargs.get(k), torch.Tensor) else kwargs.get(k))
                             for k in ("hidden_states", "timestep", "encoder_hidden_states",
                                       "encoder_hidden_states_image")})

    def post(mod, args, kwargs, output):
        rec["calls"][-1]["out"] = output[0].clone()
    handles.append(pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True))
    handles.append(pipe.transformer.register_forward_hook(post, with_kwargs=True))
    vae = pipe.vae
    o_enc, o_dec = vae.encode, vae.decode
    rec["encode"], rec["decode"] = [], []

    def encode(x, *a, **k):
        res = o_enc(x, *a, **k)
        rec["encode"].append({"x": x.clone(), "mode": res.latent_dist.mode().clone()})
        return res

    def decode(z, *a, **k):
        res = o_dec(z, *a, **k)
        rec["decode"].append({"z": z.clone(), "sample": res[0].clone()})
        return res
    vae.encode, vae.decode = encode, decode
    pipe.image_processor.calls.clear()
    pipe.image_encoder.calls.clear()
    cap = mpl.Capture()
    lg = logging.getLogger("diffusers")
    lg.addHandler(cap)
    try:
        with warnings.catch_warnings(record=True) as wlist:
            warnings.simplefilter("always")
            gen = torch.Generator("cpu").manual_seed(seed)
            res = pipe(**kw, generator=gen, output_type=output_type, return_dict=True)
    finally:
        lg.removeHandler(cap)
        for h in handles:
            h.remove()
        del vae.__dict__["encode"], vae.__dict__["decode"]
    rec["logs"] = cap.records
    rec["warnings"] = [{"category": x.category.__name__, "message": str(x.message)} for x in wlist]
    rec["timesteps"] = [int(t) for t in pipe.scheduler.timesteps]
    rec["sigmas"] = [float(v) for v in pipe.scheduler.sigmas]
    rec["proc_calls"] = list(pipe.image_processor.calls)
    rec["enc_calls"] = list(pipe.image_encoder.calls)
    return res.frames, rec


@torch.no_grad()
def restated(pipe, c, src, pe, ne, img_emb):
    """The Wan 2.1 I2V sampling restated (not calling __call__ / prepare_latents): the same image
    embeddings in the cond and uncond calls."""
    H, W, nf = c["height"], c["width"], c["num_frames"]
    px = mi2v.pil_lanczos_restated(src, W, H)
    img = torch.from_numpy(px.astype(np.float32) / 255.0).permute(2, 0, 1)[None] * 2.0 - 1.0
    T, h, w = (nf - 1) // 4 + 1, H // 8, W // 8
    lat = torch.randn((1, 16, T, h, w), generator=torch.Generator().manual_seed(c["seed"]))
    vc = torch.zeros(1, 3, nf, H, W)
    vc[:, :, 0] = img[0]
    z = pipe.vae.encode(vc).latent_dist.mode()
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 16, 1, 1, 1)
    mask = torch.zeros(1, 4, T, h, w)
    mask[:, :, 0] = 1.0
    cond = torch.cat([mask, (z - mean) * inv_std], dim=1)
    s = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    s.set_timesteps(c["num_inference_steps"])
    s.set_begin_index(0)
    m = pipe.transformer
    for t in s.timesteps:
        x = torch.cat([lat, cond], dim=1)
        v = m(hidden_states=x, timestep=t.expand(1), encoder_hidden_states=pe,
              encoder_hidden_states_image=img_emb, return_dict=False)[0]
        vu = m(hidden_states=x, timestep=t.expand(1), encoder_hidden_states=ne,
               encoder_hidden_states_image=img_emb, return_dict=False)[0]
        v = vu + c["guidance_scale"] * (v - vu)
        lat = s.step(v, t, lat, return_dict=False)[0]
    video = pipe.vae.decode(lat / inv_std + mean, return_dict=False)[0]
    frames = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().numpy()
    return lat, frames


def run_sample(pipe, tok, enc, sources, clip_tensors):
    c = SAMPLE
    tensors, checks = {}, {}
    pe, ne, info, ninfo = mte.encode_prompt(tok, enc, c["prompt"], c["negative_prompt"], True, 1, 512)
    src = sources[c["image"]]
    kw = {k: v for k, v in c.items() if k not in ("seed", "image", "prompt", "negative_prompt")}
    kw.update(image=to_pil(src), prompt_embeds=pe, negative_prompt_embeds=ne)
    frames, rec = run_pipe(pipe, kw, c["seed"], "np")
    lat_out, rec_l = run_pipe(pipe, kw, c["seed"], "latent")
    calls = rec["calls"]
    n = c["num_inference_steps"]
    assert len(calls) == 2 * n == len(rec_l["calls"]) and len(rec["decode"]) == 1 and not rec_l["decode"]
    for a, b in zip(calls, rec_l["calls"]):
        assert torch.equal(a["out"], b["out"])
    assert len(rec["proc_calls"]) == 1 and len(rec["enc_calls"]) == 1
    pv = rec["proc_calls"][0]["pixel_values"]
    img_emb = calls[0]["encoder_hidden_states_image"]
    assert torch.equal(pv, clip_tensors[f"{c['image']}.pixel_values"])
    assert torch.equal(img_emb, clip_tensors[f"{c['image']}.image_embeds"])
    assert all(torch.equal(cc["encoder_hidden_states_image"], img_emb) for cc in calls)
    cond = calls[0]["hidden_states"][:, 16:]
    lat_in, v_c, v_u, v_g = [], [], [], []
    for i in range(n):
        cc, cu = calls[2 * i], calls[2 * i + 1]
        assert torch.equal(cc["hidden_states"], cu["hidden_states"]) and torch.equal(cc["hidden_states"][:, 16:], cond)
        assert torch.equal(cc["encoder_hidden_states"], pe) and torch.equal(cu["encoder_hidden_states"], ne)
        lat_in.append(cc["hidden_states"][:, :16])
        v_c.append(cc["out"])
        v_u.append(cu["out"])
        v_g.append(cu["out"] + c["guidance_scale"] * (cc["out"] - cu["out"]))
    tensors["source_image"] = torch.from_numpy(src.copy())
    tensors["clip_pixel_values"] = pv
    tensors["image_embeds"] = img_emb
    tensors["prompt_embeds"] = pe
    tensors["negative_prompt_embeds"] = ne
    tensors["video_condition"] = rec["encode"][0]["x"]
    tensors["condition"] = cond
    tensors["latents_init"] = lat_in[0]
    tensors["latents_steps"] = torch.stack(lat_in + [lat_out])
    tensors["noise_pred_cond"] = torch.stack(v_c)
    tensors["noise_pred_uncond"] = torch.stack(v_u)
    tensors["noise_pred"] = torch.stack(v_g)
    tensors["latents_final"] = lat_out
    tensors["latents_denormalized"] = rec["decode"][0]["z"]
    tensors["frames"] = torch.from_numpy(frames.copy())
    r_lat, r_frames = restated(pipe, c, src, pe, ne, clip_tensors[f"{c['image']}.image_embeds"])
    # what the image branch changes: the same call with zero image embeddings / without the branch
    with torch.no_grad():
        x0, t0 = calls[0]["hidden_states"], calls[0]["timestep"]
        base = calls[0]["out"]
        zero = pipe.transformer(hidden_states=x0, timestep=t0, encoder_hidden_states=pe,
                                encoder_hidden_states_image=torch.zeros_like(img_emb), return_dict=False)[0]
        try:
            o = pipe.transformer(hidden_states=x0, timestep=t0, encoder_hidden_states=pe, return_dict=False)[0]
            without = {"exception": None, "finite": bool(torch.isfinite(o).all()),
                       "maxdiff_vs_zero_image_embeds": maxdiff(o, zero), "maxdiff_vs_with_image_embeds": maxdiff(o, base)}
        except Exception as e:  # noqa: BLE001
            without = {"exception": type(e).__name__, "message": str(e)[:200]}
    g = torch.Generator().manual_seed(c["seed"])
    checks.update({
        "initial_noise_is_randn_of_seed": bool(torch.equal(lat_in[0], torch.randn(lat_in[0].shape, generator=g))),
        "image_embeds_equal_clip_case": True,
        "image_embeds_same_in_cond_and_uncond_calls": True,
        "restated_latents_maxdiff": maxdiff(r_lat, lat_out),
        "restated_frames_maxdiff": float(np.abs(r_frames - frames).max()),
        "first_call_out_with_zero_image_embeds_maxdiff": maxdiff(zero, base),
        "transformer_call_without_image_embeds": without,
        "mask_channels_per_latent_frame": cond[0, :4, :, 0, 0].t().tolist(),
    })
    assert checks["restated_latents_maxdiff"] == 0.0 and checks["restated_frames_maxdiff"] == 0.0, checks
    # error cases
    errors = {}

    def attempt(name, desc, **extra):
        kw2 = dict(kw, num_inference_steps=1)
        kw2.update(extra)
        try:
            pipe(**kw2, generator=torch.Generator().manual_seed(0), output_type="latent")
            errors[name] = {"arguments": desc, "exception": None}
        except Exception as e:  # noqa: BLE001
            msg = str(e)
            if name == "image_and_image_embeds":
                msg = msg.split(":")[0]  # the message goes on with the reprs of the image and tensor
            errors[name] = {"arguments": desc, "exception": type(e).__name__, "message": msg[:300]}
    attempt("image_and_image_embeds", "sample's, image=PIL and image_embeds=<image_embeds>, 1 step",
            image_embeds=img_emb)
    attempt("image_embeds_without_image", "sample's, image=None, image_embeds=<image_embeds>, 1 step",
            image=None, image_embeds=img_emb)
    attempt("flf2v_without_pos_embed", "sample's + last_image=PIL(source image_h28_w28), 1 step",
            last_image=to_pil(sources["image_h28_w28"]))
    kw3 = {k: v for k, v in kw.items() if k not in ("prompt_embeds", "negative_prompt_embeds")}
    try:
        pipe(**dict(kw3, num_inference_steps=1), prompt=c["prompt"], generator=torch.Generator().manual_seed(0),
             output_type="latent")
        errors["string_prompt"] = {"exception": None}
    except NameError as e:
        errors["string_prompt"] = {"arguments": "sample's, prompt=the string instead of prompt_embeds",
                                   "exception": "NameError", "message": str(e)}
    args = {k: v for k, v in c.items()}
    args["image"] = f"source_image (PIL.Image.fromarray(uint8 [40, 60, 3], mode='RGB'), = clip case {c['image']})"
    meta = {
        "arguments": args,
        "call": ("WanImageToVideoPipeline.__call__(image=PIL, height, width, num_frames, num_inference_steps, "
                 "guidance_scale, num_videos_per_prompt, prompt_embeds=<prompt_embeds>, negative_prompt_embeds="
                 "<negative_prompt_embeds>, generator=torch.Generator('cpu').manual_seed(seed), output_type='np' "
                 "| 'latent'); image_embeds NOT passed: encode_image runs the image_processor / image_encoder "
                 "stand-ins (transcriptions) on the ORIGINAL PIL image"),
        "defaults_in_effect": {"max_sequence_length": 512, "negative_prompt_used": "",
                               "do_classifier_free_guidance": True, "latents": None, "last_image": None,
                               "guidance_scale_2": None, "image_embeds": None},
        "cleaned_prompt": info["cleaned"][0], "seq_len": info["seq_lens"][0], "negative_seq_len": ninfo["seq_lens"][0],
        "image_processor_calls": [{k: v for k, v in pc.items() if k != "pixel_values"} for pc in rec["proc_calls"]],
        "image_encoder_calls": len(rec["enc_calls"]),
        "encoder_hidden_states_image_per_call": "image_embeds (identical tensor values) in all 6 calls, cond and uncond",
        "scheduler_timesteps": rec["timesteps"],
        "scheduler_sigmas": rec["sigmas"],
        "transformer_timesteps": [cc["timestep"].tolist() for cc in calls[::2]],
        "log_records": rec["logs"], "warnings": rec["warnings"],
        "shapes": {k: list(v.shape) for k, v in tensors.items()},
        "dtypes": {k: str(v.dtype).replace("torch.", "") for k, v in tensors.items()},
        "frames_range": [float(frames.min()), float(frames.max())],
    }
    return tensors, meta, checks, errors


def main(out):
    t0 = time.time()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_warning()
    tcfg, n_clip = make_folder(out)
    dst = os.path.join(out, FOLDER)
    w = load_file(os.path.join(dst, "image_encoder", "model.safetensors"))
    sources = make_sources()
    clip_tensors, clip_checks = {}, {}
    clip_cases = make_clip_cases(w, sources, clip_tensors, clip_checks)
    mpl.save_st(os.path.join(dst, "clip_cases.safetensors"), clip_tensors)
    write_json(os.path.join(dst, "clip_cases.json"), {
        "clip_config": CLIP_CONFIG, "clip_seed": SEED_CLIP, "clip_params": n_clip,
        "weight_rules": {k: r for k, r, _ in WEIGHT_RULES},
        "processor_config": PROC_CONFIG, "processor_config_real224": PROC_CONFIG_224,
        "image_seed": SEED_IMAGES,
        "image_sources": {k: {"height": h, "width": ww, "mode": m,
                              "rule": "torch.randint(0, 256, (H, W, 3) for RGB | (H, W) for L, uint8), one "
                                      "generator seeded image_seed, drawn in this order; passed as "
                                      "PIL.Image.fromarray(arr, mode)"}
                          for k, (h, ww, m) in SOURCES.items()},
        "image_embeds_rule": "hidden_states[-2] = output of encoder layer num_hidden_layers - 2 (0-based)",
        "hidden_states_rule": ("hidden_states[0] = pre_layrnorm(embeddings); hidden_states[i] = output of encoder "
                               "layer i - 1; last_hidden_state = hidden_states[-1] (no layer norm); "
                               "pooler_output = post_layernorm(last_hidden_state[:, 0])"),
        "cases": clip_cases, "checks": clip_checks, "processor_arithmetic": processor_arithmetic(),
        "pillow_version": PIL.__version__, "torch_version": torch.__version__, "numpy_version": np.__version__,
    })
    tiny = os.path.join(out, "tiny_wan")
    tok_dir = os.path.join(dst, "tokenizer")
    with open(os.path.join(tok_dir, "spiece.model"), "rb") as f:
        model_bytes = f.read()
    with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tok_cfg = json.load(f)
    tok = mte.T5TokenizerSlow(model_bytes, tok_cfg)
    enc = mte.Encoder(load_file(os.path.join(dst, "text_encoder", "model.safetensors")), torch.float32)
    proc = ImageProcessorStandIn(PROC_CONFIG)
    img_enc = ImageEncoderStandIn(w, CLIP_CONFIG)
    pipe, load = load_pipe(out, tok, enc, proc, img_enc)
    s_tensors, s_meta, s_checks, errors = run_sample(pipe, tok, enc, sources, clip_tensors)
    mpl.save_st(os.path.join(dst, "sample_i2v21.safetensors"), s_tensors)
    vcfg = mpl.pipes_cfg(tiny)
    write_json(os.path.join(dst, "sample_i2v21.json"), {
        "pipeline": "WanImageToVideoPipeline", "diffusers_version": diffusers.__version__,
        "torch_version": torch.__version__, "pillow_version": PIL.__version__,
        "transformer_config": {k: v for k, v in tcfg.items() if not k.startswith("_")},
        "transformer_source": "copy of tiny_wan/transformer_i2v (make_transformer.py, seed 20270102)",
        "clip_config": CLIP_CONFIG, "processor_config": PROC_CONFIG,
        "load_checks": load,
        "text_side": ("make_text_encoder.py's T5TokenizerSlow and UMT5 transcription (float32) over "
                      "tiny_wan_i2v21/tokenizer and tiny_wan_i2v21/text_encoder (copies of tiny_wan's)"),
        "image_side": ("make_clip_vision.py's CLIPImageProcessor / CLIPVisionModel transcriptions over "
                       "tiny_wan_i2v21/image_processor and tiny_wan_i2v21/image_encoder, called by "
                       "encode_image through duck-typed stand-ins"),
        "cfg_image_embeds": ("the uncond call gets the SAME encoder_hidden_states_image as the cond call "
                             "(pipeline_wan_i2v.py 772-792); only encoder_hidden_states changes "
                             "(prompt_embeds / negative_prompt_embeds); there is no negative image"),
        "vae_latents_mean": vcfg["latents_mean"], "vae_latents_std": vcfg["latents_std"],
        "case": s_meta, "checks": s_checks, "error_cases": errors,
    })
    print("clip checks:", json.dumps(clip_checks)[:3000])
    print("sample checks:", json.dumps(s_checks))
    print("errors:", json.dumps(errors))
    print("load:", load)
    for f in ("clip_cases.safetensors", "sample_i2v21.safetensors"):
        print(f, os.path.getsize(os.path.join(dst, f)))
    print(f"time {time.time() - t0:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_clip_vision.py OUT_DIR  (tests/golden/wan)")
    main(sys.argv[1])
