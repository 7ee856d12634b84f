#!/usr/bin/env python3
"""Makes tests/golden/qwen_image/tiny_qwen_image/pipeline.safetensors and pipeline_cases.json:
references of QwenImagePipeline.__call__ on the tiny folder make_transformer.py writes (run that
first; re-making it means re-making this).

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 at ../shared/refstack2/src):
    ../shared/refstack2/run python3 tests/golden/qwen_image/make_pipeline.py tests/golden/qwen_image
Re-running writes byte-identical files (float32 on one CPU thread; safetensors' save_file with
sorted keys and the single metadata entry {"format": "pt"}; JSON with sorted keys).

Everything is Diffusers' code run unmodified: QwenImagePipeline.from_pretrained(folder,
text_encoder=None, tokenizer=None) called with seeded random `prompt_embeds` [B, S, 64] (rows past
each prompt's length are zeros, as _get_qwen_prompt_embeds pads) and `prompt_embeds_mask` (int64,
right-padded), `generator=torch.Generator("cpu").manual_seed(seed)`, once with
output_type="latent" and once with "np". Only observers: a wrapper around scheduler.set_timesteps
that calls through (functools.wraps keeps the signature retrieve_timesteps inspects), a forward
hook on the transformer (with_kwargs) and a callback_on_step_end that returns {}.

Per case <case> in pipeline.safetensors:
  .prompt_embeds [B, S, 64], .prompt_embeds_mask int64 [B, S] (as passed), and for CFG cases
  .negative_prompt_embeds, .negative_prompt_embeds_mask;
  .transformer_mask, .transformer_neg_mask int64 [B * n, S] (when not None): the masks the
    transformer got. encode_prompt repeats the 2-D mask with `.repeat(1, n, 1).view(B * n, S)`,
    which orders its rows p0, p1, p0, p1 while the embeddings' rows are p0, p0, p1, p1 (cfg: the
    row of prompt 0's second image gets prompt 1's mask and vice versa); an all-ones mask is None;
  .noise [B * n, N, 64]: the initial packed latents (randn [B * n, 1, 16, h, w] on the seeded
    generator, then _pack_latents); passing it as latents= gives the same result (checked);
  .sigmas [steps + 1] (with the terminal 0), .timesteps [steps] (after set_timesteps);
  .model_t.<i> [B * n]: the timestep the transformer got at step i (= timesteps[i] / 1000);
  .noise_pred.<i> [B * n, N, 64]: the conditional transformer output at step i;
  .neg_noise_pred.<i> and .guided.<i> (CFG cases): the unconditional output, and the prediction
    the scheduler stepped with (CFG combined and norm-rescaled; without CFG it is .noise_pred.<i>);
  .step_latents.<i> [B * n, N, 64]: the latents after step i (callback_on_step_end);
  .latents [B * n, N, 64]: output_type="latent" (packed, as returned);
  .image [B * n, H, W, 3] float32 in [0, 1]: output_type="np";
  basic.vae_input [1, 16, 1, 6, 10] (the unpacked, de-normalised latents decode gets) and
  basic.vae_decoded [1, 3, 1, 48, 80] (vae.decode's sample, clamped to [-1, 1]).
pipeline_cases.json: every argument, the scheduler config, image_seq_len, mu, the sigmas passed
and used, the timesteps, the latent / image shapes, img_shapes, and per transformer call whether a
mask was passed.

Checks (the outputs do not depend on them): the schedule, mu, the model timestep, CFG with its
norm rescale and every Euler step are recomputed independently (numpy float64 / torch) from the
recorded transformer outputs; the noise equals torch.randn on the seeded generator; the image
equals the hand-made decode (unpack, latents * std + mean, vae.decode, [:, :, 0], x / 2 + 0.5
clamped, NHWC).
"""
import functools
import json
import math
import os
import sys

import numpy as np
import torch
from safetensors.torch import save_file

import diffusers.utils.import_utils as _iu  # noqa: E402  (see make_transformer.py)
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"

import diffusers  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline  # noqa: E402

