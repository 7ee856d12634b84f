#!/usr/bin/env python3
"""Makes tests/golden/z_image/train_step/: references of ONE training step of Diffusers'
examples/dreambooth/train_dreambooth_lora_z_image.py on the tiny Z-Image fixture (tiny_z_image/,
qwen3/text_encoder/, tokenizer/; re-making any of them means re-making this), for parity of the
model prediction, target, loss and gradients.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 + PEFT 0.20.1.dev0):
    ../shared/refstack2/run python3 tests/golden/z_image/make_train_step.py tests/golden/z_image
Re-running writes byte-identical files (float32 on one CPU thread, deterministic algorithms, fixed
seeds, safetensors with sorted keys and one metadata entry, JSON with sorted keys).

The training loop body (script lines ~1694-1800) is restated statement by statement with
Diffusers' real modules and functions: FlowMatchEulerDiscreteScheduler.from_pretrained(folder,
subfolder="scheduler") + copy.deepcopy, AutoencoderKL.from_pretrained(..., subfolder="vae"),
ZImageTransformer2DModel.from_pretrained(..., subfolder="transformer"), PEFT through
transformer.add_adapter(LoraConfig(...)), diffusers.training_utils'
compute_density_for_timestep_sampling / compute_loss_weighting_for_sd3, and ZImagePipeline's own
encode_prompt (a pipeline built with vae=None, transformer=None, scheduler=None, as the script's
text_encoding_pipeline) driven by make_sample_e2e.py's plain-Python tokenizer and plain-torch
Qwen3 (transformers is not available). Pixel values are fed directly (seeded rand in [-1, 1]),
in place of the dataset's resize / crop / ToTensor / Normalize([0.5], [0.5]).

Cases (see CASES): lora (weighting "none"), lora_logit_normal_prior (logit_normal + prior
preservation), lora_sigma_sqrt (48 x 32 images), full (full fine-tuning, case lora's draws).

Writes, under OUT/train_step/:
  step.safetensors  schedule.timesteps / schedule.sigmas [1000] (the scheduler copy's tables), and
                    per case <case>.pixel_values, .prompt_embeds.<j>, .latent_mode, .model_input,
                    .noise, .u, .indices (int64), .timesteps, .sigmas, .noisy_model_input,
                    .timestep_normalized, .model_pred, .target, .weighting, .loss (+ .prior_loss,
                    .instance_loss), .grad.<param>, and for LoRA cases .lora.<param>
  cases.json        every argument, the scheduler config, shapes, gradient max-abs per tensor and
                    group, the order of operations, the semantics observed, the checks' results

Checks (the outputs do not depend on them): the loss recomputed in float64 from the recorded
model_pred / target / weighting; for case lora, a float64 copy of the transformer gives float64
gradients (compared with the float32 ones) and central finite differences on 3 scalar LoRA
parameters (relative error < 1e-2 against the float32 gradients); the script's global-RNG draws
(torch.manual_seed, randn_like on the channels-last model_input, then u without a generator)
equal empty_like(model_input).normal_(generator=g) then u with generator=g; the prompt
embeddings equal make_sample_e2e.encode_prompts'.
"""
import copy
import json
import os
import sys

import numpy as np
import torch

sys.dont_write_bytecode = True  # no __pycache__ next to the imported make_*.py
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# make_sample_e2e flips Diffusers' transformers-availability flag before diffusers.loaders is
# imported (see make_transformer.py) and imports ZImagePipeline; nothing of transformers runs.
import make_sample_e2e as e2e  # noqa: E402

import diffusers  # noqa: E402
import peft  # noqa: E402
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel  # noqa: E402
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline  # noqa: E402

# diffusers.training_utils, at import, calls transformers.integrations.deepspeed.
# is_deepspeed_zero3_enabled() when is_transformers_available(): with the flag flipped that reaches
# refstack2's stub and raises. Import it with the flag False for that moment (the check only
# decides whether to import deepspeed), then put it back.
import diffusers.utils.import_utils as _iu  # noqa: E402
_iu._transformers_available = False
from diffusers.training_utils import (  # noqa: E402
    compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3)
_iu._transformers_available = True
from peft import LoraConfig  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

