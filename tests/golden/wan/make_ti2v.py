#!/usr/bin/env python3
"""Makes the Wan 2.2 TI2V-5B sampling references (`expand_timesteps`: 48-channel latents of the 2.2
VAE, per-token timesteps, image-to-video by writing the image's latents into latent frame 0):
  tiny_wan_ti2v/model_index.json        WanPipeline, expand_timesteps true, boundary_ratio null,
                                        transformer_2 [null, null] (Wan2.2-TI2V-5B-Diffusers' layout)
  tiny_wan_ti2v/transformer/            byte copy of tiny_wan/transformer_ti2v/ (in/out 48, text_dim 32)
  tiny_wan_ti2v/vae/                    byte copy of tiny_wan/vae_22/ (z_dim 48, patch_size 2, x16)
  tiny_wan_ti2v/{text_encoder,tokenizer,scheduler}  byte copies of tiny_wan/* (scheduler unchanged)
  tiny_wan_ti2v/sample_ti2v.safetensors + .json    WanPipeline (T2V) and WanImageToVideoPipeline (I2V)
                                        __call__ end to end, loaded from that one folder
README.md ("## Wan 2.2 TI2V-5B (`tiny_wan_ti2v/`, `make_ti2v.py`)") documents every file.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0) from the project root:
    OMP_NUM_THREADS=1 ../shared/refstack2/run python3 tests/golden/wan/make_ti2v.py tests/golden/wan
Re-running writes byte-identical files (float32 on one CPU thread, fixed seeds, safetensors with
sorted keys and metadata {"format": "pt"}, JSON with sorted keys).

Everything Diffusers does is run unmodified: {WanPipeline, WanImageToVideoPipeline}.from_pretrained
(tiny_wan_ti2v, text_encoder=None, tokenizer=None) and __call__ with prompt_embeds= /
negative_prompt_embeds= made by make_text_encoder.encode_prompt (WanPipeline.encode_prompt restated,
checked bit-identical below; pipeline_wan_i2v.basic_clean needs ftfy, absent here). Observers only:
forward pre-hooks / hooks on the transformer, instance-level wrappers around
pipe.video_processor.preprocess and pipe.vae.encode / .decode that record and return unchanged,
and a callback_on_step_end that returns {} and READS (never writes) __call__'s locals through
sys._getframe(1) (timestep, latent_model_input, and for I2V condition / first_frame_mask, which the
callback API does not expose).

Checks (the files do not depend on them): a plain restatement of both loops (own per-token timestep
and first-frame substitution, the scheduler, CFG, de-normalisation, decode, postprocess) against
the pipelines, bit for bit; the transformer's per-token timestep vs the scalar [B] timestep (T2V);
the embeddings against WanPipeline.encode_prompt run on the stand-ins.
"""
import json
import logging
import os
import shutil
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
import make_transformer as mtr  # noqa: E402,F401  (flips the transformers flag before diffusers.loaders)
import make_pipeline as mpl  # noqa: E402  (write_json, save_st, maxdiff, Capture, write_model_index)
import diffusers  # noqa: E402
from diffusers import AutoencoderKLWan, UniPCMultistepScheduler, WanTransformer3DModel  # noqa: E402
from diffusers.pipelines.wan import pipeline_wan, pipeline_wan_i2v  # noqa: E402
from diffusers.pipelines.wan.pipeline_wan import WanPipeline  # noqa: E402
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline  # noqa: E402

FOLDER = "tiny_wan_ti2v"
COPIES = {"transformer": "transformer_ti2v", "vae": "vae_22", "text_encoder": "text_encoder",
          "tokenizer": "tokenizer", "scheduler": "scheduler"}
SEED_IMAGES = 20270141
PROMPT = "a red car drives in the city street"
BASE = dict(prompt=PROMPT, negative_prompt=None, height=32, width=32, num_frames=5, num_inference_steps=3,
            guidance_scale=5.0, seed=0, num_videos_per_prompt=1)
# seeded uniform uint8 RGB images: name -> (width, height), drawn from one generator in this order
SOURCES = {"image_32x32": (32, 32), "image_96x64": (96, 64)}
CASES = {
    "t2v": dict(BASE, pipeline="WanPipeline"),
    "t2v_floor_48x64": dict(BASE, pipeline="WanPipeline", height=48, width=64),
    "i2v": dict(BASE, pipeline="WanImageToVideoPipeline", image="image_32x32"),
    "i2v_64x96": dict(BASE, pipeline="WanImageToVideoPipeline", image="image_96x64", height=64, width=96),
}
SRC_DIR = os.path.normpath(os.path.join(os.path.dirname(diffusers.__file__), "pipelines", "wan"))
TR_FILE = "../../models/transformers/transformer_wan.py"


