#!/usr/bin/env python3
"""Makes tests/golden/wan/train_step/: references of ONE training step of a Wan video LoRA (and a
full fine-tune) with the semantics of kohya-ss/musubi-tuner's Wan trainer (wan_train_network.py +
training/trainer_base.py, commit MUSUBI_COMMIT), computed with Diffusers' real modules
(WanTransformer3DModel, AutoencoderKLWan, WanImageToVideoPipeline.prepare_latents) and PEFT, on the
tiny fixtures tiny_wan/{transformer,vae}/ and tiny_wan_i2v/transformer/ (re-making any of them
means re-making this), for parity of the latents, noisy input, model prediction, target, loss and
gradients.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 + PEFT 0.20.1.dev0) from the
project root:
    OMP_NUM_THREADS=1 ../shared/refstack2/run python3 tests/golden/wan/make_train_step.py tests/golden/wan
Re-running writes byte-identical files (float32 on one CPU thread, deterministic algorithms, fixed
seeds, safetensors with sorted keys and metadata {"format": "pt"}, JSON with sorted keys).

musubi-tuner's step, restated statement by statement (line numbers: musubi-tuner at MUSUBI_COMMIT):
  caching (wan_cache_latents.py / wan_cache_text_encoder_outputs.py, done once before training):
    latents = WanVAE.encode(pixels): vae.py:751-756 -> WanVAE_.encode vae.py:530-568 returns the
      normalised posterior MEAN mu = (mu - mean) * (1 / std) (vae.py:562-568, scale = [mean,
      1.0 / std] vae.py:701); no sampling. Here: AutoencoderKLWan.encode(pixels).latent_dist.mode()
      (= the mean) then (mu - latents_mean) * (1.0 / latents_std), the same float32 reciprocal.
    t5 = T5EncoderModel(prompts): t5.py:508-514 keeps u[:seq_len] (trimmed to the tokens); the
      model pads each with zero rows to text_len 512 (model.py:874), as WanPipeline pads to
      max_sequence_length 512. Here random [L_i, 32] embeddings, zero-padded to [B, 512, 32].
    I2V y (wan_cache_latents.py:47-80): mask msk [B, 4, T, h, w] (first pixel frame 1, others 0,
      the first repeated 4 times, view(T, 4).transpose), video [first frame, zeros * (F-1)],
      y = cat([msk, normalised WanVAE.encode(video)], dim=1). Here WanImageToVideoPipeline.
      prepare_latents(...)[1] (checked bit-equal to that restatement).
  training loop (trainer_base.py:2031-2056): latents = scale_shift_latents(latents) (identity for
    Wan, wan_train_network.py:528-529); noise = torch.randn_like(latents) (global RNG);
    process_batch (1122-1155) -> get_noisy_model_input_and_timesteps (499-731): t drawn
    (uniform: torch.rand((B,)); sigmoid: sigmoid(sigmoid_scale * torch.randn((B,))); shift:
    sigmoid(sigmoid_scale * randn) then t * shift / (1 + (shift - 1) t), shift =
    discrete_flow_shift; 578-612), t = t * (t_max - t_min) + t_min with t_min = min_timestep /
    1000 (default 0), t_max = max_timestep / 1000 (default 1) (673-680), timesteps = t * 1000,
    noisy = (1 - t) * latents + t * noise (t viewed [B, 1, 1, 1, 1]), timesteps += 1 (704-708);
    _call_dit (wan_train_network.py:649-716): model(noisy, t=timesteps, context=list of trimmed t5,
    y=latents_image) where WanModel.forward cats [noisy, y] per sample along channels
    (model.py:825); target = noise - latents; compute_loss (trainer_base.py:1157-1186): weighting
    None for weighting_scheme "none", loss = mse_loss(pred, target, reduction="none").mean();
    accelerator.backward(loss).
  LoRA (networks/lora_wan.py + lora.py): every Linear inside a WanAttentionBlock (lora_wan.py:16;
    lora.py:568-600) minus the regex .*(patch_embedding|text_embedding|time_embedding|
    time_projection|norm|head).* (lora_wan.py:37, which removes none of them) = self_attn.q/k/v/o,
    cross_attn.q/k/v/o (+ k_img/v_img in Wan 2.1 I2V), ffn.0, ffn.2; scale alpha / dim
    (lora.py:93-94). Diffusers names: attn1.to_q/to_k/to_v/to_out.0, attn2.to_q/to_k/to_v/to_out.0
    (+ add_k_proj/add_v_proj), ffn.net.0.proj, ffn.net.2 (see LORA_NAME_MAP). Here PEFT
    LoraConfig(r=4, lora_alpha=4, init_lora_weights="gaussian") via transformer.add_adapter after
    torch.manual_seed(LORA_INIT_SEED), then every lora_B overwritten with LORA_B_STD * randn from
    a Generator seeded LORA_B_SEED (named_parameters order), so A's gradients are non-zero.

Cases (see CASES): lora_clip (B 1, F 5, 32 x 48, shift 3.0), lora_images (B 2, F 1, 48 x 32,
sigmoid), lora_range (B 2, F 5, 32 x 32, uniform, timesteps 100..875), full (lora_clip's inputs and
draws, every transformer parameter trained), i2v_lora (tiny_wan_i2v, B 1, F 5, 32 x 48, shift 3.0).

Writes, under OUT/train_step/:
  step.safetensors  normalisation.latents_mean / .latents_std_inv [1, 16, 1, 1, 1], and per case
                    <case>.pixel_values, .context, .context_lengths (int64), .latents_mean_posterior,
                    .latents, .noise, .t, .timesteps, .noisy_model_input, .model_input, .model_pred,
                    .target, .loss, .grad.<param>, (LoRA) .lora.<peft param>, (I2V) .y,
                    .video_condition, .y_latents_mean_posterior
  cases.json        arguments, shapes, values, the order of operations, the LoRA name mapping,
                    the semantics confirmed and the differences found, the checks' results

Checks (the outputs do not depend on them): the loss recomputed in float64; for lora_clip central
finite differences on 3 scalar LoRA parameters of a float64 copy (relative error < 1e-2 against the
float32 gradients) and the float64 gradients; the global-RNG draws equal the same draws from a
seeded Generator; the PEFT-wrapped modules are exactly the Linears inside blocks.N; the I2V y from
prepare_latents equals the wan_cache_latents restatement bit for bit; the batched VAE encode vs
per-sample (musubi's WanVAE.encode loops over samples); the Diffusers float32 timestep sinusoid vs
musubi's float64 one (and its effect on model_pred); the latents' reciprocal-multiply vs a division.
"""
import copy
import os
import sys
import time