SEED_EMBEDS = 61
CASES = [
    # one prompt, mask all ones (the pipeline drops it: the transformer gets None), no CFG
    dict(name="basic", prompt_lengths=[6], negative_lengths=None, height=48, width=80,
         num_inference_steps=3, true_cfg_scale=1.0, num_images_per_prompt=1, seed=42),
    # two prompts (5 and 9 real tokens, padded to 9), negatives (3 and 4, padded to 4), CFG 4,
    # two images per prompt (batch 4: p0, p0, p1, p1)
    dict(name="cfg", prompt_lengths=[5, 9], negative_lengths=[3, 4], height=64, width=64,
         num_inference_steps=4, true_cfg_scale=4.0, num_images_per_prompt=2, seed=7),
    # 50 x 70 is not a multiple of 16: a warning, then everything is floored to 48 x 64
    dict(name="odd", prompt_lengths=[7], negative_lengths=None, height=50, width=70,
         num_inference_steps=2, true_cfg_scale=1.0, num_images_per_prompt=1, seed=3),
    # custom sigmas: still time-shifted with mu and stretched to shift_terminal
    dict(name="sigmas", prompt_lengths=[4], negative_lengths=None, height=32, width=48,
         sigmas=[1.0, 0.6, 0.3], true_cfg_scale=1.0, num_images_per_prompt=1, seed=5),
]
CALL_KEYS = ["height", "width", "num_inference_steps", "sigmas", "true_cfg_scale",
             "num_images_per_prompt"]


def save_st(tensors, path):
    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)}, path,
              metadata={"format": "pt"})


def make_embeds(lengths, g):
    S = max(lengths)
    e = torch.randn((len(lengths), S, 64), generator=g, dtype=torch.float32)
    m = torch.zeros((len(lengths), S), dtype=torch.int64)
    for i, n in enumerate(lengths):
        e[i, n:] = 0
        m[i, :n] = 1
    return e, m


def run(pipe, case, emb, output_type, latents=None, record=None):
    kw = {k: case[k] for k in CALL_KEYS if k in case}
    kw.update(prompt_embeds=emb["pe"].clone(), prompt_embeds_mask=emb["pm"].clone())
    if "ne" in emb:
        kw.update(negative_prompt_embeds=emb["ne"].clone(), negative_prompt_embeds_mask=emb["nm"].clone())
    cb = None
    if record is not None:
        def cb(p, i, t, kwargs):
            record["step_latents"].append(kwargs["latents"].clone())
            return {}
    with torch.no_grad():
        return pipe(generator=torch.Generator("cpu").manual_seed(case["seed"]), latents=latents,
                    output_type=output_type, callback_on_step_end=cb, return_dict=False, **kw)[0]


def independent_check(case, info, out, B, cfg):
    """Schedule, mu, model t, CFG and Euler steps recomputed from the recorded outputs."""
    name = case["name"]
    n = len(out[f"{name}.timesteps"])
    s = (np.array(case["sigmas"]) if "sigmas" in case
         else np.linspace(1.0, 1 / n, n)).astype(np.float64)
    m = (cfg["max_shift"] - cfg["base_shift"]) / (cfg["max_image_seq_len"] - cfg["base_image_seq_len"])
    mu = info["image_seq_len"] * m + cfg["base_shift"] - m * cfg["base_image_seq_len"]
    assert abs(mu - info["mu"]) < 1e-12
    s = math.exp(mu) / (math.exp(mu) + (1 / s - 1))  # exponential time shift, sigma 1
    one_minus = 1 - s
    s = 1 - one_minus / (one_minus[-1] / (1 - cfg["shift_terminal"]))  # stretch to shift_terminal
    sig = torch.from_numpy(np.concatenate([s, [0.0]]))
    assert (sig - out[f"{name}.sigmas"].double()).abs().max() < 1e-6, (sig, out[f"{name}.sigmas"])
    lat = out[f"{name}.noise"].double()
    g = case["true_cfg_scale"]
    for i in range(n):
        assert abs(out[f"{name}.timesteps"][i].double() - 1000 * sig[i]) < 1e-3
        assert (out[f"{name}.model_t.{i}"].double() - sig[i]).abs().max() < 1e-6
        cond = out[f"{name}.noise_pred.{i}"].double()
        if f"{name}.neg_noise_pred.{i}" in out:
            neg = out[f"{name}.neg_noise_pred.{i}"].double()
            comb = neg + g * (cond - neg)
            pred = comb * (cond.norm(dim=-1, keepdim=True) / comb.norm(dim=-1, keepdim=True))
            assert (pred - out[f"{name}.guided.{i}"].double()).abs().max() < 1e-5
        else:
            pred = cond
        lat = lat + (sig[i + 1] - sig[i]) * pred
        d = (lat - out[f"{name}.step_latents.{i}"].double()).abs().max().item()
        assert d < 1e-5, (name, i, d)
        lat = out[f"{name}.step_latents.{i}"].double()


