#!/usr/bin/env python3
"""Makes tests/golden/qwen_image/train_step/: references of ONE training step of Diffusers'
examples/dreambooth/train_dreambooth_lora_qwen_image.py on the tiny Qwen-Image fixtures
(tiny_qwen_image/{transformer,vae,scheduler}/, text_encoder/, tokenizer/; re-making any of them
means re-making this), for parity of the model prediction, target, loss and gradients.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 + PEFT 0.20.1.dev0):
    ../shared/refstack2/run python3 tests/golden/qwen_image/make_train_step.py tests/golden/qwen_image
Re-running writes byte-identical files (float32 on one CPU thread, deterministic algorithms, fixed
seeds, safetensors with sorted keys and one metadata entry, JSON with sorted keys).

The training loop body (script lines ~1690-1816) is restated statement by statement with
Diffusers' real modules and functions: FlowMatchEulerDiscreteScheduler.from_pretrained(folder,
subfolder="scheduler", shift=3.0) + copy.deepcopy, AutoencoderKLQwenImage.from_pretrained(...,
subfolder="vae"), QwenImageTransformer2DModel.from_pretrained(..., subfolder="transformer"), PEFT
through transformer.add_adapter(LoraConfig(...)), diffusers.training_utils'
compute_density_for_timestep_sampling / compute_loss_weighting_for_sd3, QwenImagePipeline's own
_pack_latents / _unpack_latents (static methods), the script's own helpers
concat_prompt_embedding_batches / _pad_prompt_embedding_pair / _materialize_prompt_embedding_mask
and get_sigmas (copied verbatim: the script imports transformers and cannot be imported), and
QwenImagePipeline's own encode_prompt (a pipeline built with vae=None, transformer=None,
scheduler=None, as the script's text_encoding_pipeline) driven by make_prompts.py's plain-Python
Qwen2Tokenizer and make_text_encoder.py's plain-torch Qwen2.5-VL language model (transformers is
not available). Pixel values are fed directly (seeded rand in [-1, 1], [B, 3, H, W], then
collate_fn's unsqueeze(2) to [B, 3, 1, H, W]) in place of the dataset's resize / crop / to_tensor
/ normalize([0.5], [0.5]).

Cases (see CASES): lora (weighting "none"), lora_logit_normal_prior (logit_normal + prior
preservation with a class prompt), lora_sigma_sqrt (48 x 32 images), full (full fine-tuning,
case lora's inputs and draws; every transformer parameter's gradient).

Writes, under OUT/train_step/:
  step.safetensors  schedule.timesteps / schedule.sigmas [1000] (the scheduler copy's tables),
                    normalisation.latents_mean / .latents_std_inv [1, 16, 1, 1, 1], and per case
                    <case>.pixel_values, .prompt_embeds (+ .prompt_embeds_mask when not None),
                    .posterior_mean, .posterior_std, .posterior_eps, .latent_sample, .model_input,
                    .noise, .u, .indices (int64), .timesteps, .sigmas, .noisy_model_input,
                    .packed_noisy_model_input, .timestep_model, .model_pred_packed, .model_pred,
                    .target, .weighting, .loss (+ .prior_loss, .instance_loss), .grad.<param>,
                    and for LoRA cases .lora.<param>
  cases.json        every argument, the scheduler config, shapes, gradient max-abs per tensor and
                    group, the order of operations, the semantics observed, the checks' results

Checks (the outputs do not depend on them): the loss recomputed in float64 from the recorded
model_pred / target / weighting; for case lora, a float64 copy of the transformer gives float64
gradients (compared with the float32 ones) and central finite differences on 3 scalar LoRA
parameters (relative error < 1e-2 against the float32 gradients); the script's global-RNG draws
(torch.manual_seed, latent_dist.sample(), randn_like(model_input), then u, all without a
generator) equal latent_dist.sample(generator=g), empty_like(model_input).normal_(generator=g),
then u with generator=g; the prompt embeddings equal make_prompts' plain restatement; packing
equals an independent loop; the schedule tables equal their formula.
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
# make_prompts flips Diffusers' transformers-availability flag before diffusers.loaders is
# imported and imports QwenImagePipeline; nothing of transformers runs.
import make_prompts as mp  # noqa: E402

import diffusers  # noqa: E402
import peft  # noqa: E402
from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,  # noqa: E402
                       QwenImageTransformer2DModel)
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline  # noqa: E402

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
    cache_latents=False, offload=False, gradient_checkpointing=False, caption_dropout=0.0,
    scheduler_shift_argument=3.0,
)
TARGET_MODULES = ["to_k", "to_q", "to_v", "to_out.0"]  # args.lora_layers None
LORA_INIT_SEED = 20261212  # torch.manual_seed before add_adapter (PEFT's gaussian A init)
LORA_B_SEED, LORA_B_STD = 20261213, 0.05  # B overwritten (gaussian init leaves it zero)

CASES = [
    dict(name="lora", lora=True, weighting_scheme="none", with_prior_preservation=False,
         train_batch_size=2, height=32, width=48, pixel_seed=101, draw_seed=201),
    dict(name="lora_logit_normal_prior", lora=True, weighting_scheme="logit_normal",
         with_prior_preservation=True, prior_loss_weight=0.5, train_batch_size=2, height=32,
         width=48, pixel_seed=102, draw_seed=202),
    dict(name="lora_sigma_sqrt", lora=True, weighting_scheme="sigma_sqrt",
         with_prior_preservation=False, train_batch_size=2, height=48, width=32, pixel_seed=103,
         draw_seed=203),
    # full fine-tuning (not what the script does: it trains LoRA only), case lora's inputs / draws
    dict(name="full", lora=False, weighting_scheme="none", with_prior_preservation=False,
         train_batch_size=2, height=32, width=48, pixel_seed=101, draw_seed=201),
]

ORDER = [
    "text (once, before training): instance_prompt_embeds, instance_prompt_embeds_mask = "
    "text_encoding_pipeline.encode_prompt(prompt=instance_prompt, max_sequence_length=512) "
    "([1, L_i, 64] and None: a single prompt's mask is all ones and encode_prompt returns None); "
    "with prior preservation the same for class_prompt",
    "instance_pairs = [(instance_prompt_embeds, instance_prompt_embeds_mask)] * n_inst "
    "(caption_dropout 0: no random.random() draw)",
    "prior preservation: prompt_pairs = instance_pairs + [(class_prompt_embeds, "
    "class_prompt_embeds_mask)] * n_inst (collate_fn puts the class images after the instance "
    "ones)",
    "prompt_embeds, prompt_embeds_mask = concat_prompt_embedding_batches(*prompt_pairs): each "
    "None mask materialised as ones(int64); each pair right-padded with ZERO rows (embeds) and 0 "
    "(mask) to the longest L; cat along the batch; a merged mask that is all ones -> None",
    "pixel_values [B, 3, H, W] -> collate_fn: unsqueeze(2) -> [B, 3, 1, H, W], contiguous float32",
    "model_input = vae.encode(pixel_values).latent_dist.sample()  (global RNG, FIRST draw: "
    "eps = torch.randn(mean.shape) (randn_tensor, no generator); sample = mean + std * eps, "
    "std = exp(0.5 * clamp(logvar, -30, 20)))",
    "model_input = (model_input - latents_mean) * latents_std, latents_mean = "
    "tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1), latents_std = 1.0 / "
    "tensor(vae.config.latents_std).view(1, 16, 1, 1, 1) (a float32 reciprocal, then a multiply); "
    "[B, 16, 1, H/8, W/8]",
    "noise = torch.randn_like(model_input)  (global RNG, second draw; contiguous 5-D)",
    "bsz = model_input.shape[0]  (2 n_inst with prior preservation)",
    "u = compute_density_for_timestep_sampling(weighting_scheme, batch_size=bsz, logit_mean, "
    "logit_std, mode_scale)  (global RNG, third draw)",
    "indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()  (truncation)",
    "timesteps = noise_scheduler_copy.timesteps[indices]",
    "sigmas = get_sigmas(timesteps, n_dim=5): noise_scheduler_copy.sigmas[position of each "
    "timestep in noise_scheduler_copy.timesteps, found by ==], shape [B, 1, 1, 1, 1]",
    "noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise",
    "latent_height, latent_width = model_input.shape[3], model_input.shape[4]; img_shapes = "
    "[(1, latent_height // 2, latent_width // 2)] * bsz  (a list of TUPLES, one per sample)",
    "noisy_model_input = noisy_model_input.permute(0, 2, 1, 3, 4)  ([B, 1, 16, h, w])",
    "packed_noisy_model_input = QwenImagePipeline._pack_latents(noisy_model_input, B, 16, h, w): "
    "view(B, 16, h/2, 2, w/2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, h/2 * w/2, 64)",
    "model_pred = transformer(hidden_states=packed, encoder_hidden_states=prompt_embeds, "
    "encoder_hidden_states_mask=prompt_embeds_mask, timestep=timesteps / 1000, "
    "img_shapes=img_shapes, return_dict=False)[0]  ([B, N, 64])",
    "model_pred = QwenImagePipeline._unpack_latents(model_pred, latent_height * 8, latent_width * "
    "8, 8) -> [B, 16, 1, h, w]",
    "weighting = compute_loss_weighting_for_sd3(weighting_scheme, sigmas)  ([B, 1, 1, 1, 1])",
    "target = noise - model_input",
    "prior preservation: model_pred, model_pred_prior = chunk(model_pred, 2, 0); target, "
    "target_prior = chunk(target, 2, 0); weighting, weighting_prior = chunk(weighting, 2, 0); "
    "prior_loss = mean(weighting_prior * (model_pred_prior - target_prior)^2 reshaped (B/2, -1), "
    "dim 1).mean()",
    "loss = mean(weighting * (model_pred - target)^2 reshaped (B', -1), dim 1).mean() (float32)",
    "prior preservation: loss = loss + prior_loss_weight * prior_loss",
    "accelerator.backward(loss): loss / gradient_accumulation_steps (1) then .backward()",
    "(not recorded: clip_grad_norm_(transformer.parameters(), max_grad_norm), optimizer.step(); "
    "grad_norm_before_clip is in the JSON)",
]


# ---- the script's own helpers, verbatim (the script imports transformers, so it cannot be
# imported here) ----------------------------------------------------------------------------------

def _materialize_prompt_embedding_mask(prompt_embeds, prompt_embeds_mask):
    """Return a dense mask tensor for a prompt embedding batch."""
    batch_size, seq_len = prompt_embeds.shape[:2]
    if prompt_embeds_mask is None:
        return torch.ones((batch_size, seq_len), dtype=torch.long, device=prompt_embeds.device)
    if prompt_embeds_mask.shape != (batch_size, seq_len):
        raise ValueError(
            f"`prompt_embeds_mask` shape {prompt_embeds_mask.shape} must match prompt embeddings shape "
            f"({batch_size}, {seq_len})."
        )
    return prompt_embeds_mask.to(device=prompt_embeds.device)


def _pad_prompt_embedding_pair(prompt_embeds, prompt_embeds_mask, target_seq_len):
    """Pad one prompt embedding batch and its mask to a shared sequence length."""
    prompt_embeds_mask = _materialize_prompt_embedding_mask(prompt_embeds, prompt_embeds_mask)
    pad_width = target_seq_len - prompt_embeds.shape[1]
    if pad_width <= 0:
        return prompt_embeds, prompt_embeds_mask
    prompt_embeds = torch.cat(
        [prompt_embeds, prompt_embeds.new_zeros(prompt_embeds.shape[0], pad_width, prompt_embeds.shape[2])], dim=1
    )
    prompt_embeds_mask = torch.cat(
        [prompt_embeds_mask, prompt_embeds_mask.new_zeros(prompt_embeds_mask.shape[0], pad_width)], dim=1
    )
    return prompt_embeds, prompt_embeds_mask


def concat_prompt_embedding_batches(*prompt_embedding_pairs):
    """Concatenate prompt embedding batches while handling missing masks and length mismatches."""
    if not prompt_embedding_pairs:
        raise ValueError("At least one prompt embedding pair must be provided.")
    target_seq_len = max(prompt_embeds.shape[1] for prompt_embeds, _ in prompt_embedding_pairs)
    padded_pairs = [
        _pad_prompt_embedding_pair(prompt_embeds, prompt_embeds_mask, target_seq_len)
        for prompt_embeds, prompt_embeds_mask in prompt_embedding_pairs
    ]
    merged_prompt_embeds = torch.cat([prompt_embeds for prompt_embeds, _ in padded_pairs], dim=0)
    merged_mask = torch.cat([prompt_embeds_mask for _, prompt_embeds_mask in padded_pairs], dim=0)
    if merged_mask.all():
        return merged_prompt_embeds, None
    return merged_prompt_embeds, merged_mask


def get_sigmas(sched_copy, timesteps, n_dim=4, dtype=torch.float32):
    """The script's get_sigmas, verbatim but for the closure (and returning the indices)."""
    sigmas = sched_copy.sigmas.to(dtype=dtype)
    schedule_timesteps = sched_copy.timesteps
    step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]
    sigma = sigmas[step_indices].flatten()
    while len(sigma.shape) < n_dim:
        sigma = sigma.unsqueeze(-1)
    return sigma, step_indices


