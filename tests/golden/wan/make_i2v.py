#!/usr/bin/env python3
"""Makes Wan's image-to-video sampling references (the Wan 2.2 A14B I2V style: no CLIP image
encoder; the first frame's VAE latents concatenated with a mask):
  tiny_wan_i2v/model_index.json              WanImageToVideoPipeline, image_encoder / image_processor /
                                             transformer_2 null, boundary_ratio null, expand_timesteps false
  tiny_wan_i2v/transformer/                  WanTransformer3DModel, in_channels 36 (16 noise + 4 mask + 16
                                             condition), out_channels 16, no image_dim / added_kv_proj_dim
  tiny_wan_i2v/{vae,text_encoder,tokenizer,scheduler}  relative symlinks to ../tiny_wan/*
  tiny_wan_i2v/sample_i2v.safetensors + .json  WanImageToVideoPipeline.__call__ end to end
README.md ("## Image to video (make_i2v.py)") documents every file.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0, Pillow 11.1) from the project root:
    OMP_NUM_THREADS=1 ../shared/refstack2/run python3 tests/golden/wan/make_i2v.py tests/golden/wan
Re-running writes byte-identical files (float32 on one CPU thread, fixed seeds, safetensors with
sorted keys and metadata {"format": "pt"}, JSON with sorted keys).

Everything Diffusers does is run unmodified: WanImageToVideoPipeline.from_pretrained(...) and
__call__; the text side is make_text_encoder.py's duck-typed stand-ins (as in make_pipeline.py).
Observers only: forward pre-hooks / hooks on the transformer, and instance-level wrappers around
pipe.video_processor.resize / .preprocess and pipe.vae.encode / .decode that record their inputs
and outputs and return them unchanged.

Checks (the files do not depend on them): a plain-numpy restatement of Pillow's LANCZOS resize
(precompute_coeffs + 8-bit fixed-point passes, horizontal then vertical) against the pixels the
pipeline used; a plain restatement of the whole I2V sampling (preprocess, video_condition,
vae.encode mode, normalisation, mask, concat, loop with CFG, de-normalisation, decode,
postprocess) against the pipeline, bit for bit.
"""
import json
import logging
import math
import os
import sys
import warnings

import numpy as np
import PIL
import PIL.Image
import torch
from safetensors.torch import load_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_text_encoder as mte  # noqa: E402
import make_transformer as mtr  # noqa: E402  (flips the transformers flag before diffusers.loaders)
import make_pipeline as mpl  # noqa: E402  (write_json, save_st, maxdiff, relink, Capture, WAN_SCHEDULER)
import diffusers  # noqa: E402
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel  # noqa: E402
from diffusers.pipelines.wan import pipeline_wan_i2v  # noqa: E402
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline  # noqa: E402

# Wan2.2-I2V-A14B-Diffusers' transformer layout narrowed like tiny_wan/transformer: in_channels 36,
# and (unlike Wan 2.1 I2V) no CLIP image branch.
I2V22 = dict(mtr.T2V, in_channels=36, out_channels=16, image_dim=None, added_kv_proj_dim=None)
SEED_TRANSFORMER = 20270105
SEED_IMAGES = 20270131
FOLDER = "tiny_wan_i2v"
PROMPT = "the car drives away"
BASE = dict(prompt=PROMPT, negative_prompt=None, height=32, width=48, num_frames=5, num_inference_steps=3,
            guidance_scale=5.0, seed=0, num_videos_per_prompt=1)
# image sources: name -> (width, height) of a seeded uniform-random uint8 RGB image
SOURCES = {"image_48x32": (48, 32), "image_60x40": (60, 40), "last_image_48x32": (48, 32)}
CASES = {
    "i2v": dict(BASE, image="image_48x32"),
    "i2v_resize": dict(BASE, image="image_60x40"),
    "i2v_nocfg": dict(BASE, image="image_48x32", guidance_scale=1.0),
    "flf2v": dict(BASE, image="image_48x32", last_image="last_image_48x32"),
}


# ---- 1. folder -----------------------------------------------------------------------------------