def src_line(fname, needle, nth=0):
    """'file:line' of the nth line of Diffusers' source containing needle (so every reference in the
    JSON is checked against the source actually run); fname relative to pipelines/wan/."""
    with open(os.path.normpath(os.path.join(SRC_DIR, fname)), encoding="utf-8") as f:
        hits = [i + 1 for i, line in enumerate(f) if needle in line]
    assert len(hits) > nth, (fname, needle, hits)
    return f"{fname}:{hits[nth]}"


# ---- 1. folder -----------------------------------------------------------------------------------

def copy_tree(src, dst):
    if os.path.islink(dst):
        os.remove(dst)
    os.makedirs(dst, exist_ok=True)
    for name in sorted(os.listdir(src)):
        assert os.path.isfile(os.path.join(src, name)), name
        shutil.copyfile(os.path.join(src, name), os.path.join(dst, name))
    extra = sorted(set(os.listdir(dst)) - set(os.listdir(src)))
    assert not extra, f"{dst} has files not in {src}: {extra}"


def make_folder(out):
    tiny = os.path.join(out, "tiny_wan")
    dst = os.path.join(out, FOLDER)
    os.makedirs(dst, exist_ok=True)
    for sub, src in COPIES.items():
        copy_tree(os.path.join(tiny, src), os.path.join(dst, sub))
    tr = WanTransformer3DModel.from_pretrained(os.path.join(dst, "transformer"))
    vae = AutoencoderKLWan.from_pretrained(os.path.join(dst, "vae"))
    sched = UniPCMultistepScheduler.from_pretrained(os.path.join(dst, "scheduler"))
    with open(os.path.join(dst, "text_encoder", "config.json")) as f:
        te = json.load(f)
    tc, vc = tr.config, vae.config
    fit = {
        "transformer.in_channels == vae.z_dim": tc.in_channels == vc.z_dim == 48,
        "transformer.out_channels == vae.z_dim": tc.out_channels == vc.z_dim,
        "transformer.text_dim == text_encoder.d_model": tc.text_dim == te["d_model"] == 32,
        "transformer.patch_size == [1, 2, 2]": list(tc.patch_size) == [1, 2, 2],
        "transformer.image_dim is None": tc.image_dim is None,
        "vae.patch_size == 2 and is_residual": vc.patch_size == 2 and vc.is_residual,
        "vae.scale_factor_spatial == 16": vc.scale_factor_spatial == 16,
        "vae.scale_factor_temporal == 4": vc.scale_factor_temporal == 4,
        "scheduler.use_flow_sigmas": bool(sched.config.use_flow_sigmas),
    }
    assert all(fit.values()), fit
    pipe = WanPipeline(tokenizer=None, text_encoder=None, vae=vae, scheduler=sched, transformer=tr,
                       transformer_2=None, boundary_ratio=None, expand_timesteps=True)
    mpl.write_model_index(pipe, dst)
    with open(os.path.join(dst, "model_index.json")) as f:
        mi = json.load(f)
    assert mi["_class_name"] == "WanPipeline" and mi["expand_timesteps"] is True
    assert mi["boundary_ratio"] is None and mi["transformer_2"] == [None, None], mi
    return fit, sum(p.numel() for p in tr.parameters())


def load_pipes(out, tok, enc):
    folder = os.path.join(out, FOLDER)
    cap = mpl.Capture()
    lg = logging.getLogger("diffusers")
    lg.addHandler(cap)
    try:
        t2v = WanPipeline.from_pretrained(folder, text_encoder=None, tokenizer=None)
        n0 = len(cap.records)
        i2v = WanImageToVideoPipeline.from_pretrained(folder, text_encoder=None, tokenizer=None)
    finally:
        lg.removeHandler(cap)
    load = {"WanPipeline_log_records": cap.records[:n0], "WanImageToVideoPipeline_log_records": cap.records[n0:],
            "WanImageToVideoPipeline_config": {k: (list(v) if isinstance(v, tuple) else v)
                                               for k, v in dict(i2v.config).items() if not k.startswith("_")}}
    for p in (t2v, i2v):
        assert p.config.expand_timesteps is True and p.config.boundary_ratio is None and p.transformer_2 is None
        assert p.vae_scale_factor_spatial == 16 and p.vae_scale_factor_temporal == 4
        p.__dict__.update(tokenizer=tok, text_encoder=enc)  # bypass __setattr__: model_index untouched
        p.set_progress_bar_config(disable=True)
    assert i2v.image_encoder is None and i2v.image_processor is None
    return {"WanPipeline": t2v, "WanImageToVideoPipeline": i2v}, load


def make_sources():
    g = torch.Generator().manual_seed(SEED_IMAGES)
    return {name: torch.randint(0, 256, (h, w, 3), generator=g, dtype=torch.uint8).numpy()
            for name, (w, h) in SOURCES.items()}


# ---- 2. the pipelines, observed ---------------------------------------------------------------------