import torch

sys.dont_write_bytecode = True  # no __pycache__ next to the imported make_*.py
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# make_transformer flips Diffusers' transformers-availability flag before diffusers.loaders is
# imported (refstack2's transformers is a stub; nothing of it runs).
import make_transformer as mtr  # noqa: E402,F401
import make_pipeline as mpl  # noqa: E402  (save_st, write_json, maxdiff)
import diffusers  # noqa: E402
import peft  # noqa: E402
from diffusers import AutoencoderKLWan, WanTransformer3DModel  # noqa: E402
from diffusers.pipelines.wan.pipeline_wan_i2v import WanImageToVideoPipeline  # noqa: E402
from peft import LoraConfig  # noqa: E402

MUSUBI_COMMIT = "30c658c4f4b0bf05038b3346eff9670259b10fc7"
TEXT_LEN = 512  # WanModel text_len / WanPipeline max_sequence_length
TEXT_DIM = 32  # tiny UMT5 d_model = transformer text_dim
LORA = dict(r=4, lora_alpha=4, lora_dropout=0.0, init_lora_weights="gaussian")
LORA_INIT_SEED = 20270301  # torch.manual_seed before add_adapter (PEFT's gaussian A init)
LORA_B_SEED, LORA_B_STD = 20270302, 0.05  # B overwritten (gaussian init leaves it zero)
# Diffusers WanTransformerBlock Linears (PEFT suffix targets) <- musubi WanAttentionBlock Linears
LORA_NAME_MAP = {
    "self_attn.q": "attn1.to_q", "self_attn.k": "attn1.to_k", "self_attn.v": "attn1.to_v",
    "self_attn.o": "attn1.to_out.0",
    "cross_attn.q": "attn2.to_q", "cross_attn.k": "attn2.to_k", "cross_attn.v": "attn2.to_v",
    "cross_attn.o": "attn2.to_out.0",
    "cross_attn.k_img": "attn2.add_k_proj", "cross_attn.v_img": "attn2.add_v_proj",
    "ffn.0": "ffn.net.0.proj", "ffn.2": "ffn.net.2",
}
TARGET_MODULES = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
# musubi's defaults for what is not set per case
DEFAULT_ARGS = dict(timestep_sampling="sigma", discrete_flow_shift=1.0, sigmoid_scale=1.0,
                    weighting_scheme="none", min_timestep=None, max_timestep=None,
                    preserve_distribution_shape=False, num_timestep_buckets=None,
                    gradient_checkpointing=False, mixed_precision="no (float32)",
                    gradient_accumulation_steps=1, max_grad_norm=1.0, network_dim=LORA["r"],
                    network_alpha=LORA["lora_alpha"], dit_high_noise=None)

CASES = [
    dict(name="lora_clip", folder="tiny_wan", lora=True, i2v=False, batch=1, frames=5, height=32,
         width=48, timestep_sampling="shift", discrete_flow_shift=3.0, sigmoid_scale=1.0,
         context_lengths=[7], pixel_seed=301, text_seed=401, draw_seed=501),
    dict(name="lora_images", folder="tiny_wan", lora=True, i2v=False, batch=2, frames=1,
         height=48, width=32, timestep_sampling="sigmoid", sigmoid_scale=1.0,
         context_lengths=[5, 11], pixel_seed=302, text_seed=402, draw_seed=502),
    dict(name="lora_range", folder="tiny_wan", lora=True, i2v=False, batch=2, frames=5, height=32,
         width=32, timestep_sampling="uniform", min_timestep=100, max_timestep=875,
         context_lengths=[9, 3], pixel_seed=303, text_seed=403, draw_seed=503),
    # full fine-tuning (musubi's Wan trainer trains networks only), lora_clip's inputs and draws
    dict(name="full", folder="tiny_wan", lora=False, i2v=False, batch=1, frames=5, height=32,
         width=48, timestep_sampling="shift", discrete_flow_shift=3.0, sigmoid_scale=1.0,
         context_lengths=[7], pixel_seed=301, text_seed=401, draw_seed=501),
    dict(name="i2v_lora", folder="tiny_wan_i2v", lora=True, i2v=True, batch=1, frames=5,
         height=32, width=48, timestep_sampling="shift", discrete_flow_shift=3.0,
         sigmoid_scale=1.0, context_lengths=[6], pixel_seed=304, text_seed=404, draw_seed=504),
]