def make_folder(out):
    tiny = os.path.join(out, "tiny_wan")
    dst = os.path.join(out, FOLDER)
    os.makedirs(dst, exist_ok=True)
    for sub in ("vae", "text_encoder", "tokenizer", "scheduler"):
        mpl.relink(os.path.join(dst, sub), f"../tiny_wan/{sub}")
    torch.manual_seed(0)  # Diffusers' scale_shift_table init draws from the global RNG (overwritten)
    tr = WanTransformer3DModel.from_config(I2V22)
    mtr.randomize(tr, SEED_TRANSFORMER)
    tr.save_pretrained(os.path.join(dst, "transformer"))
    tr = WanTransformer3DModel.from_pretrained(os.path.join(dst, "transformer"))
    vae = AutoencoderKLWan.from_pretrained(os.path.join(tiny, "vae"))
    sched = UniPCMultistepScheduler.from_pretrained(os.path.join(tiny, "scheduler"))
    pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=sched,
                                   image_processor=None, image_encoder=None, transformer=tr,
                                   transformer_2=None, boundary_ratio=None, expand_timesteps=False)
    mpl.write_model_index(pipe, dst)
    return sum(p.numel() for p in tr.parameters())


def load_pipe(out, tok, enc):
    folder = os.path.join(out, FOLDER)
    pipe = WanImageToVideoPipeline.from_pretrained(folder, text_encoder=None, tokenizer=None,
                                                   image_encoder=None, image_processor=None)
    assert pipe.image_encoder is None and pipe.image_processor is None and pipe.transformer_2 is None
    assert pipe.transformer.config.in_channels == 36 and pipe.transformer.config.image_dim is None
    pipe.__dict__.update(tokenizer=tok, text_encoder=enc)  # bypass __setattr__: model_index untouched
    pipe.set_progress_bar_config(disable=True)
    # loading without naming the null components too (model_index's [null, null] suffices)
    p2 = WanImageToVideoPipeline.from_pretrained(folder, text_encoder=None, tokenizer=None)
    load = {"explicit_none": "ok",
            "implicit_none": "ok" if (p2.image_encoder is None and p2.image_processor is None) else "not None"}
    return pipe, load


# ---- 2. images and Pillow's LANCZOS restated ----------------------------------------------------------

def make_sources():
    g = torch.Generator().manual_seed(SEED_IMAGES)
    src = {}
    for name, (w, h) in SOURCES.items():
        src[name] = torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
    return src


def lanczos(x):
    def sinc(v):
        if v == 0.0:
            return 1.0
        v *= math.pi
        return math.sin(v) / v
    return sinc(x) * sinc(x / 3.0) if -3.0 <= x < 3.0 else 0.0


PRECISION_BITS = 32 - 8 - 2


def coeffs(in_size, out_size):
    """Pillow's precompute_coeffs (Resample.c) for LANCZOS (support 3), box = whole input, then
    normalize_coeffs_8bpc: round-half-away to fixed point with 22 fraction bits."""
    scale = in_size / out_size
    fscale = max(scale, 1.0)
    support = 3.0 * fscale
    rows = []
    for xx in range(out_size):
        center = (xx + 0.5) * scale
        ss = 1.0 / fscale
        xmin = max(int(center - support + 0.5), 0)  # C (int) truncates toward zero
        xmax = min(int(center + support + 0.5), in_size) - xmin
        k = [lanczos((x + xmin - center + 0.5) * ss) for x in range(xmax)]
        ww = sum(k)
        k = [v / ww if ww != 0.0 else v for v in k]
        ki = [int(-0.5 + v * (1 << PRECISION_BITS)) if v < 0 else int(0.5 + v * (1 << PRECISION_BITS)) for v in k]
        rows.append((xmin, ki))
    return rows


