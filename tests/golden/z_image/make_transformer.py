#!/usr/bin/env python3
"""Makes tests/golden/z_image/tiny_z_image/: a tiny ZImagePipeline folder (transformer, VAE,
scheduler, model_index.json; no text encoder or tokenizer: those are ../qwen3/text_encoder and
../tokenizer) and references of ZImageTransformer2DModel's forward and ZImagePipeline.__call__.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 at ../shared/refstack2/src):
    ../shared/refstack2/run python3 tests/golden/z_image/make_transformer.py tests/golden/z_image
Re-running writes byte-identical files (float32 on one CPU thread; every file is written by
Diffusers' own save_pretrained / save_config or by safetensors' save_file with sorted keys, and
JSON with sorted keys).

Everything is Diffusers' code run unmodified: the models are built from their configs, every
parameter is then overwritten with seeded random values (Diffusers zero-initialises the pad
tokens and leaves norms at one; random values make every path count), saved with
save_pretrained and loaded back with from_pretrained before any reference is computed. Hooks
only observe (forward hooks on the transformer and its blocks, a wrapper around
scheduler.set_timesteps that calls through, a callback_on_step_end that returns {}).

Checks (the outputs do not depend on them): each forward sample run alone equals the batched
output; an independent float64 formulation of the transformer from the state dict (ref_forward,
the semantics the README lists) matches every forward case; the pipeline's schedule, mu, model
timesteps, CFG / renormalisation / truncation decisions and Euler steps are recomputed from the
recorded transformer outputs; the noise equals torch.randn on the seeded generator; the decode
equals vae.decode(latents / scaling_factor + shift_factor) then (x / 2 + 0.5).clamp(0, 1).

Writes, under OUT/tiny_z_image/:
  transformer/, vae/, scheduler/   save_pretrained output
  model_index.json                 ZImagePipeline.save_config (text encoder / tokenizer entries
                                   as Z-Image ships them: transformers Qwen3Model, Qwen2Tokenizer)
  forward.safetensors              transformer(x, t, cap_feats, return_dict=False) cases a, b, c,
                                   a_bf16, and every block's input / output of case b
  pipeline.safetensors             ZImagePipeline cases (latents, images, schedule, per-step
                                   transformer inputs / outputs and latents)
  pipeline_cases.json              the arguments of each pipeline case, mu, sigmas, CFG decisions
"""
import functools
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# refstack2 has only a stub of transformers, which Diffusers finds but reports unavailable (no
# dist-info), so diffusers.loaders leaves out FromSingleFileMixin / ZImageLoraLoaderMixin and
# pipeline_z_image.py cannot import. Flip Diffusers' availability flag before anything imports
# diffusers.loaders: the pipeline module then imports (transformers' names come from the stub,
# used only in annotations), and with text_encoder=None, tokenizer=None nothing of transformers
# runs. Diffusers' code itself is untouched.
import diffusers.utils.import_utils as _iu  # noqa: E402  (loads diffusers lazily, no loaders yet)
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"

import diffusers  # noqa: E402
from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, ZImageTransformer2DModel  # noqa: E402
from diffusers.models.normalization import RMSNorm  # noqa: E402
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline  # noqa: E402

TRANSFORMER = dict(
    all_patch_size=[2], all_f_patch_size=[1], in_channels=16, dim=64, n_layers=2,
    n_refiner_layers=1, n_heads=4, n_kv_heads=4, norm_eps=1e-5, qk_norm=True, cap_feat_dim=48,
    siglip_feat_dim=None, rope_theta=256.0, t_scale=1000.0, axes_dims=[4, 6, 6],
    axes_lens=[256, 64, 64],
)
# FLUX.1's VAE layout (4 levels, so vae_scale_factor 8, 16 latent channels, no quant convs,
# FLUX.1's scaling / shift factors), narrowed to 16 channels with 8 groups of 2.
VAE = dict(
    in_channels=3, out_channels=3, latent_channels=16, block_out_channels=[16, 16, 16, 16],
    down_block_types=["DownEncoderBlock2D"] * 4, up_block_types=["UpDecoderBlock2D"] * 4,
    layers_per_block=1, norm_num_groups=8, act_fn="silu", sample_size=64,
    scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False,
    mid_block_add_attention=True, force_upcast=True,
)
# Z-Image-Turbo's scheduler/scheduler_config.json sets num_train_timesteps 1000,
# use_dynamic_shifting false, shift 3.0 and nothing else; the rest are the defaults.
SCHEDULER = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)
# FLUX.1-dev's dynamic shifting, for the one pipeline case where the pipeline's mu matters.
SCHEDULER_DYNAMIC = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=True,
                         base_shift=0.5, max_shift=1.15, base_image_seq_len=256,
                         max_image_seq_len=4096)