def run_pipe(pipe, c, images, embeds, output_type):
    rec = {"calls": [], "steps": [], "preprocess": [], "encode": [], "decode": []}
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
    o_pre, o_enc, o_dec = vp.preprocess, vae.encode, vae.decode

    def preprocess(image, *a, **k):
        res = o_pre(image, *a, **k)
        rec["preprocess"].append({"in": np.array(image), "out": res.clone(), "args": [list(a), k]})
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

    def callback(p, i, t, kw):
        loc = sys._getframe(1).f_locals  # __call__'s frame: read only
        st = {"i": i, "t": t.clone(), "latents": kw["latents"].clone(), "timestep": loc["timestep"].clone(),
              "latent_model_input": loc["latent_model_input"].clone()}
        for name in ("condition", "first_frame_mask"):
            if name in loc:
                st[name] = loc[name].clone()
        rec["steps"].append(st)
        return {}
    vp.preprocess, vae.encode, vae.decode = preprocess, encode, decode
    kw = {k: v for k, v in c.items() if k not in ("seed", "image", "prompt", "negative_prompt", "pipeline")}
    kw["prompt_embeds"] = embeds["prompt_embeds"]
    if c["guidance_scale"] > 1.0:
        kw["negative_prompt_embeds"] = embeds["negative_prompt_embeds"]
    if "image" in c:
        kw["image"] = PIL.Image.fromarray(images[c["image"]], mode="RGB")
    if output_type != "latent":
        kw["callback_on_step_end"] = callback
        kw["callback_on_step_end_tensor_inputs"] = ["latents"]
    cap = mpl.Capture()
    lg = logging.getLogger("diffusers")
    lg.addHandler(cap)
    try:
        with warnings.catch_warnings(record=True) as wlist:
            warnings.simplefilter("always")
            gen = torch.Generator("cpu").manual_seed(c["seed"])
            res = pipe(**kw, generator=gen, output_type=output_type, return_dict=True)
    finally:
        lg.removeHandler(cap)
        for h in handles:
            h.remove()
        del vp.__dict__["preprocess"]
        for name in ("encode", "decode"):
            del vae.__dict__[name]
    rec["logs"] = cap.records
    rec["warnings"] = [{"category": w.category.__name__, "message": str(w.message)} for w in wlist]
    rec["timesteps"] = [int(t) for t in pipe.scheduler.timesteps]
    rec["sigmas"] = [float(s) for s in pipe.scheduler.sigmas]
    rec["begin_index"] = pipe.scheduler.begin_index
    return res.frames, rec