# The script's arguments that matter for one step (defaults unless noted).
ARGS = dict(
    instance_prompt="a photo of sks dog", class_prompt="a photo of dog",
    max_sequence_length=512, rank=4, lora_alpha=4, lora_dropout=0.0, lora_layers=None,
    logit_mean=0.0, logit_std=1.0, mode_scale=1.29, prior_loss_weight=1.0,
    gradient_accumulation_steps=1, max_grad_norm=1.0, mixed_precision="no (float32)",
    cache_latents=False, offload=False, gradient_checkpointing=False,
)
TARGET_MODULES = ["to_k", "to_q", "to_v", "to_out.0"]  # args.lora_layers None
LORA_INIT_SEED = 20261212  # torch.manual_seed before add_adapter (PEFT's gaussian A init)
LORA_B_SEED, LORA_B_STD = 20261213, 0.05  # B overwritten (gaussian init leaves it zero)

CASES = [
    dict(name="lora", lora=True, weighting_scheme="none", with_prior_preservation=False,
         train_batch_size=2, height=32, width=32, pixel_seed=101, draw_seed=201),
    dict(name="lora_logit_normal_prior", lora=True, weighting_scheme="logit_normal",
         with_prior_preservation=True, prior_loss_weight=0.5, train_batch_size=2, height=32,
         width=32, pixel_seed=102, draw_seed=202),
    dict(name="lora_sigma_sqrt", lora=True, weighting_scheme="sigma_sqrt",
         with_prior_preservation=False, train_batch_size=2, height=48, width=32, pixel_seed=103,
         draw_seed=203),
    # full fine-tuning (not what the script does: it trains LoRA only), case lora's inputs / draws
    dict(name="full", lora=False, weighting_scheme="none", with_prior_preservation=False,
         train_batch_size=2, height=32, width=32, pixel_seed=101, draw_seed=201),
]
FULL_PREFIXES = ("layers.1.", "all_final_layer.", "x_pad_token", "cap_pad_token")

ORDER = [
    "prompts = [instance_prompt] * bsz (+ [class_prompt] * bsz with prior preservation: collate_fn "
    "appends the class examples after the instance ones)",
    "prompt_embeds = [pe for pe in prompt_embeds for _ in range(len(prompts))] (instance only; see "
    "prior_preservation_prompt_embeds for the prior case)",
    "model_input = vae.encode(pixel_values).latent_dist.mode()  (= the mean; float32)",
    "model_input = (model_input - vae.config.shift_factor) * vae.config.scaling_factor",
    "noise = torch.randn_like(model_input)  (global RNG, first draw; model_input is "
    "channels-last, so torch's serial normal_ path in (b, h, w, c) memory order)",
    "u = compute_density_for_timestep_sampling(weighting_scheme, batch_size=bsz, logit_mean, "
    "logit_std, mode_scale)  (global RNG, second draw)",
    "indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()  (truncation)",
    "timesteps = noise_scheduler_copy.timesteps[indices]",
    "sigmas = get_sigmas(timesteps, n_dim=4): noise_scheduler_copy.sigmas[position of each "
    "timestep in noise_scheduler_copy.timesteps, found by ==], shape [B, 1, 1, 1]",
    "noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise",
    "timestep_normalized = (1000 - timesteps) / 1000",
    "model_pred_list = transformer(list(noisy_model_input.unsqueeze(2).unbind(0)), "
    "timestep_normalized, prompt_embeds, return_dict=False)[0]",
    "model_pred = -torch.stack(model_pred_list, dim=0).squeeze(2)",
    "weighting = compute_loss_weighting_for_sd3(weighting_scheme, sigmas)  ([B, 1, 1, 1])",
    "target = noise - model_input",
    "prior preservation: model_pred, model_pred_prior = chunk(model_pred, 2, 0); target, "
    "target_prior = chunk(target, 2, 0); prior_loss = mean_b(mean_elements(weighting * "
    "(model_pred_prior - target_prior)^2)). The script does NOT chunk weighting (raises for "
    "bsz >= 2, see literal_script_loss); here weighting, weighting_prior = chunk(weighting, 2, 0)",
    "loss = mean_b(mean_elements(weighting * (model_pred - target)^2)), per sample .reshape(B, -1)"
    ".mean(1) then .mean() (float32)",
    "prior preservation: loss = loss + prior_loss_weight * prior_loss",
    "accelerator.backward(loss): loss / gradient_accumulation_steps (1) then .backward()",
    "(not recorded: clip_grad_norm_(transformer.parameters(), max_grad_norm), optimizer.step(); "
    "grad_norm_before_clip is in the JSON)",
]


def t32(x):
    return x.detach().to(torch.float32).contiguous().clone()