MODEL_INDEX_EXTRA = {"text_encoder": ["transformers", "Qwen3Model"],
                     "tokenizer": ["transformers", "Qwen2Tokenizer"]}


def randomize(model, seed, std, pad_std=0.5):
    """Overwrite every parameter: norm weights 1 + 0.1 randn, pad tokens pad_std randn, the rest
    (linear / conv weights and every bias) std randn; in named_parameters order."""
    g = torch.Generator().manual_seed(seed)
    norm_weights = set()
    for mname, m in model.named_modules():
        if isinstance(m, (RMSNorm, torch.nn.LayerNorm, torch.nn.GroupNorm)) and m.weight is not None:
            norm_weights.add(f"{mname}.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name in norm_weights:
                p.copy_(1.0 + 0.1 * r)
            elif name.endswith("pad_token"):
                p.copy_(pad_std * r)
            else:
                p.copy_(std * r)


def save_st(tensors, path):
    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)}, path,
              metadata={"format": "pt"})


def build_folder(root):
    torch.manual_seed(0)
    tr = ZImageTransformer2DModel(**TRANSFORMER)
    randomize(tr, 20261207, 0.05)
    tr.save_pretrained(os.path.join(root, "transformer"))
    vae = AutoencoderKL(**VAE)
    randomize(vae, 20261208, 0.05)
    vae.save_pretrained(os.path.join(root, "vae"))
    sch = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    sch.save_pretrained(os.path.join(root, "scheduler"))
    pipe = ZImagePipeline(scheduler=sch, vae=vae, text_encoder=None, tokenizer=None, transformer=tr)
    pipe.register_to_config(**MODEL_INDEX_EXTRA)
    pipe.save_config(root)  # model_index.json, through Diffusers' own to_json_string


def load_components(root, dtype=torch.float32):
    tr = ZImageTransformer2DModel.from_pretrained(os.path.join(root, "transformer"), torch_dtype=dtype)
    vae = AutoencoderKL.from_pretrained(os.path.join(root, "vae"))
    sch = FlowMatchEulerDiscreteScheduler.from_pretrained(os.path.join(root, "scheduler"))
    return tr.eval(), vae.eval(), sch


# ---- transformer forward ------------------------------------------------------------------------

FORWARD_CASES = {
    # batch 2, equal image sizes (no image mask in the noise refiner), captions 5 -> 32 and
    # 37 -> 64 (caption mask in the context refiner, unified mask in the main layers)
    "a": dict(x=[(16, 1, 8, 8), (16, 1, 8, 8)], cap=[5, 37], t=[0.25, 0.8]),
    # batch 1, non-square latent (3 x 5 = 15 tokens -> 32), a caption of one token (-> 32)
    "b": dict(x=[(16, 1, 6, 10)], cap=[1], t=[0.6]),
    # batch 2, different image sizes: 4 x 8 = 32 tokens (no padding) and 3 x 2 = 6 (-> 32);
    # captions 32 (no padding) and 3 (-> 32); t at both ends of [0, 1]
    "c": dict(x=[(16, 1, 8, 16), (16, 1, 6, 4)], cap=[32, 3], t=[0.0, 1.0]),
}