ORDER = [
    "pixel_values [B, 3, F, H, W] float32 in [-1, 1] (F = 1 + 4k; F = 1: images); "
    "T = 1 + (F - 1) / 4 latent frames, h = H / 8, w = W / 8",
    "text: per sample the UMT5 output trimmed to its L_i tokens [L_i, 32] (musubi's cache, "
    "t5.py:508-514); context = stack([cat([u, zeros(512 - L_i, 32)]) for u]) [B, 512, 32] "
    "(WanModel.forward model.py:874; WanPipeline pads to max_sequence_length 512 the same way); "
    "no attention mask anywhere (context_lens None, model.py:872): the zero rows go through "
    "text_embedder and are attended",
    "latents_mean_posterior = AutoencoderKLWan.encode(pixel_values).latent_dist.mode() (the "
    "posterior mean, no sampling; musubi WanVAE.encode returns mu, vae.py:562-568) [B, 16, T, h, w]",
    "latents = (latents_mean_posterior - latents_mean) * latents_std_inv, latents_mean = "
    "tensor(vae.config.latents_mean).view(1, 16, 1, 1, 1), latents_std_inv = 1.0 / "
    "tensor(vae.config.latents_std).view(1, 16, 1, 1, 1) (float32 reciprocal, then multiply: "
    "vae.py:564, 701); trainer's scale_shift_latents is the identity for Wan "
    "(wan_train_network.py:528-529)",
    "I2V only: video_condition = cat([pixel_values[:, :, :1], zeros(B, 3, F - 1, H, W)], dim=2); "
    "y_latents_mean_posterior = vae.encode(video_condition).latent_dist.mode(); y_latents = "
    "(y_latents_mean_posterior - latents_mean) * latents_std_inv; mask m = ones(B, 1, F, h, w), "
    "m[:, :, 1:] = 0, m = cat([repeat_interleave(m[:, :, :1], 4, dim=2), m[:, :, 1:]], dim=2) "
    "(F + 3 = 4T frames), view(B, T, 4, h, w).transpose(1, 2) -> [B, 4, T, h, w]; y = cat([mask, "
    "y_latents], dim=1) [B, 20, T, h, w] (WanImageToVideoPipeline.prepare_latents == "
    "wan_cache_latents.py:47-80)",
    "torch.manual_seed(draw_seed); noise = torch.randn_like(latents) (global RNG, FIRST draw, "
    "trainer_base.py:2039)",
    "t by timestep_sampling (global RNG, SECOND draw, trainer_base.py:578-612): uniform: t = "
    "torch.rand((B,)); sigmoid: t = torch.sigmoid(sigmoid_scale * torch.randn((B,))); shift: "
    "logits = torch.randn((B,)) * sigmoid_scale; t = logits.sigmoid(); t = (t * shift) / (1 + "
    "(shift - 1) * t), shift = discrete_flow_shift (Python float)",
    "t_min = (min_timestep or 0) / 1000.0, t_max = (max_timestep or 1000.0) / 1000.0 (Python "
    "floats); t = t * (t_max - t_min) + t_min (float32 tensor op with a Python scalar; "
    "trainer_base.py:673-680)",
    "timesteps = t * 1000.0 (float32, a new tensor); t = t.view(-1, 1, 1, 1, 1); "
    "noisy_model_input = (1 - t) * latents + t * noise; timesteps += 1 (in place: the model gets "
    "t * 1000 + 1 while the noise level is t; trainer_base.py:704-708)",
    "model_input = noisy_model_input (T2V) or cat([noisy_model_input, y], dim=1) [B, 36, T, h, w] "
    "(I2V: noise latents FIRST; WanModel.forward cats per sample along channels, model.py:825; "
    "Diffusers' pipeline cats along dim 1)",
    "model_pred = transformer(hidden_states=model_input, timestep=timesteps (float32 [B]), "
    "encoder_hidden_states=context, return_dict=False)[0] [B, 16, T, h, w] "
    "(wan_train_network.py:710-711)",
    "target = noise - latents (wan_train_network.py:714)",
    "loss = mse_loss(model_pred.float(), target, reduction='none').mean() (weighting_scheme none "
    "-> weighting None, no multiply; a mean over all B * 16 * T * h * w elements; "
    "trainer_base.py:1182-1186)",
    "loss.backward() (accelerator.backward, gradient_accumulation_steps 1); gradients recorded "
    "BEFORE clip_grad_norm_(max_grad_norm 1.0) / optimizer.step (grad_norm_before_clip in the JSON)",
]


def t32(x):
    return x.detach().to(torch.float32).contiguous().clone()