def load_models(tiny):
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(tiny, subfolder="scheduler")
    sched_copy = copy.deepcopy(sched)
    vae = AutoencoderKL.from_pretrained(tiny, subfolder="vae")
    tr = ZImageTransformer2DModel.from_pretrained(tiny, subfolder="transformer",
                                                  torch_dtype=torch.float32)
    vae.requires_grad_(False)
    tr.requires_grad_(False)
    return sched_copy, vae, tr


def add_lora(tr):
    torch.manual_seed(LORA_INIT_SEED)
    tr.add_adapter(LoraConfig(r=ARGS["rank"], lora_alpha=ARGS["lora_alpha"],
                              lora_dropout=ARGS["lora_dropout"], init_lora_weights="gaussian",
                              target_modules=TARGET_MODULES))
    g = torch.Generator().manual_seed(LORA_B_SEED)
    with torch.no_grad():
        for name, p in tr.named_parameters():  # name order
            if ".lora_B." in name:
                assert p.abs().max() == 0  # gaussian init: B zero
                p.copy_(LORA_B_STD * torch.randn(p.shape, generator=g, dtype=torch.float32))


def get_sigmas(sched_copy, timesteps, n_dim=4, dtype=torch.float32):
    """The script's get_sigmas, verbatim but for the closure."""
    sigmas = sched_copy.sigmas.to(dtype=dtype)
    schedule_timesteps = sched_copy.timesteps
    step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
    sigma = sigmas[step_indices].flatten()
    while len(sigma.shape) < n_dim:
        sigma = sigma.unsqueeze(-1)
    return sigma, step_indices


def losses(model_pred, target, weighting, prior, prior_loss_weight, f=lambda x: x.float()):
    """The script's loss block, except that under prior preservation the weighting is chunked
    as well (the script multiplies the half batch by the full [2B, 1, 1, 1] weighting, which
    raises for B >= 2: see literal_weighting_error)."""
    out = {}
    if prior:
        model_pred, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
        target, target_prior = torch.chunk(target, 2, dim=0)
        weighting, weighting_prior = torch.chunk(weighting, 2, dim=0)
        prior_loss = torch.mean(
            (f(weighting_prior) * (f(model_pred_prior) - f(target_prior)) ** 2).reshape(
                target_prior.shape[0], -1), 1)
        out["prior_loss"] = prior_loss.mean()
    loss = torch.mean(
        (f(weighting) * (f(model_pred) - f(target)) ** 2).reshape(target.shape[0], -1), 1)
    loss = loss.mean()
    if prior:
        out["instance_loss"] = loss
        loss = loss + prior_loss_weight * out["prior_loss"]
    out["loss"] = loss
    return out


def literal_weighting_error(model_pred, target, weighting):
    """The script's own prior-loss expression (weighting not chunked)."""
    _, model_pred_prior = torch.chunk(model_pred, 2, dim=0)
    _, target_prior = torch.chunk(target, 2, dim=0)
    try:
        torch.mean((weighting.float() * (model_pred_prior.float() - target_prior.float()) ** 2)
                   .reshape(target_prior.shape[0], -1), 1)
        return None
    except RuntimeError as e:
        return f"RuntimeError: {e}"


def loss64_ref(model_pred, target, weighting, prior, plw):
    """Float64, written independently: per-sample sums of w_i * (p - t)^2 / numel, averaged."""
    p, t, w = model_pred.double(), target.double(), weighting.double().flatten()
    B = p.shape[0]
    per = [(w[i] * ((p[i] - t[i]) ** 2).sum() / p[i].numel()).item() for i in range(B)]
    if not prior:
        return {"loss": sum(per) / B}
    h = B // 2
    inst, pri = sum(per[:h]) / h, sum(per[h:]) / h
    return {"instance_loss": inst, "prior_loss": pri, "loss": inst + plw * pri}