def pass_8bpc(img, rows, axis):
    """One 8-bit pass along axis (1 = horizontal, 0 = vertical): int32 sum from 1 << 21, >> 22, clip."""
    img = img.astype(np.int64)
    out = []
    for xmin, ki in rows:
        acc = np.full(img.shape[:axis] + img.shape[axis + 1:], 1 << (PRECISION_BITS - 1), dtype=np.int64)
        for j, k in enumerate(ki):
            acc = acc + np.take(img, xmin + j, axis=axis) * k
        out.append(np.clip(acc >> PRECISION_BITS, 0, 255))
    return np.stack(out, axis=axis).astype(np.uint8)


def pil_lanczos_restated(arr, width, height):
    h0, w0 = arr.shape[:2]
    if (w0, h0) == (width, height):
        return arr.copy()  # Image.resize returns a copy for an unchanged size
    if w0 != width:
        arr = pass_8bpc(arr, coeffs(w0, width), 1)
    if h0 != height:
        arr = pass_8bpc(arr, coeffs(h0, height), 0)
    return arr


# ---- 3. the pipeline, observed ---------------------------------------------------------------------

def call_kwargs(c, images, embeds):
    """prompt / negative_prompt are NOT passed as strings: Diffusers 0.40's pipeline_wan_i2v.basic_clean
    calls ftfy.fix_text unconditionally (WanPipeline guards it with is_ftfy_available()), and ftfy is not
    installed here, so a string prompt raises NameError (recorded as error_cases.string_prompt). The
    embeddings are make_text_encoder.encode_prompt's (WanPipeline.encode_prompt restated; checked
    bit-identical to WanPipeline's own in make_pipeline.py); ftfy.fix_text is the identity on these
    ASCII prompts."""
    kw = {k: v for k, v in c.items() if k not in ("seed", "image", "last_image", "prompt", "negative_prompt")}
    kw["prompt_embeds"] = embeds["prompt_embeds"]
    if c["guidance_scale"] > 1.0:
        kw["negative_prompt_embeds"] = embeds["negative_prompt_embeds"]
    kw["image"] = PIL.Image.fromarray(images[c["image"]], mode="RGB")
    if "last_image" in c:
        kw["last_image"] = PIL.Image.fromarray(images[c["last_image"]], mode="RGB")
    return kw


def run_pipe(pipe, c, images, embeds, output_type):
    rec = {"calls": [], "resize": [], "preprocess": [], "encode": [], "decode": []}
    handles = []

    def pre(mod, args, kwargs):
        rec["calls"].append({"hidden_states": kwargs["hidden_states"].clone(),
                             "timestep": kwargs["timestep"].clone(),
                             "encoder_hidden_states": kwargs["encoder_hidden_states"].clone(),
                             "encoder_hidden_states_image": kwargs.get("encoder_hidden_states_image")})

    def post(mod, args, kwargs, output):
        rec["calls"][-1]["out"] = output[0].clone()
    handles.append(pipe.transformer.register_forward_pre_hook(pre, with_kwargs=True))
    handles.append(pipe.transformer.register_forward_hook(post, with_kwargs=True))
    vp, vae = pipe.video_processor, pipe.vae
    o_resize, o_pre, o_enc, o_dec = vp.resize, vp.preprocess, vae.encode, vae.decode

    def resize(image, height, width, *a, **k):
        res = o_resize(image, height, width, *a, **k)
        rec["resize"].append({"in": np.array(image), "out": np.array(res), "args": [height, width, a, k]})
        return res

    def preprocess(image, *a, **k):
        res = o_pre(image, *a, **k)
        rec["preprocess"].append(res.clone())
        return res

    def encode(x, *a, **k):
        res = o_enc(x, *a, **k)
        rec["encode"].append({"x": x.clone(), "mean": res.latent_dist.mean.clone(),
                              "mode": res.latent_dist.mode().clone()})
        return res

    def decode(z, *a, **k):
        res = o_dec(z, *a, **k)
        rec["decode"].append({"z": z.clone(), "sample": res[0].clone()})
        return res
    vp.resize, vp.preprocess, vae.encode, vae.decode = resize, preprocess, encode, decode
    cap = mpl.Capture()
    lg = logging.getLogger("diffusers")
    lg.addHandler(cap)
    try:
        with warnings.catch_warnings(record=True) as wlist:
            warnings.simplefilter("always")
            gen = torch.Generator("cpu").manual_seed(c["seed"])
            res = pipe(**call_kwargs(c, images, embeds), generator=gen, output_type=output_type, return_dict=True)
    finally:
        lg.removeHandler(cap)
        for h in handles:
            h.remove()
        for name in ("resize", "preprocess"):
            del vp.__dict__[name]
        for name in ("encode", "decode"):
            del vae.__dict__[name]
    rec["logs"] = cap.records
    rec["warnings"] = [{"category": w.category.__name__, "message": str(w.message)} for w in wlist]
    rec["timesteps"] = [int(t) for t in pipe.scheduler.timesteps]
    return res.frames, rec