@torch.no_grad()
def restated(pipe, c, images, pe, ne):
    """Both TI2V loops restated from README (not calling __call__ / prepare_latents)."""
    H, W = c["height"] // 32 * 32, c["width"] // 32 * 32
    nf = c["num_frames"]
    cfg = c["guidance_scale"] > 1.0
    T, h, w = (nf - 1) // 4 + 1, H // 16, W // 16
    lat = torch.randn((1, 48, T, h, w), generator=torch.Generator().manual_seed(c["seed"]))
    mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 48, 1, 1, 1)
    inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 48, 1, 1, 1)
    i2v = "image" in c
    cond = None
    if i2v:
        px = images[c["image"]]
        assert px.shape == (H, W, 3)  # no resize in these cases (the size is the target size)
        img = torch.from_numpy(px.astype(np.float32) / 255.0).permute(2, 0, 1)[None] * 2.0 - 1.0
        z = pipe.vae.encode(img[:, :, None]).latent_dist.mode()  # [1, 48, 1, h, w]: the image alone
        cond = (z - mean) * inv_std
    n_tok = T * (h // 2) * (w // 2)
    per_frame = (h // 2) * (w // 2)
    s = UniPCMultistepScheduler.from_config(pipe.scheduler.config)
    s.set_timesteps(c["num_inference_steps"])
    s.set_begin_index(0)
    m = pipe.transformer
    for t in s.timesteps:
        ts = torch.full((1, n_tok), float(t), dtype=torch.float32)
        x = lat.clone()
        if i2v:
            ts[:, :per_frame] = 0.0
            x[:, :, 0] = cond[:, :, 0]
        v = m(hidden_states=x, timestep=ts, encoder_hidden_states=pe, return_dict=False)[0]
        if cfg:
            vu = m(hidden_states=x, timestep=ts, encoder_hidden_states=ne, return_dict=False)[0]
            v = vu + c["guidance_scale"] * (v - vu)
        lat = s.step(v, t, lat, return_dict=False)[0]
    if i2v:
        lat[:, :, 0] = cond[:, :, 0]
    video = pipe.vae.decode(lat / inv_std + mean, return_dict=False)[0]
    frames = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).float().numpy()
    return cond, lat, frames


def run_cases(pipes, tok, enc, images, tensors, checks):
    cases = {}
    for name in images:
        tensors[f"source.{name}"] = torch.from_numpy(images[name].copy())
    pe, ne, info, ninfo = mte.encode_prompt(tok, enc, PROMPT, None, True, 1, 512)
    tensors["prompt_embeds"], tensors["negative_prompt_embeds"] = pe, ne
    embeds = {"prompt_embeds": pe, "negative_prompt_embeds": ne}
    # the pipeline's own encode_prompt on the stand-ins (string prompt path of WanPipeline) agrees
    with torch.no_grad():
        ope, one = pipes["WanPipeline"].encode_prompt(PROMPT, None, True, 1, max_sequence_length=512,
                                                      device=torch.device("cpu"))
    checks["encode_prompt_vs_pipeline"] = {"prompt_embeds_equal": bool(torch.equal(ope, pe)),
                                           "negative_prompt_embeds_equal": bool(torch.equal(one, ne))}
    for name, c in CASES.items():
        pipe = pipes[c["pipeline"]]
        i2v = "image" in c
        cfg = c["guidance_scale"] > 1.0
        per = 2 if cfg else 1
        n = c["num_inference_steps"]
        frames, rec = run_pipe(pipe, c, images, embeds, "np")
        lat_out, rec_l = run_pipe(pipe, c, images, embeds, "latent")
        assert isinstance(frames, np.ndarray) and frames.dtype == np.float32
        assert not rec_l["decode"] and len(rec["decode"]) == 1
        assert rec["timesteps"] == rec_l["timesteps"] and rec["logs"] == rec_l["logs"]
        calls, steps = rec["calls"], rec["steps"]
        assert len(calls) == per * n == len(rec_l["calls"]) and len(steps) == n
        for a, b in zip(calls, rec_l["calls"]):
            assert torch.equal(a["out"], b["out"])
        assert all(cc["encoder_hidden_states_image"] is None for cc in calls)
        assert len(rec["encode"]) == (1 if i2v else 0) and len(rec["preprocess"]) == (1 if i2v else 0)
        lat0 = torch.randn(calls[0]["hidden_states"].shape, generator=torch.Generator().manual_seed(c["seed"]))
        model_in, ts_in, v_c, v_u, v_g = [], [], [], [], []
        for i in range(n):
            cc = calls[per * i]
            st = steps[i]
            assert torch.equal(cc["encoder_hidden_states"], pe)
            assert torch.equal(cc["hidden_states"], st["latent_model_input"])
            assert torch.equal(cc["timestep"], st["timestep"]) and int(st["t"]) == rec["timesteps"][i]
            model_in.append(cc["hidden_states"])
            ts_in.append(cc["timestep"])
            v_c.append(cc["out"])
            if cfg:
                cu = calls[per * i + 1]
                assert torch.equal(cu["hidden_states"], cc["hidden_states"])
                assert torch.equal(cu["timestep"], cc["timestep"])
                assert torch.equal(cu["encoder_hidden_states"], ne)
                v_u.append(cu["out"])
                v_g.append(cu["out"] + c["guidance_scale"] * (cc["out"] - cu["out"]))
            else:
                v_g.append(cc["out"])
        sched_lat = [lat0] + [st["latents"] for st in steps]  # scheduler state: init, after each step
        p = f"{name}."
        tensors[p + "latents_init"] = lat0
        tensors[p + "latents_steps"] = torch.stack(sched_lat)
        tensors[p + "model_input"] = torch.stack(model_in)
        tensors[p + "timestep"] = torch.stack(ts_in)
        tensors[p + "noise_pred_cond"] = torch.stack(v_c)
        if cfg:
            tensors[p + "noise_pred_uncond"] = torch.stack(v_u)
        tensors[p + "noise_pred"] = torch.stack(v_g)
        tensors[p + "latents_final"] = lat_out
        tensors[p + "latents_denormalized"] = rec["decode"][0]["z"]
        tensors[p + "frames"] = torch.from_numpy(frames.copy())
        B, C, T, h, w = lat0.shape
        per_frame = (h // 2) * (w // 2)
        n_tok = T * per_frame
        ch = {}
        mean = torch.tensor(pipe.vae.config.latents_mean).view(1, 48, 1, 1, 1)
        inv_std = 1.0 / torch.tensor(pipe.vae.config.latents_std).view(1, 48, 1, 1, 1)
        assert torch.equal(rec["decode"][0]["z"], lat_out / inv_std + mean)
        # T2V: model input = scheduler state, every token's timestep t; no mask other than ones
        for i in range(n):
            assert ts_in[i].dtype == torch.float32 and list(ts_in[i].shape) == [B, n_tok]
            expect = torch.full((B, n_tok), float(rec["timesteps"][i]))
            if i2v:
                expect[:, :per_frame] = 0.0
            assert torch.equal(ts_in[i], expect), (name, i)
        if not i2v:
            for i in range(n):
                assert torch.equal(model_in[i], sched_lat[i])
            assert torch.equal(sched_lat[-1], lat_out)
            with torch.no_grad():  # the same step with the scalar [B] timestep (Wan 2.1 style)
                sc = pipe.transformer(hidden_states=model_in[0], timestep=torch.tensor([rec["timesteps"][0]]),
                                      encoder_hidden_states=pe, return_dict=False)[0]
            ch["per_token_vs_scalar_timestep_step0_maxdiff"] = mpl.maxdiff(sc, v_c[0])
            ch["per_token_vs_scalar_timestep_step0_equal"] = bool(torch.equal(sc, v_c[0]))
        else:
            enc_rec, pre_rec = rec["encode"][0], rec["preprocess"][0]
            st0 = steps[0]
            cond, ffm = st0["condition"], st0["first_frame_mask"]
            for st in steps:
                assert torch.equal(st["condition"], cond) and torch.equal(st["first_frame_mask"], ffm)
            assert np.array_equal(pre_rec["in"], images[c["image"]])
            assert torch.equal(enc_rec["mode"], enc_rec["mean"])
            assert torch.equal(cond, (enc_rec["mode"] - mean) * inv_std)
            exp_mask = torch.ones(1, 1, T, h, w)
            exp_mask[:, :, 0] = 0
            assert torch.equal(ffm, exp_mask) and ffm.dtype == torch.float32
            for i in range(n):
                assert torch.equal(model_in[i][:, :, 0], cond[:, :, 0])
                assert torch.equal(model_in[i][:, :, 1:], sched_lat[i][:, :, 1:])
            assert torch.equal(lat_out[:, :, 0], cond[:, :, 0])
            assert torch.equal(lat_out[:, :, 1:], sched_lat[-1][:, :, 1:])
            img_t = torch.from_numpy(images[c["image"]].astype(np.float32) / 255.0).permute(2, 0, 1)[None] * 2 - 1
            tensors[p + "image"] = torch.from_numpy(images[c["image"]].copy())
            tensors[p + "image_preprocessed"] = pre_rec["out"]
            tensors[p + "video_condition"] = enc_rec["x"]
            tensors[p + "latent_condition_raw"] = enc_rec["mode"]
            tensors[p + "condition"] = cond
            tensors[p + "first_frame_mask"] = ffm
            ch["preprocess_vs_plain_maxdiff"] = mpl.maxdiff(pre_rec["out"], img_t)
            ch["latents_final_frame0_vs_scheduler_frame0_maxdiff"] = mpl.maxdiff(lat_out[:, :, 0],
                                                                                 sched_lat[-1][:, :, 0])
            ch["first_frame_reconstruction_maxdiff_0_1"] = float(np.abs(
                frames[0, 0] - (img_t[0].permute(1, 2, 0).numpy() / 2 + 0.5)).max())
            with torch.no_grad():  # the first latent frame decoded alone vs the first output frame
                d0 = pipe.vae.decode(rec["decode"][0]["z"][:, :, :1], return_dict=False)[0]
            ch["frame0_vs_condition_decoded_alone_maxdiff"] = mpl.maxdiff(d0[:, :, 0], rec["decode"][0]["sample"][:, :, 0])
        r_cond, r_lat, r_frames = restated(pipe, c, images, pe, ne)
        if i2v:
            ch["restated_condition_maxdiff"] = mpl.maxdiff(r_cond, tensors[p + "condition"])
        ch["restated_latents_maxdiff"] = mpl.maxdiff(r_lat, lat_out)
        ch["restated_frames_maxdiff"] = float(np.abs(r_frames - frames).max())
        ch["frames_vs_decoded_maxdiff"] = mpl.maxdiff(torch.from_numpy(frames).permute(0, 4, 1, 2, 3),
                                                      (rec["decode"][0]["sample"] / 2 + 0.5).clamp(0, 1))
        ch["decoded_share_at_clamp"] = float((rec["decode"][0]["sample"].abs() >= 1).float().mean())
        checks[name] = ch
        args = {k: v for k, v in c.items() if k != "pipeline"}
        if i2v:
            args["image"] = f"source.{c['image']} (PIL.Image.fromarray(uint8 [H, W, 3], mode='RGB'))"
        cases[name] = {
            "pipeline": c["pipeline"],
            "arguments": args,
            "call": (f"{c['pipeline']}.from_pretrained('tiny_wan_ti2v', text_encoder=None, tokenizer=None)"
                     "(**arguments minus seed / prompt / negative_prompt, "
                     + ("image=PIL, " if i2v else "")
                     + "prompt_embeds=<prompt_embeds>, negative_prompt_embeds=<negative_prompt_embeds>, "
                       "generator=torch.Generator('cpu').manual_seed(seed), output_type='np' | 'latent'); "
                       "prompt / negative_prompt (None -> '') are what the embeddings were made from "
                       "(make_text_encoder.encode_prompt, max_sequence_length 512)"),
            "defaults_in_effect": {"max_sequence_length": 512, "negative_prompt_used": "",
                                   "do_classifier_free_guidance": cfg, "latents": None, "guidance_scale_2": None,
                                   "image_embeds": None if i2v else "n/a", "last_image": None if i2v else "n/a"},
            "effective": {"num_frames": (T - 1) * 4 + 1, "height": h * 16, "width": w * 16, "batch": B,
                          "latent_shape": [B, C, T, h, w], "tokens": n_tok, "tokens_per_latent_frame": per_frame},
            "prompt_embeds_key": "prompt_embeds", "negative_prompt_embeds_key": "negative_prompt_embeds",
            "scheduler_timesteps": rec["timesteps"], "scheduler_sigmas": rec["sigmas"],
            "scheduler_begin_index_after_call": rec["begin_index"],
            "transformer_timesteps": [x[0].tolist() for x in ts_in],
            "transformer_timestep_dtype": str(ts_in[0].dtype).replace("torch.", ""),
            "transformer_timestep_shape": list(ts_in[0].shape),
            "log_records": rec["logs"], "warnings": rec["warnings"],
            "shapes": {k[len(p):]: list(v.shape) for k, v in tensors.items() if k.startswith(p)},
            "dtypes": {k[len(p):]: str(v.dtype).replace("torch.", "") for k, v in tensors.items() if k.startswith(p)},
            "frames_range": [float(frames.min()), float(frames.max())],
        }
        if i2v:
            cases[name]["preprocess_calls"] = [{"args": pr["args"][0], "kwargs": pr["args"][1]}
                                               for pr in rec["preprocess"]]
            cases[name]["resample"] = pipe.video_processor.config.resample
            cases[name]["video_processor_vae_scale_factor"] = pipe.video_processor.config.vae_scale_factor
    return cases, info, ninfo


def semantics():
    W, I = "pipeline_wan.py", "pipeline_wan_i2v.py"
    return {
        "source_dir": ("../shared/refstack2/src/diffusers/src/diffusers/pipelines/wan/ (Diffusers 0.40.0.dev0); "
                       "refs are file:line relative to it"),
        "sizes": {
            "text": ("check_inputs raises ValueError unless height and width are divisible by 16; then __call__ floors "
                     "them to multiples of vae_scale_factor_spatial * patch_size[1|2] = 16 * 2 = 32 with a warning "
                     "(48 x 64 -> 32 x 64, case t2v_floor_48x64); num_frames rounded to 4k+1 as in Wan 2.1"),
            "refs": [src_line(W, "if height % 16 != 0 or width % 16 != 0"), src_line(W, "h_multiple_of = "),
                     src_line(W, "calc_height = height // h_multiple_of"),
                     src_line(I, "if height % 16 != 0 or width % 16 != 0"), src_line(I, "h_multiple_of = ")]},
        "t2v_latents": {
            "text": ("WanPipeline: num_channels_latents = transformer.config.in_channels (48); latents = randn([B, 48, "
                     "(F-1)//4+1, H//16, W//16]) float32 from the generator (vae_scale_factor_spatial = "
                     "vae.config.scale_factor_spatial = 16)"),
            "refs": [src_line(W, "self.vae_scale_factor_spatial = "), src_line(W, "num_channels_latents = ("),
                     src_line(W, "int(height) // self.vae_scale_factor_spatial")]},
        "t2v_timestep": {
            "text": ("mask = ones(latents.shape) float32; per step temp_ts = (mask[0][0][:, ::2, ::2] * t).flatten() "
                     "(the ::2 hard-codes the 2x2 spatial patch; t is the int64 schedule value, the product "
                     "float32), timestep = temp_ts.unsqueeze(0).expand(B, -1): float32 [B, N], N = T * (h/2) * "
                     "(w/2) in (f, h, w) token order, every entry t. The latents go to the transformer unchanged; "
                     "CFG = two separate calls, uncond + g * (cond - uncond); scheduler.step on the whole latents; "
                     "set_begin_index(0) is called"),
            "refs": [src_line(W, "mask = torch.ones(latents.shape"), src_line(W, "temp_ts = (mask[0][0][:, ::2, ::2] * t)"),
                     src_line(W, "timestep = temp_ts.unsqueeze(0).expand"), src_line(W, "self.scheduler.set_begin_index(0)"),
                     src_line(W, "latents = self.scheduler.step(noise_pred, t, latents")]},
        "transformer_per_token_timestep": {
            "text": ("WanTransformer3DModel.forward: timestep.ndim == 2 -> flattened to [B*N], sinusoidal embedding, "
                     "unflatten to [B, N, freq_dim], temb [B, N, D], timestep_proj [B, N, 6, D]; blocks use the "
                     "per-token modulation, the output norm uses scale_shift_table + temb per token"),
            "refs": [src_line(TR_FILE, "timestep = timestep.unflatten(0, (-1, timestep_seq_len))"),
                     src_line(TR_FILE, "if temb.ndim == 4:"), src_line(TR_FILE, "if timestep.ndim == 2:"),
                     src_line(TR_FILE, "timestep_proj = timestep_proj.unflatten(2, (6, -1))"),
                     src_line(TR_FILE, "if temb.ndim == 3:")]},
        "i2v_prepare_latents": {
            "text": ("WanImageToVideoPipeline with expand_timesteps: num_channels_latents = vae.config.z_dim (48); "
                     "image = video_processor.preprocess(image, height, width) [B, 3, H, W] in [-1, 1]; latents = "
                     "randn([B, 48, T, h, w]) drawn BEFORE the encode; video_condition = image.unsqueeze(2) "
                     "[B, 3, 1, H, W]: ONLY the image, no zero frames (Wan 2.1 / A14B I2V encode image + F-1 zero "
                     "frames); latent_condition = vae.encode(video_condition).latent_dist.mode() [B, 48, 1, h, w], "
                     "repeat(B), then (z - latents_mean) * (1 / latents_std); first_frame_mask = ones(1, 1, T, h, w) "
                     "float32 with [:, :, 0] = 0; returns (latents, condition, first_frame_mask). No mask channels, "
                     "no concatenation: in_channels stays 48. No image encoder is used (transformer.config.image_dim "
                     "is None)"),
            "refs": [src_line(I, "num_channels_latents = self.vae.config.z_dim"),
                     src_line(I, "image = self.video_processor.preprocess(image, height=height, width=width)"),
                     src_line(I, "if self.config.expand_timesteps:", 0), src_line(I, "video_condition = image"),
                     src_line(I, 'retrieve_latents(self.vae.encode(video_condition), sample_mode="argmax")', 1),
                     src_line(I, "latent_condition = (latent_condition - latents_mean) * latents_std"),
                     src_line(I, "first_frame_mask = torch.ones("), src_line(I, "first_frame_mask[:, :, 0] = 0"),
                     src_line(I, "return latents, latent_condition, first_frame_mask"),
                     src_line(I, "if self.transformer is not None and self.transformer.config.image_dim is not None")]},
        "i2v_loop": {
            "text": ("per step: latent_model_input = (1 - first_frame_mask) * condition + first_frame_mask * latents "
                     "(condition [B, 48, 1, h, w] broadcast over T; so latent frame 0 = the clean image latents, "
                     "frames 1.. = the scheduler's latents, bit-exact); temp_ts = (first_frame_mask[0][0][:, ::2, "
                     "::2] * t).flatten(), timestep = expand(B, -1): float32 [B, N], the first (h/2)*(w/2) tokens "
                     "(latent frame 0) 0.0, the rest t. CFG as T2V (same input and timestep for both calls). "
                     "scheduler.step(noise_pred, t, latents) on the WHOLE scheduler latents, frame 0 included "
                     "(frame 0 keeps evolving from its noise with the model's output there, but is overwritten "
                     "by the condition before every transformer call and at the end; UniPC is elementwise, so it "
                     "never leaks into frames 1..). set_begin_index is NOT called (the scheduler finds the index "
                     "by timestep lookup; same result for distinct timesteps). After the loop: latents = (1 - "
                     "mask) * condition + mask * latents again, BEFORE the output_type check, so "
                     "output_type='latent' returns latents whose frame 0 is the condition"),
            "refs": [src_line(I, "latent_model_input = (1 - first_frame_mask) * condition + first_frame_mask * latents"),
                     src_line(I, "temp_ts = (first_frame_mask[0][0][:, ::2, ::2] * t).flatten()"),
                     src_line(I, "timestep = temp_ts.unsqueeze(0).expand"),
                     src_line(I, "latents = self.scheduler.step(noise_pred, t, latents"),
                     src_line(I, "latents = (1 - first_frame_mask) * condition + first_frame_mask * latents")]},
        "output": {
            "text": ("unless output_type == 'latent': z = latents / (1 / latents_std) + latents_mean (48 values), "
                     "vae.decode(z) (Wan 2.2 VAE: clamp to [-1, 1], unpatchify 2x2), postprocess (video / 2 + "
                     "0.5).clamp(0, 1) -> [B, F, H, W, 3] float32"),
            "refs": [src_line(W, "latents = latents / latents_std + latents_mean"),
                     src_line(I, "latents = latents / latents_std + latents_mean")]},
        "quirks": {
            "text": ("pipeline_wan_i2v.basic_clean calls ftfy.fix_text without the is_ftfy_available() guard "
                     "(string prompts raise NameError here); in the I2V loop the CFG combination line sits inside "
                     "`with current_model.cache_context('uncond')` (harmless)"),
            "refs": [src_line(I, "text = ftfy.fix_text(text)"),
                     src_line(I, "noise_pred = noise_uncond + current_guidance_scale * (noise_pred - noise_uncond)")]},
    }


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_warning()
    fit, n_params = make_folder(out)
    tiny = os.path.join(out, "tiny_wan")
    tok_dir = os.path.join(tiny, "tokenizer")
    with open(os.path.join(tok_dir, "spiece.model"), "rb") as f:
        model_bytes = f.read()
    with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
        tcfg = json.load(f)
    tok = mte.T5TokenizerSlow(model_bytes, tcfg)
    enc = mte.Encoder(load_file(os.path.join(tiny, "text_encoder", "model.safetensors")), torch.float32)
    pipes, load = load_pipes(out, tok, enc)
    images = make_sources()
    tensors, checks = {}, {}
    cases, info, ninfo = run_cases(pipes, tok, enc, images, tensors, checks)
    assert all(checks["encode_prompt_vs_pipeline"].values()), checks["encode_prompt_vs_pipeline"]
    for name in CASES:
        ch = checks[name]
        assert ch["restated_latents_maxdiff"] == 0.0 and ch["restated_frames_maxdiff"] == 0.0, (name, ch)
        assert ch.get("restated_condition_maxdiff", 0.0) == 0.0 and ch.get("preprocess_vs_plain_maxdiff", 0.0) == 0.0
    with open(os.path.join(tiny, "vae_cases.json")) as f:
        vc = json.load(f)
    vae22 = sorted(k for k in vc["cases"] if k.startswith("vae_22."))
    dst = os.path.join(out, FOLDER)
    mpl.save_st(os.path.join(dst, "sample_ti2v.safetensors"), tensors)
    vcfg = json.load(open(os.path.join(dst, "vae", "config.json")))
    mpl.write_json(os.path.join(dst, "sample_ti2v.json"), {
        "pipelines": ["WanPipeline", "WanImageToVideoPipeline"], "diffusers_version": diffusers.__version__,
        "torch_version": torch.__version__, "pillow_version": PIL.__version__,
        "ftfy_available": pipeline_wan.is_ftfy_available() or pipeline_wan_i2v.is_ftfy_available(),
        "folder": {"model_index": "WanPipeline, expand_timesteps true, boundary_ratio null, transformer_2 [null, null]",
                   "copies": {sub: f"tiny_wan/{src}/ (byte copies)" for sub, src in COPIES.items()},
                   "fit_checks": fit, "transformer_params": n_params},
        "load": load,
        "image_seed": SEED_IMAGES,
        "image_sources": {f"source.{k}": {"width": w, "height": h,
                                          "rule": "torch.randint(0, 256, (H, W, 3), uint8), one generator "
                                                  "seeded image_seed, drawn in this order: " + ", ".join(SOURCES)}
                          for k, (w, h) in SOURCES.items()},
        "prompt": PROMPT, "cleaned_prompt": info["cleaned"][0], "seq_len": info["seq_lens"][0],
        "negative_seq_len": ninfo["seq_lens"][0],
        "text_side": ("tokenizer / text_encoder are make_text_encoder.py's T5TokenizerSlow and UMT5 "
                      "transcription (float32) over tiny_wan/tokenizer and tiny_wan/text_encoder"),
        "vae_latents_mean": vcfg["latents_mean"], "vae_latents_std": vcfg["latents_std"],
        "vae_22_cases_elsewhere": {"file": "tiny_wan/vae_cases.{json,safetensors} (make_vae.py)", "cases": vae22,
                                   "note": "same VAE (tiny_wan/vae_22 = tiny_wan_ti2v/vae); not duplicated here"},
        "expand_timesteps_semantics": semantics(),
        "keys": {
            "prompt_embeds / negative_prompt_embeds": "[1, 512, 32] shared by all cases (prompt / '')",
            "source.<name>": "uint8 [H, W, 3] the seeded images",
            "<case>.latents_init": "randn from Generator('cpu').manual_seed(seed) (the initial scheduler latents)",
            "<case>.latents_steps": "[steps + 1, ...] scheduler latents: init, then after each scheduler.step "
                                    "(callback_on_step_end's latents; I2V: frame 0 NOT replaced)",
            "<case>.model_input": "[steps, ...] hidden_states the transformer got (I2V: frame 0 = condition)",
            "<case>.timestep": "[steps, B, N] float32, the transformer's timestep argument",
            "<case>.noise_pred_cond / noise_pred_uncond / noise_pred": "[steps, ...]; noise_pred = uncond + g (cond - uncond)",
            "<case>.latents_final": "output_type='latent' result (I2V: frame 0 = condition)",
            "<case>.latents_denormalized": "vae.decode's input latents_final / (1 / std) + mean",
            "<case>.frames": "[B, F, H, W, 3] float32 output_type='np'",
            "<case>.image / image_preprocessed / video_condition / latent_condition_raw / condition / "
            "first_frame_mask": "I2V: the source pixels, preprocess output [1, 3, H, W], vae.encode input "
                                "[1, 3, 1, H, W], its mode [1, 48, 1, h, w], normalised [1, 48, 1, h, w], "
                                "mask [1, 1, T, h, w] (read from __call__'s locals)"},
        "cases": cases, "checks": checks})
    for name, ch in checks.items():
        print(name, json.dumps(ch))
    print("size:", os.path.getsize(os.path.join(dst, "sample_ti2v.safetensors")), "tensors:", len(tensors))


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_ti2v.py OUT_DIR  (tests/golden/wan)")
    main(sys.argv[1])