def forward_loss(tr, noisy, tn, prompt_embeds, target, weighting, prior, plw, f=lambda x: x.float()):
    lst = list(noisy.unsqueeze(2).unbind(dim=0))
    pred_list = tr(lst, tn, prompt_embeds, return_dict=False)[0]
    model_pred = -torch.stack(pred_list, dim=0).squeeze(2)
    return model_pred, losses(model_pred, target, weighting, prior, plw, f)


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    tiny = os.path.join(HERE, "tiny_z_image")
    odir = os.path.join(out, "train_step")
    os.makedirs(odir, exist_ok=True)

    # ---- text encoding: the script's text_encoding_pipeline.encode_prompt ----------------------
    tok = e2e.Tokenizer(os.path.join(HERE, "tokenizer"))
    te = e2e.TextEncoder(e2e.load_qwen3(os.path.join(HERE, "qwen3", "text_encoder")))
    text_pipe = ZImagePipeline(scheduler=None, vae=None, text_encoder=te, tokenizer=tok,
                               transformer=None)

    def compute_text_embeddings(prompt):
        with torch.no_grad():
            prompt_embeds, _ = text_pipe.encode_prompt(
                prompt=prompt, max_sequence_length=ARGS["max_sequence_length"])
        return prompt_embeds

    instance_hs = compute_text_embeddings(ARGS["instance_prompt"])
    class_hs = compute_text_embeddings(ARGS["class_prompt"])
    assert isinstance(instance_hs, list) and len(instance_hs) == 1 and len(class_hs) == 1
    enc_info = {}
    for p, hs in ((ARGS["instance_prompt"], instance_hs), (ARGS["class_prompt"], class_hs)):
        ref = e2e.encode_prompts(tok, te, [p], ARGS["max_sequence_length"])
        assert torch.equal(ref["embeds"][0], hs[0])
        enc_info[p] = {"rendered": ref["texts"][0], "length": int(hs[0].shape[0]),
                       "real_ids": ref["input_ids"][0][:hs[0].shape[0]].tolist()}
    # The script under prior preservation: torch.cat of the two LISTS raises.
    try:
        torch.cat([instance_hs, class_hs], dim=0)
        cat_error = None
    except TypeError as e:
        cat_error = f"TypeError: {e}"
    assert cat_error is not None

    # ---- schedule --------------------------------------------------------------------------
    sched_copy, _, _ = load_models(tiny)
    N = sched_copy.config.num_train_timesteps
    sched_cfg = {k: v for k, v in sorted(sched_copy.config.items()) if not k.startswith("_")}
    tensors = {"schedule.timesteps": t32(sched_copy.timesteps),
               "schedule.sigmas": t32(sched_copy.sigmas)}
    assert sched_copy.timesteps.dtype == torch.float32 and sched_copy.sigmas.shape == (N,)
    # the table: s_k = (N - k) / N, shifted s' = shift s / (1 + (shift - 1) s), t = s' N (float32)
    s = torch.from_numpy(np.linspace(1, N, N, dtype=np.float32)[::-1].copy()) / N
    sh = sched_cfg["shift"]
    assert torch.equal(sh * s / (1 + (sh - 1) * s), sched_copy.sigmas)
    assert torch.equal(sched_copy.sigmas * N, sched_copy.timesteps)
    assert len(set(sched_copy.timesteps.tolist())) == N  # get_sigmas' == lookup is unique

    meta_cases = {}
    for case in CASES:
        name, bsz, prior = case["name"], case["train_batch_size"], case["with_prior_preservation"]
        plw = case.get("prior_loss_weight", ARGS["prior_loss_weight"])
        sched_copy, vae, tr = load_models(tiny)
        if case["lora"]:
            add_lora(tr)
        else:
            tr.requires_grad_(True)
        tr.train()
        trainable = [n for n, p in tr.named_parameters() if p.requires_grad]
        if case["lora"]:
            assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n
                                     for n in trainable)
            assert len(trainable) == sum(1 for n, _ in tr.named_parameters() if ".lora_" in n)

        # batch: instance pixel values first, then class (collate_fn)
        gp = torch.Generator().manual_seed(case["pixel_seed"])
        shape = (bsz, 3, case["height"], case["width"])
        pv = [torch.rand(shape, generator=gp, dtype=torch.float32) * 2 - 1]
        prompts = [ARGS["instance_prompt"]] * bsz
        if prior:
            pv.append(torch.rand(shape, generator=gp, dtype=torch.float32) * 2 - 1)
            prompts += [ARGS["class_prompt"]] * bsz
        pixel_values = torch.cat(pv, 0).contiguous()
        B = pixel_values.shape[0]

        # prompt embeds
        if not prior:
            prompt_embeds = instance_hs
            prompt_embeds = [pe for pe in prompt_embeds for _ in range(len(prompts))]
            embeds_src = [0] * B
            literal = None
        else:
            # intended: instance embeds for the instance half, class embeds for the class half
            prompt_embeds = [pe for pe in instance_hs for _ in range(bsz)] + \
                            [pe for pe in class_hs for _ in range(bsz)]
            embeds_src = [0] * bsz + [1] * bsz
            # with the cat made a list concatenation, the loop's repetition by len(prompts) = 2 bsz
            literal_list = [pe for pe in instance_hs + class_hs for _ in range(len(prompts))]
            literal = {"length": len(literal_list),
                       "sources": [0] * len(prompts) + [1] * len(prompts),
                       "used_by_transformer_zip": [0] * B}
        assert len(prompt_embeds) == B

        with torch.no_grad():
            latent_mode = vae.encode(pixel_values).latent_dist.mode()
        model_input = (latent_mode - vae.config.shift_factor) * vae.config.scaling_factor

        # the script's draws: global RNG (set_seed), randn_like then compute_density without a
        # generator. model_input comes out of the VAE channels-last (strides (C h w, 1, w C, C)),
        # randn_like keeps that layout, and normal_ on a tensor that is not contiguous in the
        # default format takes torch's serial per-element path (not the 16-wide vectorised
        # Box-Muller of a contiguous randn), in memory order (b, h, w, c): so the noise is NOT
        # torch.randn(model_input.shape) for the same seed.
        torch.manual_seed(case["draw_seed"])
        noise = torch.randn_like(model_input)
        u = compute_density_for_timestep_sampling(
            weighting_scheme=case["weighting_scheme"], batch_size=B, logit_mean=ARGS["logit_mean"],
            logit_std=ARGS["logit_std"], mode_scale=ARGS["mode_scale"])
        strides = list(model_input.stride())
        b_, c_, h_, w_ = model_input.shape
        noise_is_channels_last = strides == [c_ * h_ * w_, 1, w_ * c_, c_]
        assert noise_is_channels_last and list(noise.stride()) == strides
        # the same with a seeded generator: the serial path on a channels-last tensor, then u
        g = torch.Generator().manual_seed(case["draw_seed"])
        assert torch.equal(torch.empty_like(model_input).normal_(generator=g), noise)
        assert torch.equal(compute_density_for_timestep_sampling(
            weighting_scheme=case["weighting_scheme"], batch_size=B, logit_mean=ARGS["logit_mean"],
            logit_std=ARGS["logit_std"], mode_scale=ARGS["mode_scale"], generator=g), u)
        torch.manual_seed(case["draw_seed"])
        differs_from_contiguous_randn = not torch.equal(torch.randn(tuple(model_input.shape)), noise)
        indices = (u * sched_copy.config.num_train_timesteps).long()
        timesteps = sched_copy.timesteps[indices]
        sigmas, step_indices = get_sigmas(sched_copy, timesteps, n_dim=model_input.ndim,
                                          dtype=model_input.dtype)
        assert step_indices == indices.tolist()
        noisy = (1.0 - sigmas) * model_input + sigmas * noise
        tn = (1000 - timesteps) / 1000
        weighting = compute_loss_weighting_for_sd3(weighting_scheme=case["weighting_scheme"],
                                                   sigmas=sigmas)
        target = noise - model_input

        model_pred, L = forward_loss(tr, noisy, tn, prompt_embeds, target, weighting, prior, plw)
        L["loss"].backward()
        grads = {n: p.grad.detach().clone() if p.grad is not None else None
                 for n, p in tr.named_parameters() if p.requires_grad}
        params = {n: p.detach().clone() for n, p in tr.named_parameters() if p.requires_grad}
        no_grad = sorted(n for n, v in grads.items() if v is None)
        gnorm = torch.nn.utils.clip_grad_norm_(
            [p for p in tr.parameters() if p.requires_grad], ARGS["max_grad_norm"]).item()

        # ---- checks ----------------------------------------------------------------------
        ref = loss64_ref(model_pred, target, weighting, prior, plw)
        loss_check = {k: abs(ref[k] - L[k].item()) / max(abs(ref[k]), 1e-30)
                      for k in ("loss", "instance_loss", "prior_loss") if k in L}
        assert max(loss_check.values()) < 1e-6, loss_check
        # the target / noisy input recomputed in float64
        mi64, n64, s64 = model_input.double(), noise.double(), sigmas.double()
        assert ((1 - s64) * mi64 + s64 * n64 - noisy.double()).abs().max() < 1e-6
        assert torch.equal(tn, ((1000 - timesteps) / 1000))

        # literal-prior variant: the loss if the cat were a list concatenation (zip truncates)
        literal_loss = None
        if literal is not None:
            with torch.no_grad():
                _, Ll = forward_loss(tr, noisy, tn, literal_list, target, weighting, prior, plw)
            literal_loss = Ll["loss"].item()

        fd_info = None
        if name == "lora":
            fd_info = fd_check(tr, noisy, tn, prompt_embeds, target, weighting, grads)

        # ---- record ----------------------------------------------------------------------
        pre = f"{name}."
        rec = {"pixel_values": pixel_values, "latent_mode": latent_mode, "model_input": model_input,
               "noise": noise, "u": u, "timesteps": timesteps, "sigmas": sigmas,
               "noisy_model_input": noisy, "timestep_normalized": tn, "model_pred": model_pred,
               "target": target, "weighting": weighting}
        for k, v in L.items():
            rec[k] = v
        for k, v in rec.items():
            tensors[pre + k] = t32(v)
        tensors[pre + "indices"] = indices.clone()
        tensors[pre + "prompt_embeds.0"] = t32(instance_hs[0])
        if prior:
            tensors[pre + "prompt_embeds.1"] = t32(class_hs[0])

        if case["lora"]:
            kept = sorted(grads)
            for n in kept:
                tensors[pre + "grad." + n] = t32(grads[n])
                tensors[pre + "lora." + n] = t32(params[n])
        else:
            kept = sorted(n for n in grads if n.startswith(FULL_PREFIXES))
            for n in kept:
                tensors[pre + "grad." + n] = t32(grads[n])
        assert not no_grad, no_grad

        def grp(n):
            if case["lora"]:
                return "lora_A" if ".lora_A." in n else "lora_B"
            for p in FULL_PREFIXES:
                if n.startswith(p):
                    return p.rstrip(".")
            return n.split(".")[0] + (("." + n.split(".")[1]) if n.split(".")[1].isdigit() else "")
        groups = {}
        for n, v in grads.items():
            groups[grp(n)] = max(groups.get(grp(n), 0.0), v.abs().max().item())

        info = {
            "arguments": {**{k: v for k, v in case.items() if k != "name"},
                          "prior_loss_weight": plw, "num_images_in_batch": B,
                          "prompts": prompts},
            "shapes": {k: list(tensors[pre + k].shape) for k in
                       ["pixel_values", "latent_mode", "model_input", "noise", "u", "indices",
                        "timesteps", "sigmas", "noisy_model_input", "timestep_normalized",
                        "model_pred", "target", "weighting", "loss"]},
            "prompt_embeds_sources": embeds_src,
            "prompt_embeds_lengths": [int(e.shape[0]) for e in prompt_embeds],
            "values": {"u": u.tolist(), "indices": indices.tolist(),
                       "timesteps": timesteps.tolist(), "sigmas": sigmas.flatten().tolist(),
                       "timestep_normalized": tn.tolist(),
                       "weighting": weighting.flatten().tolist(),
                       **{k: v.item() for k, v in L.items()}},
            "model_input_strides": strides,
            "noise_drawn_in_bhwc_order": noise_is_channels_last,
            "noise_differs_from_contiguous_randn_same_seed": differs_from_contiguous_randn,
            "trainable_parameters": len(trainable),
            "trainable_values": sum(tr.get_parameter(n).numel() for n in trainable),
            "recorded_grads": len(kept),
            "grad_max_abs": {n: grads[n].abs().max().item() for n in kept},
            "grad_group_max_abs": dict(sorted(groups.items())),
            "grad_norm_before_clip": gnorm,
            "clip_would_scale": gnorm > ARGS["max_grad_norm"],
            "params_without_grad": no_grad,
            "checks": {"loss_float64_rel_diff": loss_check, "loss_float64": ref},
        }
        if prior:
            info["literal_script_loss"] = {
                "error": literal_weighting_error(model_pred, target, weighting),
                "note": "the script does not chunk weighting: weighting [2B,1,1,1] * the half "
                        "batch [B,C,h,w] raises for B >= 2; for B = 1 it broadcasts to "
                        "[2,C,h,w] and reshape(1, -1).mean(1) averages both halves' weights "
                        "(each half's loss = mean(w) * mean((p - t)^2)). Recorded: weighting "
                        "chunked like model_pred and target (with logit_normal the weights "
                        "are all 1, so every reading agrees)"}
            info["literal_script_prompt_embeds"] = {
                "torch_cat_error": cat_error, **literal,
                "loss_if_cat_were_list_concatenation": literal_loss,
                "note": "recorded tensors use the intended list [instance x bsz, class x bsz]"}
        if case["lora"]:
            info["lora"] = {"r": ARGS["rank"], "lora_alpha": ARGS["lora_alpha"],
                            "scaling": ARGS["lora_alpha"] / ARGS["rank"],
                            "target_modules": TARGET_MODULES, "init_lora_weights": "gaussian",
                            "A": f"PEFT's gaussian init (normal std 1/r) after "
                                 f"torch.manual_seed({LORA_INIT_SEED})",
                            "B": f"{LORA_B_STD} * randn, torch.Generator().manual_seed("
                                 f"{LORA_B_SEED}), in named_parameters order",
                            "modules": sorted({n.split(".lora_")[0] for n in trainable})}
        else:
            pads = {n: grads[n].abs().max().item() for n in ("x_pad_token", "cap_pad_token")}
            info["pad_token_grad_max_abs"] = pads
            info["pad_tokens_get_grad"] = {k: v > 0 for k, v in pads.items()}
            info["recorded_prefixes"] = list(FULL_PREFIXES)
            # same inputs / draws as case lora
            for k in ("pixel_values", "noise", "u"):
                assert torch.equal(tensors["full." + k], tensors["lora." + k])
        if fd_info is not None:
            info["checks"]["finite_differences"] = fd_info
        meta_cases[name] = info
        print(f"{name}: B {B}, loss {L['loss'].item():.6f} (float64 rel diff "
              f"{max(loss_check.values()):.1e}), t {[round(x, 3) for x in timesteps.tolist()]}, "
              f"{len(kept)} grads recorded, groups {info['grad_group_max_abs']}, "
              f"grad norm {gnorm:.4f}" + (f", literal-prior loss {literal_loss:.6f}"
                                          if literal_loss is not None else ""))

    save_file({k: tensors[k].contiguous() for k in sorted(tensors)},
              os.path.join(odir, "step.safetensors"), metadata={"format": "pt"})
    doc = {
        "diffusers_version": diffusers.__version__, "peft_version": peft.__version__,
        "torch_version": torch.__version__,
        "script": "diffusers/examples/dreambooth/train_dreambooth_lora_z_image.py",
        "arguments": ARGS, "lora_target_modules": TARGET_MODULES,
        "scheduler_config": sched_cfg, "num_train_timesteps": N,
        "vae": {"shift_factor": vae.config.shift_factor, "scaling_factor": vae.config.scaling_factor},
        "prompts": enc_info,
        "order_of_operations": ORDER,
        "semantics": {
            "schedule": "noise_scheduler_copy (from_pretrained, never set_timesteps): timesteps "
                        "float32 descending; sigmas_k = shift s / (1 + (shift - 1) s) with "
                        "s = (N - k) / N, k = 0..N-1 (no terminal 0, no dynamic shifting); "
                        "timesteps_k = sigmas_k * N. Index 0 = t 1000, sigma 1 (pure noise); "
                        "index N-1 = the smallest sigma (shift 3: 0.002994).",
            "indices": "(u * N).long(): truncation toward zero; u in [0, 1) so 0..N-1. The "
                       "sampled u is NOT a sigma: sigma = shifted((N - floor(u N)) / N), so "
                       "small u means high noise.",
            "timestep_normalized": "(1000 - timesteps) / 1000 in float32: 1 = clean, the "
                                   "transformer's t",
            "prompt_embeds": "encode_prompt(prompt, max_sequence_length) -> list of one "
                             "[L, 48] tensor (real positions only); repeated per batch element",
            "prior_preservation_prompt_embeds": (
                "the script does prompt_embeds = torch.cat([instance_list, class_list], dim=0), "
                "which raises " + cat_error + " (encode_prompt returns lists). Even with a list "
                "concatenation, the loop repeats each entry len(prompts) = 2 bsz times, giving "
                "4 bsz entries [inst x 2bsz, class x 2bsz], and patchify_and_embed zips them "
                "with the 2 bsz images, so every image (class images too) would get the "
                "instance prompt. Recorded here: the intended [instance x bsz, class x bsz], "
                "matching collate_fn's pixel order (instance first)."),
            "prompt_embeds_rebinding": "the loop rebinds prompt_embeds to the repeated list, so "
                                       "at step 2 it has bsz^2 entries (bsz^k at step k); zip "
                                       "truncation makes this harmless for a single prompt",
            "weighting": "none / logit_normal / mode: ones; sigma_sqrt: sigmas ** -2 (1 / sigma^2, "
                         "despite the name); cosmap: 2 / (pi (1 - 2 sigma + 2 sigma^2)); shape "
                         "[B, 1, 1, 1]",
            "density": "none / sigma_sqrt / cosmap: u = rand(B); logit_normal: u = "
                       "sigmoid(normal(logit_mean, logit_std, (B,))); mode: u = 1 - v - mode_scale "
                       "(cos(pi v / 2)^2 - 1 + v), v = rand(B)",
            "loss": "per sample mean over C*h*w of weighting * (model_pred - target)^2, then "
                    "mean over samples (float32); with prior preservation the two halves "
                    "separately, loss = instance + prior_loss_weight * prior",
            "gradients": "of that loss (gradient_accumulation_steps 1 divides by 1), before "
                         "clip_grad_norm_(max_grad_norm 1.0)",
        },
        "draws": "per case the script's global-RNG calls after torch.manual_seed(draw_seed): "
                 "noise = torch.randn_like(model_input) first, then u from "
                 "compute_density_for_timestep_sampling (no generator). model_input is "
                 "channels-last (the VAE's output layout) and randn_like keeps it; normal_ on a "
                 "tensor not contiguous in the default format takes torch's serial per-element "
                 "path in memory order (b, h, w, c), not the vectorised fill of a contiguous "
                 "randn, so the noise is not torch.randn(shape) for the seed (checked). Equal to "
                 "torch.empty_like(model_input).normal_(generator=g) then u with generator=g, g = "
                 "torch.Generator('cpu').manual_seed(draw_seed) (checked). pixel_values = "
                 "rand(B, 3, H, W) * 2 - 1 from Generator().manual_seed(pixel_seed) (instance, "
                 "then class)",
        "cases": meta_cases,
    }
    with open(os.path.join(odir, "cases.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(doc, ensure_ascii=False, indent=2, sort_keys=True) + "\n")
    print(f"wrote {odir}/step.safetensors, cases.json")


def fd_check(tr, noisy, tn, prompt_embeds, target, weighting, grads32):
    """Float64 gradients of a double copy, and central differences on 3 scalars."""
    tr64 = copy.deepcopy(tr).double()
    tr64.zero_grad(set_to_none=True)
    args = (noisy.double(), tn.double(), [e.double() for e in prompt_embeds], target.double(),
            weighting.double(), False, 1.0, lambda x: x)  # the loss in float64 too
    _, L = forward_loss(tr64, *args)
    L["loss"].backward()
    g64 = {n: p.grad.detach().clone() for n, p in tr64.named_parameters() if p.requires_grad}
    rel = max(((grads32[n].double() - g64[n]).abs().max() / g64[n].abs().max()).item()
              for n in g64)
    probes = ["layers.0.attention.to_q.lora_A.default.weight",
              "noise_refiner.0.attention.to_v.lora_B.default.weight",
              "context_refiner.0.attention.to_out.0.lora_A.default.weight"]
    out = {"loss_float64": L["loss"].item(),
           "grad_float32_vs_float64_max_rel": rel, "probes": []}
    eps = 1e-3  # the float64 copy still runs RoPE (x.float()) and the sinusoid in float32
    for n in probes:
        p = tr64.get_parameter(n)
        flat = int(g64[n].abs().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), p.shape))
        vals = []
        with torch.no_grad():
            orig = p[idx].item()
            for s in (+1, -1):
                p[idx] = orig + s * eps
                vals.append(forward_loss(tr64, *args)[1]["loss"].item())
            p[idx] = orig
        fd = (vals[0] - vals[1]) / (2 * eps)
        g32 = grads32[n][idx].item()
        r32 = abs(fd - g32) / abs(fd)
        assert r32 < 1e-2, (n, fd, g32)
        out["probes"].append({"param": n, "index": list(idx), "eps": eps, "fd_float64": fd,
                              "grad_float32": g32, "grad_float64": g64[n][idx].item(),
                              "rel_err_float32": r32,
                              "rel_err_float64": abs(fd - g64[n][idx].item()) / abs(fd)})
    print(f"  float64 copy: grads float32 vs float64 max rel {rel:.2e}; FD rel err "
          f"{[round(p['rel_err_float32'], 7) for p in out['probes']]}")
    return out


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_train_step.py OUT_DIR  (writes OUT_DIR/train_step/)")
    main(sys.argv[1])