# ---- models ------------------------------------------------------------------------------------

def t32(x):
    return x.detach().to(torch.float32).contiguous().clone()


def load_models(tiny):
    sched = FlowMatchEulerDiscreteScheduler.from_pretrained(
        tiny, subfolder="scheduler", shift=ARGS["scheduler_shift_argument"])
    sched_copy = copy.deepcopy(sched)
    vae = AutoencoderKLQwenImage.from_pretrained(tiny, subfolder="vae")
    tr = QwenImageTransformer2DModel.from_pretrained(tiny, subfolder="transformer",
                                                     torch_dtype=torch.float32)
    tr.requires_grad_(False)
    vae.requires_grad_(False)
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


# ---- loss --------------------------------------------------------------------------------------

def losses(model_pred, target, weighting, prior, prior_loss_weight, f=lambda x: x.float()):
    """The script's loss block (lines ~1790-1815)."""
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


def pack_ref(x5):
    """Independent packing: token (i, j) row-major, feature c * 4 + dy * 2 + dx."""
    B, C, F, h, w = x5.shape
    assert F == 1
    out = torch.empty(B, (h // 2) * (w // 2), C * 4, dtype=x5.dtype)
    for i in range(h // 2):
        for j in range(w // 2):
            for c in range(C):
                for dy in range(2):
                    for dx in range(2):
                        out[:, i * (w // 2) + j, c * 4 + dy * 2 + dx] = x5[:, c, 0, 2 * i + dy, 2 * j + dx]
    return out


def forward_loss(tr, noisy, timesteps, prompt_embeds, prompt_embeds_mask, target, weighting,
                 prior, plw, f=lambda x: x.float()):
    """The script's lines from img_shapes to the loss."""
    latent_height, latent_width = noisy.shape[3], noisy.shape[4]
    bsz = noisy.shape[0]
    img_shapes = [(1, latent_height // 2, latent_width // 2)] * bsz
    noisy_p = noisy.permute(0, 2, 1, 3, 4)
    packed = QwenImagePipeline._pack_latents(noisy_p, batch_size=noisy.shape[0],
                                             num_channels_latents=noisy.shape[1],
                                             height=noisy.shape[3], width=noisy.shape[4])
    pred_packed = tr(hidden_states=packed, encoder_hidden_states=prompt_embeds,
                     encoder_hidden_states_mask=prompt_embeds_mask, timestep=timesteps / 1000,
                     img_shapes=img_shapes, return_dict=False)[0]
    vsf = 8
    model_pred = QwenImagePipeline._unpack_latents(pred_packed, latent_height * vsf,
                                                   latent_width * vsf, vsf)
    return {"img_shapes": img_shapes, "packed": packed, "pred_packed": pred_packed,
            "model_pred": model_pred,
            "L": losses(model_pred, target, weighting, prior, plw, f)}


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    tiny = os.path.join(HERE, "tiny_qwen_image")
    odir = os.path.join(out, "train_step")
    os.makedirs(odir, exist_ok=True)

    # ---- text encoding: the script's compute_text_embeddings ---------------------------------
    tok = mp.Tokenizer(os.path.join(HERE, "tokenizer"))
    te = mp.TextEncoder(*mp.load_text_encoder(os.path.join(HERE, "text_encoder")))
    text_pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=te, tokenizer=tok,
                                  transformer=None)

    def compute_text_embeddings(prompt):
        with torch.no_grad():
            prompt_embeds, prompt_embeds_mask = text_pipe.encode_prompt(
                prompt=prompt, max_sequence_length=ARGS["max_sequence_length"])
        return prompt_embeds, prompt_embeds_mask

    enc = {}
    enc_info = {}
    for key in ("instance_prompt", "class_prompt"):
        p = ARGS[key]
        e, m = compute_text_embeddings(p)
        # make_prompts' plain restatement (get_qwen_prompt_embeds + encode_prompt)
        txt, tenc, g_e, g_m = mp.get_qwen_prompt_embeds(tok, te, [p])
        r_e, r_m = mp.encode_prompt(g_e, g_m, 1, ARGS["max_sequence_length"])
        assert torch.equal(r_e, e) and m is None and r_m is None, key
        assert e.shape[0] == 1 and e.dtype == torch.float32
        enc[key] = (e, m)
        real = int(tenc.attention_mask.sum())
        enc_info[p] = {"rendered": txt[0], "token_count": real,
                       "dropped_prefix_ids": mp.DROP_IDX,
                       "kept_length": int(e.shape[1]),
                       "ids": tenc.input_ids[0, :real].tolist(),
                       "kept_text": tok.decode(tenc.input_ids[0, mp.DROP_IDX:real].tolist()),
                       "encode_prompt_mask_is_none": m is None}

    # ---- schedule --------------------------------------------------------------------------
    sched_copy, vae, _ = load_models(tiny)
    N = sched_copy.config.num_train_timesteps
    sched_cfg = {k: v for k, v in sorted(sched_copy.config.items()) if not k.startswith("_")}
    assert sched_cfg["shift"] == 3.0 and sched_cfg["use_dynamic_shifting"] is True
    tensors = {"schedule.timesteps": t32(sched_copy.timesteps),
               "schedule.sigmas": t32(sched_copy.sigmas)}
    assert sched_copy.timesteps.dtype == torch.float32 and sched_copy.sigmas.shape == (N,)
    # use_dynamic_shifting: __init__ does NOT apply shift (3.0 is ignored for the table):
    # s_k = linspace(1, N, N)[::-1] / N (float32), timesteps = s * N (float32)
    lin = torch.from_numpy(np.linspace(1, N, N, dtype=np.float32)[::-1].copy())
    s = lin / N
    assert torch.equal(s, sched_copy.sigmas)
    assert torch.equal(s * N, sched_copy.timesteps)
    tables_equal_linspace = torch.equal(sched_copy.timesteps, lin)
    n_ts_ne_linspace = int((sched_copy.timesteps != lin).sum())
    assert len(set(sched_copy.timesteps.tolist())) == N  # get_sigmas' == lookup is unique

    latents_mean = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    latents_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    assert latents_mean.dtype == torch.float32 and latents_std.dtype == torch.float32
    vae_scale_factor = 2 ** len(vae.temperal_downsample)
    assert vae_scale_factor == 8
    tensors["normalisation.latents_mean"] = t32(latents_mean)
    tensors["normalisation.latents_std_inv"] = t32(latents_std)
    # the reciprocal-then-multiply differs from a division in a few ulps
    std_div_diff = None

    meta_cases = {}
    for case in CASES:
        name, n_inst, prior = case["name"], case["train_batch_size"], case["with_prior_preservation"]
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

        # batch: instance pixel values first, then class (collate_fn), then unsqueeze(2)
        gp = torch.Generator().manual_seed(case["pixel_seed"])
        shape = (n_inst, 3, case["height"], case["width"])
        pv = [torch.rand(shape, generator=gp, dtype=torch.float32) * 2 - 1]
        prompts = [ARGS["instance_prompt"]] * n_inst
        if prior:
            pv.append(torch.rand(shape, generator=gp, dtype=torch.float32) * 2 - 1)
            prompts += [ARGS["class_prompt"]] * n_inst
        pixel_values = torch.cat(pv, 0)
        if pixel_values.ndim == 4:
            pixel_values = pixel_values.unsqueeze(2)
        pixel_values = pixel_values.to(memory_format=torch.contiguous_format).float()

        # prompt embeds: the script's pairs and concat_prompt_embedding_batches
        inst_e, inst_m = enc["instance_prompt"]
        instance_pairs = [(inst_e, inst_m)] * n_inst
        prompt_pairs = instance_pairs
        if prior:
            cls_e, cls_m = enc["class_prompt"]
            prompt_pairs = prompt_pairs + [(cls_e, cls_m)] * n_inst
        prompt_embeds, prompt_embeds_mask = concat_prompt_embedding_batches(*prompt_pairs)
        B_text = prompt_embeds.shape[0]

        # ---- the draws: global RNG, as the script (set_seed) ---------------------------------
        torch.manual_seed(case["draw_seed"])
        with torch.no_grad():
            posterior = vae.encode(pixel_values.to(dtype=vae.dtype)).latent_dist
            latent_sample = posterior.sample()
        model_input = (latent_sample - latents_mean) * latents_std
        model_input = model_input.to(dtype=torch.float32)
        noise = torch.randn_like(model_input)
        bsz = model_input.shape[0]
        assert bsz == B_text == pixel_values.shape[0]
        u = compute_density_for_timestep_sampling(
            weighting_scheme=case["weighting_scheme"], batch_size=bsz,
            logit_mean=ARGS["logit_mean"], logit_std=ARGS["logit_std"],
            mode_scale=ARGS["mode_scale"])
        # eps as sample() drew it (recovered exactly by re-drawing: see the check below)
        g = torch.Generator().manual_seed(case["draw_seed"])
        eps = torch.randn(posterior.mean.shape, generator=g, dtype=torch.float32)
        assert torch.equal(posterior.mean + posterior.std * eps, latent_sample)
        # RNG equivalence: the same with a seeded generator
        g = torch.Generator().manual_seed(case["draw_seed"])
        assert torch.equal(posterior.sample(generator=g), latent_sample)
        assert torch.equal(torch.empty_like(model_input).normal_(generator=g), noise)
        assert torch.equal(compute_density_for_timestep_sampling(
            weighting_scheme=case["weighting_scheme"], batch_size=bsz,
            logit_mean=ARGS["logit_mean"], logit_std=ARGS["logit_std"],
            mode_scale=ARGS["mode_scale"], generator=g), u)
        g = torch.Generator().manual_seed(case["draw_seed"])
        plain_randn = [torch.randn(tuple(posterior.mean.shape), generator=g),
                       torch.randn(tuple(model_input.shape), generator=g)]
        noise_is_plain_randn = torch.equal(plain_randn[1], noise)
        strides = {"posterior_mean": list(posterior.mean.stride()),
                   "latent_sample": list(latent_sample.stride()),
                   "model_input": list(model_input.stride()), "noise": list(noise.stride())}
        assert model_input.is_contiguous() and noise.is_contiguous()
        assert noise_is_plain_randn
        if std_div_diff is None:
            std_div_diff = int(((latent_sample - latents_mean) / torch.tensor(
                vae.config.latents_std).view(1, 16, 1, 1, 1) != model_input).sum())

        indices = (u * sched_copy.config.num_train_timesteps).long()
        timesteps = sched_copy.timesteps[indices].to(device=model_input.device)
        sigmas, step_indices = get_sigmas(sched_copy, timesteps, n_dim=model_input.ndim,
                                          dtype=model_input.dtype)
        assert step_indices == indices.tolist() and sigmas.shape == (bsz, 1, 1, 1, 1)
        noisy = (1.0 - sigmas) * model_input + sigmas * noise
        weighting = compute_loss_weighting_for_sd3(weighting_scheme=case["weighting_scheme"],
                                                   sigmas=sigmas)
        target = noise - model_input

        F = forward_loss(tr, noisy, timesteps, prompt_embeds, prompt_embeds_mask, target,
                         weighting, prior, plw)
        L, model_pred = F["L"], F["model_pred"]
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
        mi64, n64, s64 = model_input.double(), noise.double(), sigmas.double()
        assert ((1 - s64) * mi64 + s64 * n64 - noisy.double()).abs().max() < 1e-6
        assert torch.equal(pack_ref(noisy), F["packed"])
        # unpack is the inverse of pack
        assert torch.equal(pack_ref(model_pred.detach()), F["pred_packed"].detach())
        # the mask the transformer gets, per row
        if prompt_embeds_mask is not None:
            mask_lengths = [int(r.sum()) for r in prompt_embeds_mask]
            # padded rows of the embeddings are zero
            for r in range(B_text):
                assert torch.equal(prompt_embeds_mask[r, :mask_lengths[r]],
                                   torch.ones(mask_lengths[r], dtype=torch.int64))
                assert not prompt_embeds[r, mask_lengths[r]:].any()
        else:
            mask_lengths = None

        fd_info = None
        if name == "lora":
            fd_info = fd_check(tr, noisy, timesteps, prompt_embeds, prompt_embeds_mask, target,
                               weighting, grads)
        mask_info = None
        if prompt_embeds_mask is not None:
            mask_info = mask_check(tr, noisy, timesteps, prompt_embeds, prompt_embeds_mask,
                                   F["pred_packed"].detach())

        # ---- record ----------------------------------------------------------------------
        pre = f"{name}."
        rec = {"pixel_values": pixel_values, "posterior_mean": posterior.mean,
               "posterior_std": posterior.std, "posterior_eps": eps,
               "latent_sample": latent_sample, "model_input": model_input, "noise": noise,
               "u": u, "timesteps": timesteps, "sigmas": sigmas, "noisy_model_input": noisy,
               "packed_noisy_model_input": F["packed"], "timestep_model": timesteps / 1000,
               "model_pred_packed": F["pred_packed"], "model_pred": model_pred,
               "target": target, "weighting": weighting, "prompt_embeds": prompt_embeds}
        for k, v in L.items():
            rec[k] = v
        for k, v in rec.items():
            tensors[pre + k] = t32(v)
        tensors[pre + "indices"] = indices.clone()
        if prompt_embeds_mask is not None:
            assert prompt_embeds_mask.dtype == torch.int64
            tensors[pre + "prompt_embeds_mask"] = prompt_embeds_mask.clone()

        kept = sorted(n for n in grads if grads[n] is not None)
        for n in kept:
            tensors[pre + "grad." + n] = t32(grads[n])
        if case["lora"]:
            for n in sorted(params):
                tensors[pre + "lora." + n] = t32(params[n])
            assert not no_grad, no_grad

        def grp(n):
            if case["lora"]:
                return "lora_A" if ".lora_A." in n else "lora_B"
            parts = n.split(".")
            return ".".join(parts[:2]) if parts[0] == "transformer_blocks" else parts[0]
        groups = {}
        for n in kept:
            groups[grp(n)] = max(groups.get(grp(n), 0.0), grads[n].abs().max().item())

        shape_keys = ["pixel_values", "prompt_embeds", "posterior_mean", "posterior_std",
                      "posterior_eps", "latent_sample", "model_input", "noise", "u", "indices",
                      "timesteps", "sigmas", "noisy_model_input", "packed_noisy_model_input",
                      "timestep_model", "model_pred_packed", "model_pred", "target", "weighting",
                      "loss"]
        if prompt_embeds_mask is not None:
            shape_keys.append("prompt_embeds_mask")
        info = {
            "arguments": {**{k: v for k, v in case.items() if k != "name"},
                          "prior_loss_weight": plw, "num_images_in_batch": bsz,
                          "prompts": prompts},
            "shapes": {k: list(tensors[pre + k].shape) for k in shape_keys},
            "img_shapes": [list(t) for t in F["img_shapes"]],
            "prompt_embeds_mask_is_none": prompt_embeds_mask is None,
            "prompt_embeds_mask_lengths": mask_lengths,
            "prompt_embeds_sources": [0] * n_inst + ([1] * n_inst if prior else []),
            "values": {"u": u.tolist(), "indices": indices.tolist(),
                       "timesteps": timesteps.tolist(), "sigmas": sigmas.flatten().tolist(),
                       "timestep_model": (timesteps / 1000).tolist(),
                       "weighting": weighting.flatten().tolist(),
                       **{k: v.item() for k, v in L.items()}},
            "strides": strides,
            "noise_equals_plain_randn_after_eps": noise_is_plain_randn,
            "trainable_parameters": len(trainable),
            "trainable_values": sum(tr.get_parameter(n).numel() for n in trainable),
            "recorded_grads": len(kept),
            "grad_max_abs": {n: grads[n].abs().max().item() for n in kept},
            "grad_group_max_abs": dict(sorted(groups.items())),
            "grad_norm_before_clip": gnorm,
            "clip_would_scale": gnorm > ARGS["max_grad_norm"],
            "params_without_grad": no_grad,
            "params_with_all_zero_grad": sorted(n for n in kept if not grads[n].any()),
            "checks": {"loss_float64_rel_diff": loss_check, "loss_float64": ref},
        }
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
            for k in ("pixel_values", "noise", "u", "posterior_eps", "model_input"):
                assert torch.equal(tensors["full." + k], tensors["lora." + k])
            info["params_without_grad_note"] = (
                "p.grad is None after backward: the last block's text-stream outputs never reach "
                "the image output (the model returns only the image stream), so its text MLP, "
                "to_add_out and the txt_mod rows feeding them get no gradient; no grad.<param> "
                "key is written for them (treat as zero / undefined). The last block's "
                "add_q_proj and norm_added_q get a gradient tensor that is exactly zero (text "
                "queries only feed the unused text output, but they are in the joint graph)")
        if fd_info is not None:
            info["checks"]["finite_differences"] = fd_info
        if mask_info is not None:
            info["checks"]["mask"] = mask_info
        meta_cases[name] = info
        print(f"{name}: B {bsz}, L {prompt_embeds.shape[1]}, mask "
              f"{'None' if mask_lengths is None else mask_lengths}, loss {L['loss'].item():.6f} "
              f"(float64 rel diff {max(loss_check.values()):.1e}), t "
              f"{[round(x, 3) for x in timesteps.tolist()]}, {len(kept)} grads recorded, "
              f"{len(no_grad)} without grad, groups {info['grad_group_max_abs']}, "
              f"grad norm {gnorm:.4f}")

    save_file({k: tensors[k].contiguous() for k in sorted(tensors)},
              os.path.join(odir, "step.safetensors"), metadata={"format": "pt"})
    doc = {
        "diffusers_version": diffusers.__version__, "peft_version": peft.__version__,
        "torch_version": torch.__version__,
        "script": "diffusers/examples/dreambooth/train_dreambooth_lora_qwen_image.py",
        "arguments": ARGS, "lora_target_modules": TARGET_MODULES,
        "scheduler_config": sched_cfg, "num_train_timesteps": N,
        "schedule_timesteps_equal_linspace": tables_equal_linspace,
        "schedule_timesteps_not_equal_linspace_count": n_ts_ne_linspace,
        "vae": {"latents_mean": list(vae.config.latents_mean),
                "latents_std": list(vae.config.latents_std), "z_dim": vae.config.z_dim,
                "vae_scale_factor": vae_scale_factor,
                "normalised_values_differing_if_divided_instead": std_div_diff},
        "prompts": enc_info,
        "order_of_operations": ORDER,
        "semantics": {
            "schedule": "FlowMatchEulerDiscreteScheduler.from_pretrained(..., shift=3.0): the "
                        "config's use_dynamic_shifting is true, so __init__ does NOT shift the "
                        "table and shift 3.0 (stored in the config) has no effect on training: "
                        "sigmas_k = t_k / N with t_k = linspace(1, N, N)[::-1] (float32), k = "
                        "0..N-1, timesteps = sigmas * N (float32). Index 0: t 1000, sigma 1; "
                        "index N-1: t 1, sigma 0.001. shift_terminal (0.02) is only applied in "
                        "set_timesteps, never called here.",
            "indices": "(u * N).long(): truncation toward zero; u in [0, 1) so 0..N-1; sigma = "
                       "(N - floor(u N)) / N, so small u means high noise.",
            "timestep_model": "timesteps / 1000 (float32) = sigma: 1 = pure noise (NOT 1 - t as "
                              "Z-Image); the transformer multiplies by 1000 inside its sinusoid",
            "latents": "5-D throughout: pixel_values [B, 3, 1, H, W] (collate_fn unsqueeze(2)); "
                       "posterior mean / std [B, 16, 1, H/8, W/8]; model_input = (mean + std * "
                       "eps - latents_mean) * (1 / latents_std), per channel, reciprocal in "
                       "float32 then multiplied; noise, noisy_model_input, target, model_pred "
                       "(unpacked) [B, 16, 1, h, w]; sigmas and weighting [B, 1, 1, 1, 1]",
            "packing": "noisy.permute(0, 2, 1, 3, 4) then _pack_latents: [B, 1, 16, h, w] -> "
                       "view(B, 16, h/2, 2, w/2, 2).permute(0, 2, 4, 1, 3, 5).reshape(B, "
                       "h/2 * w/2, 64): tokens row-major over (h/2, w/2), features c * 4 + dy * "
                       "2 + dx. _unpack_latents(pred, 8 h, 8 w, 8) is the inverse -> [B, 16, 1, "
                       "h, w]",
            "img_shapes": "[(1, h // 2, w // 2)] * bsz with h, w the LATENT sizes (a list of "
                          "tuples, one per sample, not the pipelines' list of lists); "
                          "QwenEmbedRope uses img_shapes[0] only, wrapped as [(1, h/2, w/2)]",
            "prompt_embeds": "encode_prompt(prompt, max_sequence_length=512) on ONE prompt "
                             "string: [1, L, 64] (the kept rows after dropping 34 ids, cut to "
                             "512) and mask None (a one-prompt mask is all ones and "
                             "encode_prompt turns an all-ones mask into None). The embeddings are "
                             "computed once and reused every step",
            "batch_collation": "concat_prompt_embedding_batches: each (embeds, mask) pair's None "
                               "mask becomes ones int64 [1, L]; each pair is right-padded with "
                               "ZERO embedding rows and 0 mask entries to the longest L in the "
                               "batch; cat along the batch; if the merged mask is all ones the "
                               "transformer gets encoder_hidden_states_mask=None (every "
                               "non-prior case here), else the int64 [B, L_max] mask",
            "mask_in_transformer": "encoder_hidden_states_mask int64 -> bool; the text sequence "
                                   "length for RoPE is the PADDED L (text positions maxv .. "
                                   "maxv + L - 1 for every row); the joint attention mask is "
                                   "cat([text mask, ones(N)]) as a key mask [B, 1, 1, L + N] "
                                   "for every query; padded text queries are computed but never "
                                   "reach the image output",
            "weighting": "none / logit_normal / mode: ones; sigma_sqrt: sigmas ** -2 (1 / sigma^2, "
                         "despite the name); cosmap: 2 / (pi (1 - 2 sigma + 2 sigma^2)); shape "
                         "[B, 1, 1, 1, 1]",
            "density": "none / sigma_sqrt / cosmap: u = rand(B); logit_normal: u = "
                       "sigmoid(normal(logit_mean, logit_std, (B,))); mode: u = 1 - v - mode_scale "
                       "(cos(pi v / 2)^2 - 1 + v), v = rand(B)",
            "loss": "per sample mean over 16 * 1 * h * w of weighting * (model_pred - target)^2, "
                    "then mean over samples (float32); with prior preservation model_pred, "
                    "target AND weighting are chunked in two along the batch (instance first), "
                    "loss = instance + prior_loss_weight * prior",
            "gradients": "of that loss (gradient_accumulation_steps 1 divides by 1), before "
                         "clip_grad_norm_(max_grad_norm 1.0)",
        },
        "draws": "per case the script's global-RNG calls after torch.manual_seed(draw_seed): (1) "
                 "vae.encode(pixel_values).latent_dist.sample(): eps = torch.randn(mean.shape) "
                 "(contiguous, [B, 16, 1, h, w]); (2) noise = torch.randn_like(model_input) "
                 "(contiguous; equal to a plain torch.randn(shape) as the next call on the same "
                 "generator); (3) u from compute_density_for_timestep_sampling (no generator). "
                 "Equal to posterior.sample(generator=g), torch.empty_like(model_input)."
                 "normal_(generator=g), then u with generator=g, g = torch.Generator('cpu')."
                 "manual_seed(draw_seed) (checked). pixel_values = rand(n, 3, H, W) * 2 - 1 from "
                 "Generator().manual_seed(pixel_seed) (instance, then class)",
        "cases": meta_cases,
    }
    with open(os.path.join(odir, "cases.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(doc, ensure_ascii=False, indent=2, sort_keys=True) + "\n")
    print(f"wrote {odir}/step.safetensors, cases.json")


def mask_check(tr, noisy, timesteps, prompt_embeds, mask, pred_packed):
    """Each sample alone with its text cut to its real length and no mask equals the batch."""
    out = 0.0
    with torch.no_grad():
        for b in range(noisy.shape[0]):
            Lb = int(mask[b].sum())
            F = forward_loss(tr, noisy[b:b + 1], timesteps[b:b + 1], prompt_embeds[b:b + 1, :Lb],
                             None, torch.zeros_like(noisy[b:b + 1]),
                             torch.ones(1, 1, 1, 1, 1), False, 1.0)
            out = max(out, (F["pred_packed"] - pred_packed[b:b + 1]).abs().max().item())
    print(f"  mask: each sample alone, text cut to its length, no mask vs the batch: {out:.2e}")
    assert out < 1e-5
    return {"alone_truncated_no_mask_vs_batch_max_abs": out,
            "note": "RoPE text positions depend only on the row index, so cutting the padding "
                    "and dropping the mask gives the same image output"}


def fd_check(tr, noisy, timesteps, prompt_embeds, mask, target, weighting, grads32):
    """Float64 gradients of a double copy, and central differences on 3 scalars."""
    tr64 = copy.deepcopy(tr).double()
    tr64.zero_grad(set_to_none=True)
    args = (noisy.double(), timesteps.double(), prompt_embeds.double(), mask, target.double(),
            weighting.double(), False, 1.0, lambda x: x)  # the loss in float64 too
    L = forward_loss(tr64, *args)["L"]
    L["loss"].backward()
    g64 = {n: p.grad.detach().clone() for n, p in tr64.named_parameters() if p.requires_grad}
    rel = max(((grads32[n].double() - g64[n]).abs().max() / g64[n].abs().max()).item()
              for n in g64)
    probes = ["transformer_blocks.0.attn.to_q.lora_A.default.weight",
              "transformer_blocks.1.attn.to_v.lora_B.default.weight",
              "transformer_blocks.0.attn.to_out.0.lora_A.default.weight"]
    out = {"loss_float64": L["loss"].item(),
           "grad_float32_vs_float64_max_rel": rel, "probes": []}
    eps = 1e-3  # the float64 copy still runs RoPE (complex64) and the sinusoid in float32
    for n in probes:
        p = tr64.get_parameter(n)
        flat = int(g64[n].abs().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), p.shape))
        vals = []
        with torch.no_grad():
            orig = p[idx].item()
            for s in (+1, -1):
                p[idx] = orig + s * eps
                vals.append(forward_loss(tr64, *args)["L"]["loss"].item())
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