def main(outdir):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    root = os.path.join(outdir, "tiny_qwen_image")
    pipe = QwenImagePipeline.from_pretrained(root, text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    tr, vae, sch = pipe.transformer.eval(), pipe.vae.eval(), pipe.scheduler
    assert pipe.vae_scale_factor == 8
    cfg = {k: v for k, v in sorted(sch.config.items()) if not k.startswith("_")}
    g = torch.Generator().manual_seed(SEED_EMBEDS)
    out, meta = {}, {}
    for case in CASES:
        name = case["name"]
        emb = {}
        emb["pe"], emb["pm"] = make_embeds(case["prompt_lengths"], g)
        if case["negative_lengths"]:
            emb["ne"], emb["nm"] = make_embeds(case["negative_lengths"], g)
        B = len(case["prompt_lengths"]) * case["num_images_per_prompt"]

        rec = {"set_timesteps": [], "calls": [], "step_latents": [], "guided": []}
        orig_set = sch.set_timesteps

        @functools.wraps(orig_set)
        def set_timesteps(*a, **k):  # observe, then call through
            orig_set(*a, **k)
            rec["set_timesteps"].append(dict(mu=k.get("mu"), sigmas_in=[float(v) for v in k["sigmas"]],
                                             sigmas=sch.sigmas.clone(), timesteps=sch.timesteps.clone()))
        sch.set_timesteps = set_timesteps
        orig_step = sch.step

        def step(model_output, *a, **k):  # observe the prediction the scheduler gets
            rec["guided"].append(model_output.detach().clone())
            return orig_step(model_output, *a, **k)
        sch.step = step

        def hook(mod, args, kwargs, o):
            m = kwargs["encoder_hidden_states_mask"]
            rec["calls"].append(dict(t=kwargs["timestep"].clone(), out=o[0].detach().clone(),
                                     mask=None if m is None else m.clone(),
                                     ehs_shape=list(kwargs["encoder_hidden_states"].shape),
                                     img_shapes=[[list(s) for s in smp] for smp in kwargs["img_shapes"]]))
        h = tr.register_forward_hook(hook, with_kwargs=True)
        lat = run(pipe, case, emb, "latent", record=rec)
        h.remove()
        del sch.step
        img = run(pipe, case, emb, "np")
        del sch.set_timesteps
        st = rec["set_timesteps"][0]
        n = len(st["timesteps"])
        cfg_on = "ne" in emb and case["true_cfg_scale"] > 1
        assert len(rec["calls"]) == n * (2 if cfg_on else 1) and len(rec["step_latents"]) == n

        # initial noise, by hand: one randn call of [B, 1, 16, h, w], then 2x2 packing
        hl, wl = 2 * (case["height"] // 16), 2 * (case["width"] // 16)
        noise = torch.randn((B, 1, 16, hl, wl), generator=torch.Generator().manual_seed(case["seed"]),
                            dtype=torch.float32)
        noise = QwenImagePipeline._pack_latents(noise, B, 16, hl, wl)
        assert torch.equal(run(pipe, case, emb, "latent", latents=noise.clone()), lat)
        assert lat.shape == (B, (hl // 2) * (wl // 2), 64) and img.shape == (B, 8 * hl, 8 * wl, 3)
        # the decode, by hand
        z = QwenImagePipeline._unpack_latents(lat, case["height"], case["width"], 8)
        zin = z * torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1) + \
            torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        zin_pipe = z / (1.0 / torch.tensor(vae.config.latents_std).view(1, 16, 1, 1, 1)) + \
            torch.tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1)
        with torch.no_grad():
            dec = vae.decode(zin_pipe).sample
        mine = (dec[:, :, 0] / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()
        assert np.array_equal(mine, img), np.abs(mine - img).max()
        d_std = (zin - zin_pipe).abs().max().item()

        for j, c in enumerate(rec["calls"]):
            i, kind = (j // 2, "neg_noise_pred" if j % 2 else "noise_pred") if cfg_on else (j, "noise_pred")
            out[f"{name}.{kind}.{i}"] = c["out"]
            if kind == "noise_pred":
                out[f"{name}.model_t.{i}"] = c["t"]
            else:
                assert torch.equal(c["t"], out[f"{name}.model_t.{i}"])
        # The masks the transformer got: encode_prompt's `mask.repeat(1, n, 1).view(B n, S)` on a 2-D
        # mask orders the rows p0, p1, p0, p1 while the embeddings are p0, p0, p1, p1; an all-ones
        # mask is replaced by None.
        npp = case["num_images_per_prompt"]
        for key, kind in (("pm", "transformer_mask"), ("nm", "transformer_neg_mask")):
            if key not in emb:
                continue
            calls = [c for j, c in enumerate(rec["calls"]) if (j % 2 == 1) == (kind == "transformer_neg_mask")] \
                if cfg_on else rec["calls"]
            m = emb[key]
            expect = m.repeat(1, npp, 1).view(B, m.shape[1])
            if bool(expect.all()):
                assert all(c["mask"] is None for c in calls)
                continue
            assert all(torch.equal(c["mask"], expect) for c in calls)
            out[f"{name}.{kind}"] = expect
            if npp > 1 and len(case["prompt_lengths"]) > 1:
                assert not torch.equal(expect, m.repeat_interleave(npp, 0))  # not the embeds' order
        for i in range(n):
            out[f"{name}.step_latents.{i}"] = rec["step_latents"][i]
            if cfg_on:
                out[f"{name}.guided.{i}"] = rec["guided"][i]
            else:  # without CFG the scheduler gets the transformer output itself
                assert torch.equal(rec["guided"][i], out[f"{name}.noise_pred.{i}"])
        out[f"{name}.prompt_embeds"], out[f"{name}.prompt_embeds_mask"] = emb["pe"], emb["pm"]
        if "ne" in emb:
            out[f"{name}.negative_prompt_embeds"] = emb["ne"]
            out[f"{name}.negative_prompt_embeds_mask"] = emb["nm"]
        out[f"{name}.noise"] = noise
        out[f"{name}.sigmas"], out[f"{name}.timesteps"] = st["sigmas"], st["timesteps"]
        out[f"{name}.latents"] = lat
        out[f"{name}.image"] = torch.from_numpy(img.astype(np.float32))
        if name == "basic":
            out["basic.vae_input"], out["basic.vae_decoded"] = zin_pipe, dec

        info = {
            "arguments": dict({k: case[k] for k in CALL_KEYS if k in case}, seed=case["seed"],
                              generator="torch.Generator('cpu').manual_seed(seed)",
                              prompt_embeds=f"pipeline.safetensors:{name}.prompt_embeds",
                              prompt_embeds_mask=f"pipeline.safetensors:{name}.prompt_embeds_mask",
                              prompt_lengths=case["prompt_lengths"],
                              negative_prompt_embeds=(f"pipeline.safetensors:{name}.negative_prompt_embeds"
                                                      if "ne" in emb else None),
                              negative_prompt_embeds_mask=(f"pipeline.safetensors:{name}.negative_prompt_embeds_mask"
                                                           if "ne" in emb else None),
                              negative_lengths=case["negative_lengths"],
                              guidance_scale=None, max_sequence_length=512,
                              output_type=["latent", "np"]),
            "do_true_cfg": cfg_on,
            "batch": B,
            "latent_hw": [hl, wl],
            "packed_latents_shape": list(lat.shape),
            "image_shape": list(img.shape),
            "image_seq_len": (hl // 2) * (wl // 2),
            "mu": st["mu"],
            "sigmas_passed": st["sigmas_in"],
            "sigmas": st["sigmas"].tolist(),
            "timesteps": st["timesteps"].tolist(),
            "model_t": [out[f"{name}.model_t.{i}"][0].item() for i in range(n)],
            "transformer_calls": [dict(kind=("neg" if (cfg_on and j % 2) else "cond"),
                                       mask_passed=c["mask"] is not None,
                                       encoder_hidden_states_shape=c["ehs_shape"],
                                       img_shapes=c["img_shapes"]) for j, c in enumerate(rec["calls"])][:2],
            "clamped_fraction": float((img.reshape(-1) == 0).mean() + (img.reshape(-1) == 1).mean()),
        }
        for kind in ("transformer_mask", "transformer_neg_mask"):  # real tokens per row, or None
            t_ = out.get(f"{name}.{kind}")
            info[kind + "_lengths"] = None if t_ is None else t_.sum(1).tolist()
        meta[name] = info
        independent_check(case, info, out, B, cfg)
        print(f"{name}: latents {tuple(lat.shape)}, image {img.shape}, seq {info['image_seq_len']}, "
              f"mu {st['mu']:.6f}, sigmas {[round(v, 5) for v in info['sigmas']]}, "
              f"masks passed {[c['mask'] is not None for c in rec['calls'][:2]]}, "
              f"clamped {100 * info['clamped_fraction']:.1f}%, latents*std vs /(1/std) {d_std:.1e}")
    save_st(out, os.path.join(root, "pipeline.safetensors"))
    with open(os.path.join(root, "pipeline_cases.json"), "w") as f:
        f.write(json.dumps({"diffusers_version": diffusers.__version__, "scheduler_config": cfg,
                            "vae_scale_factor": pipe.vae_scale_factor, "cases": meta},
                           indent=2, sort_keys=True) + "\n")
    print(f"wrote {root}/pipeline.safetensors, pipeline_cases.json")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_pipeline.py OUT_DIR  (reads and writes OUT_DIR/tiny_qwen_image)")
    main(sys.argv[1])