def musubi_sample_t(args, batch_size, gen=None):
    """trainer_base.py:578-612 + 673-680 (preserve_distribution_shape False, no buckets), with an
    optional generator for the equivalence check; with gen=None exactly the global-RNG calls."""
    def rand(bs):
        return torch.rand((bs,)) if gen is None else torch.rand((bs,), generator=gen)

    def randn(bs):
        return torch.randn((bs,)) if gen is None else torch.randn((bs,), generator=gen)

    ts = args["timestep_sampling"]
    if ts == "uniform" or ts == "sigmoid":
        if ts == "sigmoid":
            t = torch.sigmoid(args["sigmoid_scale"] * randn(batch_size))
        else:
            t = rand(batch_size)
    elif ts == "shift":
        shift = args["discrete_flow_shift"]
        logits_norm = randn(batch_size)
        logits_norm = logits_norm * args["sigmoid_scale"]
        t = logits_norm.sigmoid()
        t = (t * shift) / (1 + (shift - 1) * t)
    else:
        raise ValueError(ts)
    t_min = args["min_timestep"] if args["min_timestep"] is not None else 0
    t_max = args["max_timestep"] if args["max_timestep"] is not None else 1000.0
    t_min /= 1000.0
    t_max /= 1000.0
    t = t * (t_max - t_min) + t_min
    return t


def musubi_y(vae, pixel_values, latents_mean, latents_std_inv):
    """wan_cache_latents.py:47-80 restated (vae.encode per sample, as WanVAE.encode loops)."""
    contents = pixel_values
    images = contents[:, :, 0:1, :, :]
    B = contents.shape[0]
    F, h, w = contents.shape[2], contents.shape[3], contents.shape[4]
    lat_h, lat_w = h // 8, w // 8
    msk = torch.ones(1, F, lat_h, lat_w, dtype=torch.float32)
    msk[:, 1:] = 0
    msk = torch.concat([torch.repeat_interleave(msk[:, 0:1], repeats=4, dim=1), msk[:, 1:]], dim=1)
    msk = msk.view(1, msk.shape[1] // 4, 4, lat_h, lat_w)
    msk = msk.transpose(1, 2)
    msk = msk.repeat(B, 1, 1, 1, 1)
    padding_frames = F - 1
    images_resized = torch.concat([images, torch.zeros(B, 3, padding_frames, h, w)], dim=2)
    with torch.no_grad():
        y = [vae.encode(u.unsqueeze(0)).latent_dist.mode() for u in images_resized]
    y = [(u - latents_mean) * latents_std_inv for u in y]
    y = torch.cat(y, dim=0)
    y = y[:, :, :F]
    return torch.concat([msk, y], dim=1)


def musubi_sinusoid(dim, position):
    """model.py:29-38 (float64), as WanModel.forward uses it: .float() after."""
    half = dim // 2
    position = position.type(torch.float64)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1).float()


def add_lora(tr):
    torch.manual_seed(LORA_INIT_SEED)
    tr.add_adapter(LoraConfig(target_modules=TARGET_MODULES, **LORA))
    g = torch.Generator().manual_seed(LORA_B_SEED)
    with torch.no_grad():
        for name, p in tr.named_parameters():  # name order
            if ".lora_B." in name:
                assert p.abs().max() == 0  # gaussian init: B zero
                p.copy_(LORA_B_STD * torch.randn(p.shape, generator=g, dtype=torch.float32))


def forward_loss(tr, model_input, timesteps, context, target, f=lambda x: x.float()):
    model_pred = tr(hidden_states=model_input, timestep=timesteps, encoder_hidden_states=context,
                    return_dict=False)[0]
    loss = torch.nn.functional.mse_loss(f(model_pred), target, reduction="none")
    return model_pred, loss.mean()


def fd_check(tr, model_input, timesteps, context, target, grads32):
    """Float64 gradients of a double copy, and central differences on 3 scalars."""
    tr64 = copy.deepcopy(tr).double()
    tr64.zero_grad(set_to_none=True)
    args = (model_input.double(), timesteps.double(), context.double(), target.double(),
            lambda x: x)
    _, L = forward_loss(tr64, *args)
    L.backward()
    g64 = {n: p.grad.detach().clone() for n, p in tr64.named_parameters() if p.requires_grad}
    rel = max(((grads32[n].double() - g64[n]).abs().max() / g64[n].abs().max()).item()
              for n in g64)
    probes = ["blocks.0.attn1.to_q.lora_A.default.weight",
              "blocks.1.ffn.net.0.proj.lora_B.default.weight",
              "blocks.0.attn2.to_out.0.lora_A.default.weight"]
    out = {"loss_float64": L.item(), "grad_float32_vs_float64_max_rel": rel, "probes": []}
    # the double copy still runs FP32LayerNorm (norm1/norm2/norm_out) and the final
    # norm_out(hidden_states.float()) in float32, which puts ~1e-7 relative noise on the loss:
    # eps 1e-3 gives up to 2 % FD error on the smallest probe, eps 1e-2 ~0.1 %
    eps = 1e-2
    for n in probes:
        p = tr64.get_parameter(n)
        flat = int(g64[n].abs().argmax())
        idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), p.shape))
        vals = []
        with torch.no_grad():
            orig = p[idx].item()
            for s in (+1, -1):
                p[idx] = orig + s * eps
                vals.append(forward_loss(tr64, *args)[1].item())
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