@torch.no_grad()
def restated(pipe, c, images, pe, ne):
    """The I2V sampling restated from README (not calling __call__ or prepare_latents)."""
    H, W, nf = c["height"], c["width"], c["num_frames"]
    cfg = c["guidance_scale"] > 1.0

    def prep(name):
        px = pil_lanczos_restated(images[name], W, H)
        return torch.from_numpy(px.astype(np.float32) / 255.0).permute(2, 0, 1)[None] * 2.0 - 1.0
    img = prep(c["image"])
    last = prep(c["last_image"]) if "last_image" in c else None
    T, h, w = (nf - 1) // 4 + 1, H // 8, W // 8
    lat = torch.randn((1, 16, T, h, w), generator=torch.Generator().manual_seed(c["seed"]))
    vc = torch.zeros(1, 3, nf, H, W)
    vc[:, :, 0] = img[0]
    if last is not None:
        vc[:, :, -1] = last[0]
    z = pipe.vae.encode(vc).latent_dist.mode()
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 16, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 16, 1, 1, 1)
    zn = (z - mean) * inv_std
    # mask channel j of latent frame t: pixel frame 0 for t = 0 (all 4 channels), else 4(t-1)+1+j
    known = {0} | ({nf - 1} if last is not None else set())
    mask = torch.zeros(1, 4, T, h, w)
    for t in range(T):
        for j in range(4):
            if (0 if t == 0 else 4 * (t - 1) + 1 + j) in known:
                mask[:, j, t] = 1.0
    cond = torch.cat([mask, zn], dim=1)
    s = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    s.set_timesteps(c["num_inference_steps"])
    s.set_begin_index(0)
    m = pipe.transformer
    for t in s.timesteps:
        x = torch.cat([lat, cond], dim=1)
        v = m(hidden_states=x, timestep=t.expand(1), encoder_hidden_states=pe, return_dict=False)[0]
        if cfg:
            vu = m(hidden_states=x, timestep=t.expand(1), encoder_hidden_states=ne, return_dict=False)[0]
            v = vu + c["guidance_scale"] * (v - vu)
        lat = s.step(v, t, lat, return_dict=False)[0]
    video = pipe.vae.decode(lat / inv_std + mean, return_dict=False)[0]
    frames = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().numpy()
    return cond, lat, frames