def make_inputs(case, g):
    x = [torch.randn(s, generator=g, dtype=torch.float32) for s in case["x"]]
    cap = [torch.randn((n, TRANSFORMER["cap_feat_dim"]), generator=g, dtype=torch.float32)
           for n in case["cap"]]
    return x, torch.tensor(case["t"], dtype=torch.float32), cap


def capture_intermediates(tr, prefix, store):
    """Forward (pre-)hooks that copy every block's input and output (batch 1: no batch padding)."""
    handles = []

    def out_hook(name):
        def f(mod, args, out):
            store[f"{prefix}.{name}.out"] = out.detach().clone()
        return f

    def block_pre(name):
        def f(mod, args):
            store[f"{prefix}.{name}.in"] = args[0].detach().clone()
            if name == "layers.0":  # unified freqs_cis, complex64 -> (real, imag) float32
                store[f"{prefix}.unified_freqs"] = torch.view_as_real(args[2].detach()).clone()
                assert args[1] is None  # batch 1: no attention mask
        return f

    handles.append(tr.t_embedder.register_forward_hook(out_hook("t_embedder")))
    handles.append(tr.all_x_embedder["2-1"].register_forward_hook(out_hook("x_embedder")))
    handles.append(tr.cap_embedder.register_forward_hook(out_hook("cap_embedder")))
    for name, block in ([(f"noise_refiner.{i}", b) for i, b in enumerate(tr.noise_refiner)] +
                        [(f"context_refiner.{i}", b) for i, b in enumerate(tr.context_refiner)] +
                        [(f"layers.{i}", b) for i, b in enumerate(tr.layers)]):
        handles.append(block.register_forward_pre_hook(block_pre(name)))
        handles.append(block.register_forward_hook(out_hook(name)))
    handles.append(tr.all_final_layer["2-1"].register_forward_hook(out_hook("final_layer")))

    orig = tr.patchify_and_embed

    def patchify(*args, **kwargs):  # observe the position ids patchify_and_embed builds
        res = orig(*args, **kwargs)
        x_out, cap_out, _, x_pos, cap_pos, x_pad, cap_pad = res
        store[f"{prefix}.x_pos_ids"] = x_pos[0].clone()
        store[f"{prefix}.cap_pos_ids"] = cap_pos[0][:len(cap_out[0])].clone()  # rows in use
        store[f"{prefix}.x_pad_mask"] = x_pad[0].to(torch.uint8)
        store[f"{prefix}.cap_pad_mask"] = cap_pad[0].to(torch.uint8)
        store[f"{prefix}.x_patches"] = x_out[0][:len(x_pad[0]) - int(x_pad[0].sum())].clone()
        return res

    tr.patchify_and_embed = patchify

    def remove():
        for h in handles:
            h.remove()
        del tr.patchify_and_embed
    return remove


def forward_refs(root):
    tr, _, _ = load_components(root)
    g = torch.Generator().manual_seed(58)
    out = {}
    for cname, case in FORWARD_CASES.items():
        x, t, cap = make_inputs(case, g)
        remove = capture_intermediates(tr, cname + ".inter", out) if cname == "b" else None
        with torch.no_grad():
            y = tr([xi.clone() for xi in x], t.clone(), [c.clone() for c in cap], return_dict=False)[0]
        if remove:
            remove()
        for i in range(len(x)):
            assert y[i].shape == x[i].shape and y[i].dtype == torch.float32
            out[f"{cname}.x.{i}"], out[f"{cname}.cap_feats.{i}"], out[f"{cname}.out.{i}"] = x[i], cap[i], y[i]
        out[f"{cname}.t"] = t
        # Each sample alone gives the same output: padding and masks are per sample.
        with torch.no_grad():
            d = max((tr([x[i]], t[i:i + 1], [cap[i]], return_dict=False)[0][0] - y[i]).abs().max().item()
                    for i in range(len(x)))
        print(f"forward {cname}: batched vs one at a time max abs diff {d:.2e}; "
              f"max |out| {max(v.abs().max().item() for v in y):.3f}")
        assert d < 1e-5, d
        if cname == "a":  # bf16 model as from_pretrained(torch_dtype=bfloat16) gives it; t float32
            trb, _, _ = load_components(root, torch.bfloat16)
            with torch.no_grad():
                yb = trb([xi.to(torch.bfloat16) for xi in x], t.clone(),
                         [c.to(torch.bfloat16) for c in cap], return_dict=False)[0]
            for i in range(len(x)):
                assert yb[i].dtype == torch.bfloat16
                out[f"a_bf16.out.{i}"] = yb[i].float()
            print("forward a_bf16 vs float32: max abs diff "
                  f"{max((yb[i].float() - y[i]).abs().max().item() for i in range(len(x))):.3e}")
    check_forward_independent(root, out)
    save_st(out, os.path.join(root, "forward.safetensors"))