def musubi_timestep_effect(tr, model_input, timesteps, context, model_pred):
    """Replace Diffusers' float32 Timesteps projection by musubi's float64 sinusoid (cast to
    float32) and compare model_pred: the only numerical difference of the time path."""
    proj = tr.condition_embedder.timesteps_proj
    d_emb = proj(timesteps)
    m_emb = musubi_sinusoid(proj.num_channels, timesteps)
    h = proj.register_forward_hook(lambda mod, a, out: musubi_sinusoid(mod.num_channels, a[0]))
    try:
        with torch.no_grad():
            pred_m = tr(hidden_states=model_input, timestep=timesteps,
                        encoder_hidden_states=context, return_dict=False)[0]
    finally:
        h.remove()
    return {"sinusoid_float32_vs_float64_max_abs": mpl.maxdiff(d_emb, m_emb),
            "model_pred_with_float64_sinusoid_max_abs": mpl.maxdiff(pred_m, model_pred.detach())}


def main(out):
    t_start = time.time()
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    odir = os.path.join(out, "train_step")
    os.makedirs(odir, exist_ok=True)

    vae = AutoencoderKLWan.from_pretrained(os.path.join(HERE, "tiny_wan", "vae"))
    vae.requires_grad_(False)
    vae.eval()
    z = vae.config.z_dim
    latents_mean = torch.tensor(vae.config.latents_mean).view(1, z, 1, 1, 1)
    latents_std_inv = 1.0 / torch.tensor(vae.config.latents_std).view(1, z, 1, 1, 1)
    assert latents_mean.dtype == torch.float32 and latents_std_inv.dtype == torch.float32
    tensors = {"normalisation.latents_mean": t32(latents_mean),
               "normalisation.latents_std_inv": t32(latents_std_inv)}

    meta_cases = {}
    done = {}
    for case in CASES:
        name = case["name"]
        args = dict(DEFAULT_ARGS, **{k: v for k, v in case.items()
                                     if k in DEFAULT_ARGS})
        B, F, H, W = case["batch"], case["frames"], case["height"], case["width"]
        tr = WanTransformer3DModel.from_pretrained(
            os.path.join(HERE, case["folder"], "transformer"), torch_dtype=torch.float32)
        tr.requires_grad_(False)
        linears_in_blocks = sorted(n for n, m in tr.named_modules()
                                   if isinstance(m, torch.nn.Linear) and n.startswith("blocks."))
        if case["lora"]:
            add_lora(tr)
            wrapped = sorted(n for n, m in tr.named_modules()
                             if isinstance(m, peft.tuners.lora.LoraLayer))
            assert wrapped == linears_in_blocks, (wrapped, linears_in_blocks)
        else:
            tr.requires_grad_(True)
        tr.train()
        trainable = [n for n, p in tr.named_parameters() if p.requires_grad]
        if case["lora"]:
            assert trainable and all(".lora_A.default." in n or ".lora_B.default." in n
                                     for n in trainable)

        # ---- inputs --------------------------------------------------------------------------
        gp = torch.Generator().manual_seed(case["pixel_seed"])
        pixel_values = torch.rand((B, 3, F, H, W), generator=gp, dtype=torch.float32) * 2 - 1
        gt = torch.Generator().manual_seed(case["text_seed"])
        t5 = [torch.randn((L, TEXT_DIM), generator=gt, dtype=torch.float32)
              for L in case["context_lengths"]]
        assert len(t5) == B
        context = torch.stack([torch.cat([u, u.new_zeros(TEXT_LEN - u.size(0), u.size(1))])
                               for u in t5])
        context_lengths = torch.tensor(case["context_lengths"], dtype=torch.int64)

        # ---- latents (musubi's cache: the posterior mean, normalised) ------------------------
        with torch.no_grad():
            posterior = vae.encode(pixel_values).latent_dist
            mu = posterior.mode()
        assert torch.equal(mu, posterior.mean)
        latents = (mu - latents_mean) * latents_std_inv
        with torch.no_grad():  # musubi's WanVAE.encode loops over the samples
            mu_alone = torch.cat([vae.encode(pixel_values[b:b + 1]).latent_dist.mode()
                                  for b in range(B)])
        div_diff = int(((mu - latents_mean) / torch.tensor(vae.config.latents_std).view(
            1, z, 1, 1, 1) != latents).sum())

        y = None
        y_info = None
        if case["i2v"]:
            pipe = WanImageToVideoPipeline(tokenizer=None, text_encoder=None, vae=vae,
                                           scheduler=None, image_processor=None,
                                           image_encoder=None, transformer=tr, transformer_2=None,
                                           boundary_ratio=None, expand_timesteps=False)
            assert B == 1  # prepare_latents encodes the image batch then repeat(batch_size)
            rec = {}
            o_enc = vae.encode

            def enc(x, *a, **k):
                res = o_enc(x, *a, **k)
                rec["video_condition"] = x.clone()
                rec["mode"] = res.latent_dist.mode().clone()
                return res
            vae.encode = enc
            try:
                with torch.no_grad():
                    _, y = pipe.prepare_latents(
                        pixel_values[:, :, 0], B, 16, H, W, F, dtype=torch.float32,
                        device=torch.device("cpu"), generator=None,
                        latents=torch.zeros(B, 16, (F - 1) // 4 + 1, H // 8, W // 8))
            finally:
                del vae.__dict__["encode"]
            y_restated = musubi_y(vae, pixel_values, latents_mean, latents_std_inv)
            assert torch.equal(y, y_restated), mpl.maxdiff(y, y_restated)
            mask_rows = y[0, :4, :, 0, 0].t().tolist()
            assert all(torch.equal(y[:, :4, :, i, j], y[:, :4, :, 0, 0])
                       for i in range(H // 8) for j in range(W // 8))
            y_info = {"mask_channels_per_latent_frame": mask_rows,
                      "prepare_latents_vs_wan_cache_latents_restated": "bit-identical",
                      "video_condition_first_frame_is_pixel_frame_0": bool(torch.equal(
                          rec["video_condition"][:, :, 0], pixel_values[:, :, 0])),
                      "video_condition_rest_zero": not rec["video_condition"][:, :, 1:].any()}

        # ---- the draws: global RNG, as the trainer ------------------------------------------
        torch.manual_seed(case["draw_seed"])
        noise = torch.randn_like(latents)
        t = musubi_sample_t(args, B)
        g = torch.Generator().manual_seed(case["draw_seed"])
        assert torch.equal(torch.randn(latents.shape, generator=g), noise)
        assert torch.equal(musubi_sample_t(args, B, g), t)
        t_sampled = t.clone()
        timesteps = t * 1000.0
        t = t.view(-1, 1, 1, 1, 1) if latents.ndim == 5 else t.view(-1, 1, 1, 1)
        noisy = (1 - t) * latents + t * noise
        timesteps += 1
        assert timesteps.dtype == torch.float32 and noisy.dtype == torch.float32
        model_input = noisy if y is None else torch.cat([noisy, y], dim=1)

        # ---- forward / loss / backward ------------------------------------------------------
        target = noise - latents
        model_pred, loss = forward_loss(tr, model_input, timesteps, context, target)
        loss.backward()
        grads = {n: p.grad.detach().clone() if p.grad is not None else None
                 for n, p in tr.named_parameters() if p.requires_grad}
        params = {n: p.detach().clone() for n, p in tr.named_parameters() if p.requires_grad}
        no_grad = sorted(n for n, v in grads.items() if v is None)
        assert not no_grad, no_grad
        gnorm = torch.nn.utils.clip_grad_norm_(
            [p for p in tr.parameters() if p.requires_grad], args["max_grad_norm"]).item()

        # ---- checks ------------------------------------------------------------------------
        p64, tg64 = model_pred.detach().double(), target.double()
        loss64 = (((p64 - tg64) ** 2).sum() / p64.numel()).item()
        per_sample = [(((p64[b] - tg64[b]) ** 2).mean()).item() for b in range(B)]
        loss_rel = abs(loss64 - loss.item()) / abs(loss64)
        assert loss_rel < 1e-6, loss_rel
        assert abs(sum(per_sample) / B - loss64) < 1e-12
        tt = t_sampled.double().view(-1, 1, 1, 1, 1)
        noisy_rel = mpl.maxdiff((1 - tt) * latents.double() + tt * noise.double(), noisy)
        assert noisy_rel < 1e-6
        checks = {"loss_float64": loss64, "loss_float64_rel_diff": loss_rel,
                  "loss_per_sample_float64": per_sample,
                  "noisy_model_input_vs_float64_max_abs": noisy_rel,
                  "noise_and_t_equal_seeded_generator_draws": True,
                  "vae_batched_vs_per_sample_max_abs": mpl.maxdiff(mu, mu_alone),
                  "latents_elements_differing_if_divided_instead": div_diff,
                  "padded_context_rows_zero": not any(context[b, L:].any() for b, L in
                                                      enumerate(case["context_lengths"]))}
        checks.update(musubi_timestep_effect(tr, model_input, timesteps, context, model_pred))
        if args["min_timestep"] is not None or args["max_timestep"] is not None:
            lo, hi = args["min_timestep"] / 1000.0, args["max_timestep"] / 1000.0
            assert bool(((t_sampled >= lo) & (t_sampled <= hi)).all())
            checks["t_in_range"] = [lo, hi]
        if name == "lora_clip":
            checks["finite_differences"] = fd_check(tr, model_input, timesteps, context, target,
                                                    grads)
        if name == "full":
            for k, v in (("pixel_values", pixel_values), ("context", context), ("noise", noise),
                         ("t", t_sampled), ("latents", latents), ("noisy_model_input", noisy)):
                assert torch.equal(v, done["lora_clip"][k]), k
            checks["inputs_and_draws_equal_lora_clip"] = True

        # ---- record ------------------------------------------------------------------------
        pre = f"{name}."
        rec_t = {"pixel_values": pixel_values, "context": context,
                 "latents_mean_posterior": mu, "latents": latents, "noise": noise,
                 "t": t_sampled, "timesteps": timesteps, "noisy_model_input": noisy,
                 "model_input": model_input, "model_pred": model_pred, "target": target,
                 "loss": loss}
        if y is not None:
            rec_t.update(y=y, video_condition=rec["video_condition"],
                         y_latents_mean_posterior=rec["mode"])
        for k, v in rec_t.items():
            tensors[pre + k] = t32(v)
        tensors[pre + "context_lengths"] = context_lengths.clone()
        done[name] = {k: tensors[pre + k] for k in rec_t}
        for n in sorted(grads):
            tensors[pre + "grad." + n] = t32(grads[n])
        if case["lora"]:
            for n in sorted(params):
                tensors[pre + "lora." + n] = t32(params[n])

        def grp(n):
            if case["lora"]:
                return "lora_A" if ".lora_A." in n else "lora_B"
            parts = n.split(".")
            return ".".join(parts[:2]) if parts[0] == "blocks" else parts[0]
        groups = {}
        for n in grads:
            groups[grp(n)] = max(groups.get(grp(n), 0.0), grads[n].abs().max().item())
        info = {
            "arguments": {**{k: v for k, v in case.items() if k != "name"},
                          "musubi_args": args},
            "shapes": {k: list(tensors[pre + k].shape) for k in sorted(rec_t)}
                      | {"context_lengths": [B]},
            "values": {"t": t_sampled.tolist(), "timesteps": timesteps.tolist(),
                       "loss": loss.item(), "context_lengths": case["context_lengths"]},
            "latent_frames": latents.shape[2], "latent_hw": list(latents.shape[3:]),
            "transformer_tokens": latents.shape[2] * latents.shape[3] * latents.shape[4] // 4,
            "trainable_parameters": len(trainable),
            "trainable_values": sum(tr.get_parameter(n).numel() for n in trainable),
            "grad_max_abs": {n: grads[n].abs().max().item() for n in sorted(grads)},
            "grad_group_max_abs": dict(sorted(groups.items())),
            "grad_norm_before_clip": gnorm,
            "clip_would_scale": gnorm > args["max_grad_norm"],
            "params_with_all_zero_grad": sorted(n for n in grads if not grads[n].any()),
            "checks": checks,
        }
        if case["lora"]:
            info["lora_modules"] = sorted({n.split(".lora_")[0] for n in trainable})
        if y_info is not None:
            info["i2v"] = y_info
        meta_cases[name] = info
        print(f"{name}: B {B}, F {F}, {H}x{W}, latents {list(latents.shape)}, t "
              f"{[round(x, 4) for x in t_sampled.tolist()]}, loss {loss.item():.6f} "
              f"(float64 rel {loss_rel:.1e}), {len(grads)} grads, groups "
              f"{ {k: round(v, 5) for k, v in info['grad_group_max_abs'].items()} }, "
              f"grad norm {gnorm:.4f}, vae batched vs alone {checks['vae_batched_vs_per_sample_max_abs']:.1e}, "
              f"sinusoid effect {checks['model_pred_with_float64_sinusoid_max_abs']:.1e}")

    mpl.save_st(os.path.join(odir, "step.safetensors"), tensors)
    doc = {
        "diffusers_version": diffusers.__version__, "peft_version": peft.__version__,
        "torch_version": torch.__version__,
        "reference": {"repo": "kohya-ss/musubi-tuner", "commit": MUSUBI_COMMIT,
                      "files": ["src/musubi_tuner/wan_train_network.py",
                                "src/musubi_tuner/training/trainer_base.py",
                                "src/musubi_tuner/networks/lora_wan.py",
                                "src/musubi_tuner/networks/lora.py",
                                "src/musubi_tuner/wan_cache_latents.py",
                                "src/musubi_tuner/wan/modules/vae.py",
                                "src/musubi_tuner/wan/modules/model.py",
                                "src/musubi_tuner/wan/modules/t5.py"]},
        "fixtures": {"vae": "tiny_wan/vae", "transformer": "tiny_wan/transformer",
                     "transformer_i2v": "tiny_wan_i2v/transformer"},
        "text_len": TEXT_LEN, "text_dim": TEXT_DIM,
        "vae": {"latents_mean": list(vae.config.latents_mean),
                "latents_std": list(vae.config.latents_std), "z_dim": z},
        "order": ORDER,
        "lora": {**LORA, "scaling": LORA["lora_alpha"] / LORA["r"],
                 "target_modules": TARGET_MODULES,
                 "A": f"PEFT's gaussian init (normal std 1/r) after torch.manual_seed("
                      f"{LORA_INIT_SEED})",
                 "B": f"{LORA_B_STD} * randn, torch.Generator().manual_seed({LORA_B_SEED}), in "
                      f"named_parameters order",
                 "musubi_to_diffusers_names": {f"blocks.N.{k}": f"blocks.N.{v}"
                                               for k, v in LORA_NAME_MAP.items()},
                 "musubi_lora_key_example": "lora_unet_blocks_0_self_attn_q.lora_down.weight "
                                            "(= PEFT blocks.0.attn1.to_q.lora_A.default.weight), "
                                            "lora_up <-> lora_B, .alpha scalar",
                 "musubi_selection": "networks/lora_wan.py:16 WAN_TARGET_REPLACE_MODULES = "
                                     "['WanAttentionBlock']; lora.py:568-600 takes every "
                                     "child Linear (and Conv2d/Conv3d: none in the block) of "
                                     "each such module; lora_wan.py:37 excludes "
                                     ".*(patch_embedding|text_embedding|time_embedding|"
                                     "time_projection|norm|head).* (fullmatch on the module "
                                     "name; no block Linear matches). The modulation Parameter "
                                     "(Diffusers scale_shift_table) and the norms are not "
                                     "Linears. Wan 2.2-style I2V (and T2V): 10 Linears per "
                                     "block; Wan 2.1 I2V adds cross_attn.k_img / v_img "
                                     "(Diffusers attn2.add_k_proj / add_v_proj).",
                 "checked": "the PEFT-wrapped modules == every nn.Linear named blocks.*"},
        "semantics": {
            "latents": "posterior MEAN (musubi WanVAE.encode returns mu; Diffusers "
                       "latent_dist.mode() == mean), normalised (mu - mean) * (1 / std) with a "
                       "float32 reciprocal (vae.py:564, 701), per channel view(1, 16, 1, 1, 1); "
                       "scale_shift_latents is the identity for Wan",
            "text": "per sample [L_i, 4096] (here 32) trimmed to its tokens, zero-padded to 512 "
                    "rows inside WanModel.forward (model.py:874); no attention mask in the "
                    "cross-attention (context_lens None, model.py:872): padded rows are "
                    "embedded (text_embedder(0) = bias path) and attended. Diffusers' "
                    "WanPipeline pads to max_sequence_length 512 with zeros and the transformer "
                    "takes no mask either: same",
            "timestep_sampling": "uniform: rand; sigmoid: sigmoid(sigmoid_scale * randn); shift: "
                                 "sigmoid(sigmoid_scale * randn) then t shift / (1 + (shift - 1) "
                                 "t); then t (t_max - t_min) + t_min; the trainer's default "
                                 "timestep_sampling is 'sigma' (the scheduler-table path, "
                                 "trainer_base.py:709-729), not covered here",
            "timesteps": "model timestep = t * 1000 + 1 (float32, range 1..1001), noise level t "
                         "(noisy = (1 - t) latents + t noise): the +1 is applied AFTER noisy is "
                         "formed (trainer_base.py:704-708)",
            "i2v_y": "y = cat([mask [B, 4, T, h, w], normalised mode of vae.encode(cat([frame "
                     "0, zeros(F - 1)], dim=2))], dim=1); the transformer gets cat([noisy, y], "
                     "dim=1); Diffusers' prepare_latents == musubi's wan_cache_latents "
                     "(checked bit-identical; mask, zeros in [-1, 1] space, mean not sample, "
                     "same normalisation)",
            "loss": "mse_loss(pred.float(), target, reduction='none').mean(): one mean over all "
                    "elements (weighting_scheme 'none' -> weighting None, trainer_base.py:"
                    "1182-1186; timesteps.py:78-94); no masks, no per-sample weights, no "
                    "prior loss for Wan",
            "lora_forward": "musubi LoRAModule: org(x) + lora_up(lora_down(x)) * multiplier * "
                            "alpha / dim == PEFT base(x) + lora_B(lora_A(x)) * lora_alpha / r "
                            "(dropout 0)",
        },
        "differences_musubi_vs_diffusers": {
            "timestep_sinusoid": "musubi's sinusoidal_embedding_1d computes in float64 (then "
                                 ".float(), model.py:29-38, 850-851); Diffusers' Timesteps in "
                                 "float32 (exp(-ln(10000) i / half) * t): same formula and "
                                 "[cos, sin] order, rounding differs (see each case's "
                                 "checks.sinusoid_float32_vs_float64_max_abs and the effect on "
                                 "model_pred); the references use Diffusers' float32 path",
            "wan22_time_embedding": "for Wan 2.2 A14B (model_version 2.2) musubi expands t to "
                                    "every token (per-token embedding, model.py:859-866) and "
                                    "modulates per token: the same values as the per-sample "
                                    "path Diffusers uses for a [B] timestep",
            "vae_batching": "musubi's WanVAE.encode loops over the samples (vae.py:756); "
                            "Diffusers encodes the batch at once (here: one call); equal up to "
                            "batching noise (checks.vae_batched_vs_per_sample_max_abs)",
            "i2v_batch": "WanImageToVideoPipeline.prepare_latents encodes one image then "
                         "repeat(batch_size): one condition for the whole batch; musubi builds y "
                         "per sample from each clip's own first frame. Same for B = 1 (the case "
                         "here); a C++ trainer must build y per sample",
            "dtypes": "musubi caches latents / y in the VAE dtype (bfloat16 by default, "
                      "wan_cache_latents.py:46, 78; --vae_dtype default bfloat16) and trains in "
                      "the DiT dtype under autocast; the references are float32 throughout",
            "lora_init": "musubi initialises lora_down kaiming_uniform(a=sqrt(5)), lora_up zeros "
                         "(lora.py:75-76), default network_alpha 1 (scale 1 / dim); here PEFT's "
                         "gaussian A, B overwritten, alpha = r (scale 1). The forward formula is "
                         "the same",
            "full_finetune": "musubi's Wan trainer trains networks only (no wan_train.py); case "
                             "full is the same step with every transformer parameter trainable",
        },
        "draws": "per case: pixel_values = rand(B, 3, F, H, W) * 2 - 1 from Generator()."
                 "manual_seed(pixel_seed); t5 embeddings randn(L_i, 32) in sample order from "
                 "Generator().manual_seed(text_seed); then torch.manual_seed(draw_seed), noise = "
                 "torch.randn_like(latents) (first), t's randn / rand((B,)) (second), global RNG "
                 "as the trainer; equal to the same calls on Generator().manual_seed(draw_seed) "
                 "(checked)",
        "cases": meta_cases,
    }
    mpl.write_json(os.path.join(odir, "cases.json"), doc)
    print(f"wrote {odir}/step.safetensors ({len(tensors)} tensors), cases.json in "
          f"{time.time() - t_start:.1f} s")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_train_step.py OUT_DIR  (writes OUT_DIR/train_step/)")
    main(sys.argv[1])