def run_cases(pipe, tok, enc, images, tensors, checks):
    cases = {}
    for name in images:
        tensors[f"source.{name}"] = torch.from_numpy(images[name].copy())
    for name, c in CASES.items():
        cfg = c["guidance_scale"] > 1.0
        rpe, rne, info, ninfo = mte.encode_prompt(tok, enc, c["prompt"], c["negative_prompt"], cfg, 1, 512)
        embeds = {"prompt_embeds": rpe, "negative_prompt_embeds": rne}
        frames, rec = run_pipe(pipe, c, images, embeds, "np")
        lat_out, rec_l = run_pipe(pipe, c, images, embeds, "latent")
        assert isinstance(frames, np.ndarray) and frames.dtype == np.float32
        assert not rec_l["decode"] and len(rec["decode"]) == 1
        assert rec["timesteps"] == rec_l["timesteps"] and rec["logs"] == rec_l["logs"]
        cfg = c["guidance_scale"] > 1.0
        per = 2 if cfg else 1
        calls = rec["calls"]
        assert len(calls) == per * c["num_inference_steps"] == len(rec_l["calls"])
        for a, b in zip(calls, rec_l["calls"]):
            assert torch.equal(a["out"], b["out"])
        assert all(cc["encoder_hidden_states_image"] is None for cc in calls)
        cond = calls[0]["hidden_states"][:, 16:]
        for cc in calls:  # the condition is the same in every call
            assert torch.equal(cc["hidden_states"][:, 16:], cond)
        n_img = 2 if "last_image" in c else 1
        assert len(rec["resize"]) == n_img and len(rec["preprocess"]) == n_img and len(rec["encode"]) == 1
        p = f"{name}."
        pe = calls[0]["encoder_hidden_states"]
        ne = calls[1]["encoder_hidden_states"] if cfg else None
        for kind, t in (("prompt_embeds", pe), ("negative_prompt_embeds", ne)):
            if t is None:
                continue
            if kind in tensors:
                assert torch.equal(tensors[kind], t), kind
            tensors[kind] = t
        lat_in, v_c, v_u, v_g = [], [], [], []
        for i in range(c["num_inference_steps"]):
            cc = calls[per * i]
            lat_in.append(cc["hidden_states"][:, :16])
            v_c.append(cc["out"])
            if cfg:
                cu = calls[per * i + 1]
                assert torch.equal(cu["hidden_states"], cc["hidden_states"])
                assert torch.equal(cu["encoder_hidden_states"], ne)
                v_u.append(cu["out"])
                v_g.append(cu["out"] + c["guidance_scale"] * (cc["out"] - cu["out"]))
            else:
                v_g.append(cc["out"])
        # stored tensors
        for k, key in ((0, "image"), (1, "last_image")):
            if k >= n_img:
                continue
            r = rec["resize"][k]
            tensors[p + key + "_resized"] = torch.from_numpy(r["out"].copy())
            tensors[p + key + "_preprocessed"] = rec["preprocess"][k]
        enc_rec = rec["encode"][0]
        tensors[p + "video_condition"] = enc_rec["x"]
        tensors[p + "latent_condition_raw"] = enc_rec["mode"]
        tensors[p + "condition"] = cond
        tensors[p + "hidden_states_first"] = calls[0]["hidden_states"]
        tensors[p + "latents_init"] = lat_in[0]
        tensors[p + "latents_steps"] = torch.stack(lat_in + [lat_out])
        tensors[p + "noise_pred_cond"] = torch.stack(v_c)
        if cfg:
            tensors[p + "noise_pred_uncond"] = torch.stack(v_u)
        tensors[p + "noise_pred"] = torch.stack(v_g)
        tensors[p + "latents_final"] = lat_out
        tensors[p + "latents_denormalized"] = rec["decode"][0]["z"]
        tensors[p + "frames"] = torch.from_numpy(frames.copy())
        # checks
        g = torch.Generator().manual_seed(c["seed"])
        assert torch.equal(lat_in[0], torch.randn(lat_in[0].shape, generator=g))
        assert torch.equal(enc_rec["mode"], enc_rec["mean"])
        assert torch.equal(rpe, pe) and (not cfg or torch.equal(rne, ne))
        px_checks = {}
        for k, key in ((0, "image"), (1, "last_image")):
            if k >= n_img:
                continue
            r = rec["resize"][k]
            src = images[c[key]]
            assert np.array_equal(r["in"], src)
            px_checks[key] = {
                "pil_lanczos_restated_maxdiff": int(np.abs(pil_lanczos_restated(src, c["width"], c["height"]).astype(int)
                                                           - r["out"].astype(int)).max()),
                "resize_is_identity": bool(r["out"].shape == src.shape and np.array_equal(r["out"], src)),
                "preprocess_vs_resized_maxdiff": maxdiff(
                    rec["preprocess"][k],
                    torch.from_numpy(r["out"].astype(np.float32) / 255.0).permute(2, 0, 1)[None] * 2.0 - 1.0)}
        r_cond, r_lat, r_frames = restated(pipe, c, images, pe, ne)
        with torch.no_grad():  # causal VAE: latent frame 0 = the image encoded alone; frame 1 is NOT the
            vc = enc_rec["x"]  # zeros (+ last image) encoded alone: it sees frame 0 through the causal cache
            z0 = pipe.vae.encode(vc[:, :, :1]).latent_dist.mode()
            z1 = pipe.vae.encode(vc[:, :, 1:]).latent_dist.mode()
        checks[name] = {
            "pixels": px_checks,
            "latent_frame0_vs_image_encoded_alone_maxdiff": maxdiff(enc_rec["mode"][:, :, :1], z0),
            "latent_frame1_vs_rest_encoded_alone_maxdiff": maxdiff(enc_rec["mode"][:, :, 1:], z1),
            "restated_condition_maxdiff": maxdiff(r_cond, cond),
            "restated_latents_maxdiff": maxdiff(r_lat, lat_out),
            "restated_frames_maxdiff": float(np.abs(r_frames - frames).max()),
            "frames_vs_decoded_maxdiff": maxdiff(torch.from_numpy(frames).permute(0, 4, 1, 2, 3),
                                                 (rec["decode"][0]["sample"] / 2 + 0.5).clamp(0, 1)),
            "decoded_share_at_clamp": float((rec["decode"][0]["sample"].abs() >= 1).float().mean()),
            "first_frame_reconstruction_maxdiff_0_1": float(np.abs(
                frames[0, 0] - rec["preprocess"][0][0].permute(1, 2, 0).numpy() / 2 - 0.5).max()),
        }
        args = {k: v for k, v in c.items()}
        args["image"] = f"source.{c['image']} (PIL.Image.fromarray(uint8 [H, W, 3], mode='RGB'))"
        if "last_image" in c:
            args["last_image"] = f"source.{c['last_image']} (PIL.Image.fromarray(uint8 [H, W, 3], mode='RGB'))"
        cases[name] = {
            "arguments": args,
            "call": ("WanImageToVideoPipeline.__call__(**arguments minus seed / prompt / negative_prompt, "
                     "image=PIL, [last_image=PIL,] prompt_embeds=<prompt_embeds>, [negative_prompt_embeds="
                     "<negative_prompt_embeds> when guidance_scale > 1,] generator=torch.Generator('cpu')"
                     ".manual_seed(seed), output_type='np' | 'latent'); prompt / negative_prompt are what the "
                     "embeddings were made from (make_text_encoder.encode_prompt, max_sequence_length 512)"),
            "defaults_in_effect": {"max_sequence_length": 512, "negative_prompt_used": "" if cfg else None,
                                   "do_classifier_free_guidance": cfg, "image_embeds": None,
                                   "latents": None, "guidance_scale_2": None},
            "prompt_embeds_key": "prompt_embeds",
            "negative_prompt_embeds_key": "negative_prompt_embeds" if cfg else None,
            "cleaned_prompt": info["cleaned"][0], "seq_len": info["seq_lens"][0],
            "negative_seq_len": ninfo["seq_lens"][0] if ninfo else None,
            "source_sizes_wh": {key: [int(images[c[key]].shape[1]), int(images[c[key]].shape[0])]
                                for key in ("image", "last_image") if key in c},
            "resize_calls": [{"height": r["args"][0], "width": r["args"][1],
                              "extra_args": [list(r["args"][2]), r["args"][3]]} for r in rec["resize"]],
            "resample": pipe.video_processor.config.resample,
            "reducing_gap": pipe.video_processor.config.reducing_gap,
            "scheduler_timesteps": rec["timesteps"],
            "scheduler_sigmas": [float(v) for v in pipe.scheduler.sigmas],
            "transformer_timesteps": [cc["timestep"].tolist() for cc in calls[::per]],
            "transformer_timestep_dtype": str(calls[0]["timestep"].dtype).replace("torch.", ""),
            "mask_channels_per_latent_frame": tensors[p + "condition"][0, :4, :, 0, 0].t().tolist(),
            "log_records": rec["logs"], "warnings": rec["warnings"],
            "shapes": {k[len(p):]: list(v.shape) for k, v in tensors.items() if k.startswith(p)},
            "dtypes": {k[len(p):]: str(v.dtype).replace("torch.", "") for k, v in tensors.items()
                       if k.startswith(p)},
            "frames_range": [float(frames.min()), float(frames.max())],
        }
    return cases