# ---- independent float64 formulation (a check; the files do not depend on it) -------------------

def ref_forward(w, x, t, cap):
    """ZImageTransformer2DModel.forward for ONE sample, as the README describes it, in float64
    from the state dict: x [C, F, H, W], t scalar, cap [L, cap_feat_dim] -> [C, F, H, W]."""
    w = {k: v.double() for k, v in w.items()}
    D, NH = TRANSFORMER["dim"], TRANSFORMER["n_heads"]
    HD, P, EPS, M = D // NH, TRANSFORMER["all_patch_size"][0], TRANSFORMER["norm_eps"], 32

    def lin(v, name, bias=True):
        return v @ w[name + ".weight"].T + (w[name + ".bias"] if bias else 0)

    def rms(v, weight, eps):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * weight

    def rope(v, pos):  # v [S, NH, HD]; interleaved pairs (2j, 2j+1), axes concatenated
        ang = []
        for a, d in enumerate(TRANSFORMER["axes_dims"]):
            fr = TRANSFORMER["rope_theta"] ** (-torch.arange(0, d, 2, dtype=torch.float64) / d)
            ang.append(pos[:, a:a + 1].double() * fr[None])
        ang = torch.cat(ang, -1)[:, None, :]  # [S, 1, HD/2]
        ev, od = v[..., 0::2], v[..., 1::2]
        out = torch.empty_like(v)
        out[..., 0::2] = ev * torch.cos(ang) - od * torch.sin(ang)
        out[..., 1::2] = ev * torch.sin(ang) + od * torch.cos(ang)
        return out

    def block(h, pos, p, temb):
        if temb is not None:  # adaLN: Linear (no SiLU) -> scale_msa, gate_msa, scale_mlp, gate_mlp
            sm, gm, sf, gf = lin(temb, p + "adaLN_modulation.0").chunk(4)
            sm, sf, gm, gf = 1 + sm, 1 + sf, torch.tanh(gm), torch.tanh(gf)
        else:
            sm = sf = gm = gf = 1.0
        a = rms(h, w[p + "attention_norm1.weight"], EPS) * sm
        S = a.shape[0]
        q = rms(lin(a, p + "attention.to_q", False).view(S, NH, HD), w[p + "attention.norm_q.weight"], 1e-5)
        k = rms(lin(a, p + "attention.to_k", False).view(S, NH, HD), w[p + "attention.norm_k.weight"], 1e-5)
        v = lin(a, p + "attention.to_v", False).view(S, NH, HD)
        q, k = rope(q, pos), rope(k, pos)
        att = torch.softmax(torch.einsum("qhd,khd->hqk", q, k) / HD ** 0.5, -1)
        o = lin(torch.einsum("hqk,khd->qhd", att, v).reshape(S, D), p + "attention.to_out.0", False)
        h = h + gm * rms(o, w[p + "attention_norm2.weight"], EPS)
        f = rms(h, w[p + "ffn_norm1.weight"], EPS) * sf
        f = lin(F.silu(lin(f, p + "feed_forward.w1", False)) * lin(f, p + "feed_forward.w3", False),
                p + "feed_forward.w2", False)
        return h + gf * rms(f, w[p + "ffn_norm2.weight"], EPS)

    # timestep: sinusoid of t * t_scale, [cos | sin], then Linear-SiLU-Linear. The argument is
    # float32 (t * t_scale and the frequencies are float32 tensors): in float64 it would move the
    # output by ~2e-5 here; cos / sin of the float32 argument are taken in float64.
    half = 128
    fr = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    arg = ((torch.tensor([t], dtype=torch.float32) * TRANSFORMER["t_scale"]) * fr).double()
    temb = lin(F.silu(lin(torch.cat([torch.cos(arg), torch.sin(arg)]), "t_embedder.mlp.0")),
               "t_embedder.mlp.2")
    # caption: RMSNorm + Linear, then cap_pad_token rows up to a multiple of 32
    L = cap.shape[0]
    Lp = L + (-L) % M
    c = lin(rms(cap.double(), w["cap_embedder.0.weight"], EPS), "cap_embedder.1")
    c = torch.cat([c, w["cap_pad_token"].expand(Lp - L, D)])
    cpos = torch.stack([torch.arange(1, Lp + 1), torch.zeros(Lp, dtype=torch.long),
                        torch.zeros(Lp, dtype=torch.long)], -1)
    # image: tokens in (f, h, w) order, features in (pf, ph, pw, c) order (c fastest)
    C, Fr, Hh, Ww = x.shape
    xt = x.double().reshape(C, Fr, Hh // P, P, Ww // P, P).permute(1, 2, 4, 3, 5, 0).reshape(-1, P * P * C)
    N = xt.shape[0]
    Np = N + (-N) % M
    xe = torch.cat([lin(xt, "all_x_embedder.2-1"), w["x_pad_token"].expand(Np - N, D)])
    f_, h_, w_ = torch.meshgrid(torch.arange(Fr), torch.arange(Hh // P), torch.arange(Ww // P), indexing="ij")
    xpos = torch.cat([torch.stack([f_.flatten() + Lp + 1, h_.flatten(), w_.flatten()], -1),
                      torch.zeros(Np - N, 3, dtype=torch.long)])
    for i in range(TRANSFORMER["n_refiner_layers"]):
        xe = block(xe, xpos, f"noise_refiner.{i}.", temb)
        c = block(c, cpos, f"context_refiner.{i}.", None)
    u, upos = torch.cat([xe, c]), torch.cat([xpos, cpos])  # image first, then caption
    for i in range(TRANSFORMER["n_layers"]):
        u = block(u, upos, f"layers.{i}.", temb)
    scale = 1 + lin(F.silu(temb), "all_final_layer.2-1.adaLN_modulation.1")
    u = F.layer_norm(u, (D,), eps=1e-6) * scale
    u = lin(u, "all_final_layer.2-1.linear")[:N]
    return u.reshape(Fr, Hh // P, Ww // P, P, P, C).permute(5, 0, 1, 3, 2, 4).reshape(C, Fr, Hh, Ww)


def check_forward_independent(root, fwd):
    w = load_file(os.path.join(root, "transformer", "diffusion_pytorch_model.safetensors"))
    worst = 0.0
    for cname, case in FORWARD_CASES.items():
        for i in range(len(case["x"])):
            r = ref_forward(w, fwd[f"{cname}.x.{i}"], fwd[f"{cname}.t"][i].item(), fwd[f"{cname}.cap_feats.{i}"])
            worst = max(worst, (r - fwd[f"{cname}.out.{i}"].double()).abs().max().item())
    print(f"independent float64 forward vs Diffusers float32: max abs diff {worst:.2e}")
    assert worst < 1e-5, worst


def check_loop_independent(case, info, out):
    """The schedule, the model timestep, CFG and the Euler step, recomputed from the recorded
    transformer outputs in float64."""
    name, n = case["name"], case["num_inference_steps"]
    s = torch.linspace(1.0, 1.0 / n, n).double()  # the pipeline's default sigmas (float32 linspace)
    cfg = info["scheduler_config"]
    seq = info["image_seq_len"]
    m = (cfg["max_shift"] - cfg["base_shift"]) / (cfg["max_image_seq_len"] - cfg["base_image_seq_len"])
    mu = seq * m + cfg["base_shift"] - m * cfg["base_image_seq_len"]
    assert abs(mu - info["mu"]) < 1e-12
    if cfg["use_dynamic_shifting"]:
        sig = math.exp(mu) / (math.exp(mu) + (1 / s - 1))
    else:
        sig = cfg["shift"] * s / (1 + (cfg["shift"] - 1) * s)
    sig = torch.cat([sig, torch.zeros(1, dtype=torch.float64)])
    assert (sig - out[f"{name}.sigmas"].double()).abs().max() < 1e-6
    lat = out[f"{name}.noise"].double()
    B, g = lat.shape[0], case["guidance_scale"]
    for i in range(n):
        t = out[f"{name}.timesteps"][i].double()
        assert abs(t - 1000 * sig[i]) < 1e-3
        assert (out[f"{name}.model_t.{i}"].double() - (1 - sig[i])).abs().max() < 1e-6
        mo = out[f"{name}.model_out.{i}"].double()[:, :, 0]
        if info["steps"][i]["apply_cfg"]:
            pos, neg = mo[:B], mo[B:]
            pred = pos + g * (pos - neg)
            if case.get("cfg_normalization"):
                for j in range(B):
                    npos, npred = pos[j].norm(), pred[j].norm()
                    if npred > npos * float(case["cfg_normalization"]):
                        pred[j] = pred[j] * (npos * float(case["cfg_normalization"]) / npred)
        else:
            pred = mo
        lat = lat + (sig[i + 1] - sig[i]) * (-pred)
        d = (lat - out[f"{name}.step_latents.{i}"].double()).abs().max().item()
        assert d < 1e-5, (name, i, d)
        lat = out[f"{name}.step_latents.{i}"].double()  # continue from the recorded float32 value
    return True


# ---- pipeline -----------------------------------------------------------------------------------

PIPELINE_CASES = [
    # Turbo: no CFG, 4 steps, two prompts, 48 x 80 pixels -> latent 6 x 10 (vae_scale_factor 8)
    dict(name="turbo", prompts=[0, 1], negatives=None, height=48, width=80, num_inference_steps=4,
         guidance_scale=0.0, cfg_normalization=False, cfg_truncation=1.0, num_images_per_prompt=1,
         seed=42),
    # Base-style CFG with renormalisation; cfg_truncation 0.3 turns CFG off at the last step
    # (t_norm = (1000 - t) / 1000 is 0, 0.143, 0.4 for the three steps)
    dict(name="cfg", prompts=[1], negatives=[2], height=32, width=64, num_inference_steps=3,
         guidance_scale=4.0, cfg_normalization=True, cfg_truncation=0.3, num_images_per_prompt=2,
         seed=7),
    # Plain CFG at every step (cfg_truncation default 1.0, no renormalisation) with FLUX.1-dev's
    # dynamic shifting, so the pipeline's mu shapes the schedule; 64 x 48 -> latent 8 x 6
    dict(name="dynamic", prompts=[0, 2], negatives=[2, 1], height=64, width=48,
         num_inference_steps=3, guidance_scale=2.0, cfg_normalization=False, cfg_truncation=1.0,
         num_images_per_prompt=1, seed=123, scheduler=SCHEDULER_DYNAMIC),
    # Not a multiple of vae_scale_factor * 2 = 16: the pipeline raises (it does not round)
    dict(name="bad_height", prompts=[0], negatives=None, height=50, width=80,
         num_inference_steps=2, guidance_scale=0.0, num_images_per_prompt=1, seed=1),
]
CALL_KEYS = ["height", "width", "num_inference_steps", "guidance_scale", "cfg_normalization",
             "cfg_truncation", "num_images_per_prompt"]


def run_pipeline(pipe, case, embeds, output_type, latents=None, record=None):
    kw = {k: case[k] for k in CALL_KEYS if k in case}
    kw["prompt_embeds"] = [embeds[j].clone() for j in case["prompts"]]
    if case["negatives"] is not None:
        kw["negative_prompt_embeds"] = [embeds[j].clone() for j in case["negatives"]]
    cb = None
    if record is not None:
        def cb(p, i, t, kwargs):
            record["step_latents"].append(kwargs["latents"].clone())
            return {}
    return pipe(generator=torch.Generator("cpu").manual_seed(case["seed"]), latents=latents,
                output_type=output_type, callback_on_step_end=cb, return_dict=False, **kw)[0]


def pipeline_refs(root, qwen3_expected):
    qe = load_file(qwen3_expected)
    embeds = {j: qe[f"prompt_embeds.{j}"] for j in range(3)}
    tr, vae, sch = load_components(root)
    out, meta = {}, {}
    for case in PIPELINE_CASES:
        name = case["name"]
        scheduler = FlowMatchEulerDiscreteScheduler(**case["scheduler"]) if "scheduler" in case else sch
        pipe = ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=None, tokenizer=None,
                              transformer=tr)
        pipe.set_progress_bar_config(disable=True)
        args = {k: case[k] for k in CALL_KEYS if k in case}
        info = {"arguments": dict(args, seed=case["seed"],
                                  generator="torch.Generator('cpu').manual_seed(seed)",
                                  prompt_embeds=[f"qwen3/expected.safetensors:prompt_embeds.{j}"
                                                 for j in case["prompts"]],
                                  negative_prompt_embeds=None if case["negatives"] is None else
                                  [f"qwen3/expected.safetensors:prompt_embeds.{j}"
                                   for j in case["negatives"]],
                                  output_type=["latent"] if name == "bad_height" else
                                  ["latent", "pt", "np"]),
                "scheduler_config": {k: v for k, v in sorted(scheduler.config.items())
                                     if not k.startswith("_")}}
        if name == "bad_height":
            try:
                run_pipeline(pipe, case, embeds, "latent")
                raise AssertionError("expected a ValueError")
            except ValueError as e:
                info["raises"] = {"type": "ValueError", "message": str(e)}
            meta[name] = info
            continue

        rec = {"set_timesteps": [], "t": [], "model_out": [], "step_latents": []}
        orig_set = scheduler.set_timesteps

        @functools.wraps(orig_set)  # keeps the signature retrieve_timesteps inspects
        def set_timesteps(*a, **k):  # observe, then call through
            orig_set(*a, **k)
            rec["set_timesteps"].append(dict(k, sigmas_in=list(k.get("sigmas") or []),
                                             sigmas=scheduler.sigmas.clone(),
                                             timesteps=scheduler.timesteps.clone()))
        scheduler.set_timesteps = set_timesteps

        def hook(mod, a, o):
            rec["t"].append(a[1].detach().clone())
            rec["model_out"].append(torch.stack(o[0]).detach().clone())
        h = tr.register_forward_hook(hook)
        with torch.no_grad():
            lat = run_pipeline(pipe, case, embeds, "latent", record=rec)
        h.remove()
        n_calls = len(rec["t"])
        st = rec["set_timesteps"][0]
        with torch.no_grad():
            img = run_pipeline(pipe, case, embeds, "pt")
            img_np = run_pipeline(pipe, case, embeds, "np")
        del scheduler.set_timesteps
        assert torch.equal(torch.from_numpy(img_np).permute(0, 3, 1, 2), img)
        # The initial noise: randn_tensor with a CPU generator is torch.randn(shape, generator)
        B = len(case["prompts"]) * case["num_images_per_prompt"]
        hl, wl = 2 * (case["height"] // 16), 2 * (case["width"] // 16)
        noise = torch.randn((B, 16, hl, wl), generator=torch.Generator().manual_seed(case["seed"]),
                            dtype=torch.float32)
        with torch.no_grad():
            assert torch.equal(run_pipeline(pipe, case, embeds, "latent", latents=noise.clone()), lat)
            # the decode the pipeline does, here by hand: latents / scaling + shift -> vae.decode
            dec = vae.decode(lat / vae.config.scaling_factor + vae.config.shift_factor,
                             return_dict=False)[0]
        assert torch.equal((dec / 2 + 0.5).clamp(0, 1), img)
        assert lat.shape == (B, 16, hl, wl) and img.shape == (B, 3, 8 * hl, 8 * wl)

        # What the loop decided, step by step, from the recorded transformer outputs
        timesteps = st["timesteps"]
        steps, call = [], 0
        g = case["guidance_scale"]
        for i, t in enumerate(timesteps.tolist()):
            t_norm = (1000 - torch.tensor(t, dtype=torch.float32)) / 1000
            trunc = g > 0 and t_norm.item() > case.get("cfg_truncation", 1.0)
            apply_cfg = g > 0 and not trunc
            mo = rec["model_out"][i]
            step = {"t": t, "model_t": rec["t"][i][0].item(), "cfg_truncated": bool(trunc),
                    "apply_cfg": bool(apply_cfg), "transformer_batch": mo.shape[0]}
            assert mo.shape[0] == (2 * B if apply_cfg else B)
            if apply_cfg and case.get("cfg_normalization"):
                pos, neg = mo[:B].float(), mo[B:].float()
                clipped = []
                for j in range(B):
                    pred = pos[j] + g * (pos[j] - neg[j])
                    clipped.append(bool(torch.linalg.vector_norm(pred) > torch.linalg.vector_norm(pos[j])))
                step["renorm_clipped"] = clipped
            steps.append(step)
            out[f"{name}.model_t.{i}"] = rec["t"][i]
            out[f"{name}.model_out.{i}"] = mo
            out[f"{name}.step_latents.{i}"] = rec["step_latents"][i]
        assert n_calls == len(timesteps)
        assert torch.equal(rec["step_latents"][-1], lat)
        if name == "cfg":  # both CFG paths and the renormalisation clip happen
            assert any(s["apply_cfg"] for s in steps) and any(s["cfg_truncated"] for s in steps)
            assert any(any(s.get("renorm_clipped", [])) for s in steps)

        for j, pj in enumerate(case["prompts"]):
            out[f"{name}.prompt_embeds.{j}"] = embeds[pj]
        for j, nj in enumerate(case["negatives"] or []):
            out[f"{name}.negative_prompt_embeds.{j}"] = embeds[nj]
        out[f"{name}.noise"] = noise
        out[f"{name}.sigmas"] = st["sigmas"]
        out[f"{name}.timesteps"] = timesteps
        out[f"{name}.latents"] = lat
        out[f"{name}.image"] = img
        if name == "turbo":  # image = clamp(decoded / 2 + 0.5, 0, 1); ~1.3% of values clip
            out[f"{name}.vae_decoded"] = dec
        info.update({
            "latent_shape": list(lat.shape), "image_shape": list(img.shape),
            "image_seq_len": (hl // 2) * (wl // 2), "mu": st["mu"],
            "sigmas_passed": st["sigmas_in"], "sigmas": st["sigmas"].tolist(),
            "timesteps": timesteps.tolist(), "steps": steps,
        })
        check_loop_independent(case, info, out)
        meta[name] = info
        print(f"pipeline {name}: latents {tuple(lat.shape)} max |.| {lat.abs().max().item():.3f}, "
              f"mu {st['mu']:.6f}, sigmas {[round(s, 5) for s in st['sigmas'].tolist()]}, "
              f"decoded in [{dec.min().item():.3f}, {dec.max().item():.3f}]")
    save_st(out, os.path.join(root, "pipeline.safetensors"))
    with open(os.path.join(root, "pipeline_cases.json"), "w") as f:
        f.write(json.dumps({"diffusers_version": diffusers.__version__, "cases": meta},
                           indent=2, sort_keys=True) + "\n")


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    root = os.path.join(out, "tiny_z_image")
    os.makedirs(root, exist_ok=True)
    build_folder(root)
    forward_refs(root)
    here = os.path.dirname(os.path.abspath(__file__))
    pipeline_refs(root, os.path.join(here, "qwen3", "expected.safetensors"))
    print(f"wrote {root}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_transformer.py OUT_DIR  (writes OUT_DIR/tiny_z_image)")
    main(sys.argv[1])