def maxdiff(a, b):
    return mpl.maxdiff(a, b)


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_warning()
    n_params = make_folder(out)
    tiny = os.path.join(out, "tiny_wan")
    tok_dir = os.path.join(tiny, "tokenizer")
    with open(os.path.join(tok_dir, "spiece.model"), "rb") as f:
        model_bytes = f.read()
    with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    tok = mte.T5TokenizerSlow(model_bytes, tcfg)
    enc = mte.Encoder(load_file(os.path.join(tiny, "text_encoder", "model.safetensors")), torch.float32)
    pipe, load = load_pipe(out, tok, enc)
    images = make_sources()
    tensors, checks = {}, {}
    cases = run_cases(pipe, tok, enc, images, tensors, checks)
    errors = {}
    c = CASES["i2v"]
    try:
        pipe(image=PIL.Image.fromarray(images[c["image"]], mode="RGB"), prompt=c["prompt"], height=c["height"],
             width=c["width"], num_frames=c["num_frames"], num_inference_steps=1,
             generator=torch.Generator().manual_seed(0), output_type="latent")
        errors["string_prompt"] = {"exception": None}
    except NameError as e:
        errors["string_prompt"] = {"arguments": "i2v's, prompt=the string, num_inference_steps=1",
                                   "exception": "NameError", "message": str(e),
                                   "where": "pipeline_wan_i2v.basic_clean: ftfy.fix_text(text) without the "
                                            "is_ftfy_available() guard pipeline_wan.basic_clean has"}
    for name, ch in checks.items():
        assert ch["restated_condition_maxdiff"] == 0.0, (name, ch)
        assert ch["restated_latents_maxdiff"] == 0.0 and ch["restated_frames_maxdiff"] == 0.0, (name, ch)
        for px in ch["pixels"].values():
            assert px["pil_lanczos_restated_maxdiff"] == 0 and px["preprocess_vs_resized_maxdiff"] == 0.0, (name, px)
    dst = os.path.join(out, FOLDER)
    mpl.save_st(os.path.join(dst, "sample_i2v.safetensors"), tensors)
    vcfg = mpl.pipes_cfg(tiny)
    mpl.write_json(os.path.join(dst, "sample_i2v.json"), {
        "pipeline": "WanImageToVideoPipeline", "diffusers_version": diffusers.__version__,
        "torch_version": torch.__version__, "pillow_version": PIL.__version__,
        "ftfy_available": pipeline_wan_i2v.is_ftfy_available(),
        "transformer_config": I2V22, "transformer_seed": SEED_TRANSFORMER, "transformer_params": n_params,
        "image_seed": SEED_IMAGES,
        "image_sources": {f"source.{k}": {"width": w, "height": h,
                                          "rule": "torch.randint(0, 256, (H, W, 3), uint8), one generator "
                                                  "seeded image_seed, drawn in this order"}
                          for k, (w, h) in SOURCES.items()},
        "load_checks": load,
        "text_side": ("tokenizer / text_encoder are make_text_encoder.py's T5TokenizerSlow and UMT5 "
                      "transcription (float32) over tiny_wan/tokenizer and tiny_wan/text_encoder"),
        "vae_latents_mean": vcfg["latents_mean"], "vae_latents_std": vcfg["latents_std"],
        "cases": cases, "error_cases": errors, "checks": checks})
    for name, ch in checks.items():
        print(name, json.dumps(ch))
    print("size:", os.path.getsize(os.path.join(dst, "sample_i2v.safetensors")), "tensors:", len(tensors))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_i2v.py OUT_DIR  (tests/golden/wan)")
    main(sys.argv[1])
