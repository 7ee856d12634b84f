#!/usr/bin/env python3
"""Makes tests/golden/qwen_image/tiny_qwen_image/: a tiny QwenImagePipeline folder (transformer,
VAE, scheduler, model_index.json; no text encoder or tokenizer: another script makes those under
../text_encoder and ../tokenizer), two more transformer configs (`transformer_zero_cond/`, as
Qwen-Image-Edit-2511 sets `zero_cond_t`, and `transformer_layered/`, as Qwen-Image-Layered sets
`use_additional_t_cond` and `use_layer3d_rope`), and references of
QwenImageTransformer2DModel.forward for each.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 at ../shared/refstack2/src):
    ../shared/refstack2/run python3 tests/golden/qwen_image/make_transformer.py tests/golden/qwen_image
Re-running writes byte-identical files (float32 on one CPU thread; every file is written by
Diffusers' own save_pretrained / save_config or by safetensors' save_file with sorted keys and the
single metadata entry {"format": "pt"}, and JSON with sorted keys).

Everything is Diffusers' code run unmodified: the models are built from their configs, every
parameter is then overwritten with seeded random values (Diffusers leaves norm weights at one and
the biases at zero; random values make every path count), saved with save_pretrained and loaded
back with from_pretrained before any reference is computed. Hooks only observe (forward hooks and
forward pre-hooks that copy tensors).

Folder contents (under OUT/tiny_qwen_image/):
  transformer/              QwenImageTransformer2DModel.save_pretrained (TRANSFORMER below)
  transformer_zero_cond/    the same weights with zero_cond_t=True: config.json from save_pretrained,
                            and diffusion_pytorch_model.safetensors as a relative symlink to
                            ../transformer/diffusion_pytorch_model.safetensors (save_pretrained writes
                            a byte-identical file, checked, then the script replaces it by the link to
                            keep the fixtures small)
  transformer_layered/      use_additional_t_cond=True, use_layer3d_rope=True: transformer/'s
                            weights plus the new time_text_embed.addition_t_embedding.weight [2, 64]
                            (seeded, std 0.5), as a two-shard checkpoint in Diffusers' sharded layout
                            (config.json from save_config; diffusion_pytorch_model.safetensors.index.json
                            as save_pretrained writes an index; shard 00001-of-00002 a relative symlink
                            to ../transformer/diffusion_pytorch_model.safetensors, shard 00002-of-00002
                            the embedding alone). from_pretrained loads it; checked equal to the model.
  vae/                      AutoencoderKLQwenImage.save_pretrained (VAE below; make_vae.py uses it)
  scheduler/                FlowMatchEulerDiscreteScheduler.save_pretrained with Qwen-Image's config
  model_index.json          QwenImagePipeline.save_config, text_encoder / tokenizer entries as
                            Qwen-Image ships them (transformers Qwen2_5_VLForConditionalGeneration,
                            Qwen2Tokenizer)
  forward.safetensors       transformer/ cases a, b, c, edit, a_bf16, and case b's intermediates
  forward_zero_cond.safetensors  transformer_zero_cond/ case zc_edit (+ intermediates)
  forward_layered.safetensors    transformer_layered/ cases layered, layered_t1 (+ intermediates)

Per forward case <case>: .hidden_states [B, N, 64], .encoder_hidden_states [B, S, 64],
.encoder_hidden_states_mask int64 [B, S] (1 real, 0 pad; ABSENT when the case passes None),
.timestep float32 [B] (t / 1000 as the pipeline passes it, in [0, 1]), .img_shapes int64 [B, K, 3]
((frame, h, w) per image in 2x2-patch units; N = sum f*h*w), .additional_t_cond int64 [B] (layered
only), .out [B, N, 64] = transformer(hidden_states=..., encoder_hidden_states=...,
encoder_hidden_states_mask=..., timestep=..., img_shapes=<list of lists of tuples>,
[additional_t_cond=...], return_dict=False)[0]. Padded text rows hold random values (not zeros) so
that the mask matters.

Checks (the outputs do not depend on them): an independent float64 formulation of the transformer
from the state dict (ref_forward: the semantics the README lists) matches every case; each sample
run alone equals the batched output; a right-padded mask gives the same output as the truncated
sequence without a mask; an all-ones mask gives the same output as None; the symlinked zero_cond
folder loads through from_pretrained.
"""
import json
import math
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

# refstack2 has only a stub of transformers, which Diffusers finds but reports unavailable (no
# dist-info), so diffusers.loaders leaves out the Qwen-Image LoRA loader and pipeline_qwenimage.py
# cannot import. Flip Diffusers' availability flag before anything imports diffusers.loaders: the
# pipeline module then imports (transformers' names come from the stub, used only in annotations),
# and with text_encoder=None, tokenizer=None nothing of transformers runs. Diffusers' code itself
# is untouched.
import diffusers.utils.import_utils as _iu  # noqa: E402  (loads diffusers lazily, no loaders yet)
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"

import diffusers  # noqa: E402
from diffusers import (AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler,  # noqa: E402
                       QwenImageTransformer2DModel)
from diffusers.models.autoencoders.autoencoder_kl_qwenimage import QwenImageRMS_norm  # noqa: E402
from diffusers.models.normalization import RMSNorm  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline  # noqa: E402

TRANSFORMER = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
    num_attention_heads=4, joint_attention_dim=64, guidance_embeds=False, axes_dims_rope=(4, 6, 6),
    zero_cond_t=False, use_additional_t_cond=False, use_layer3d_rope=False,
)
# Qwen-Image-Edit-2511 sets zero_cond_t; no new parameters, so the same state dict.
TRANSFORMER_ZERO_COND = dict(TRANSFORMER, zero_cond_t=True)
# Qwen-Image-Layered sets use_additional_t_cond (adds time_text_embed.addition_t_embedding, an
# nn.Embedding(2, 64)) and use_layer3d_rope.
TRANSFORMER_LAYERED = dict(TRANSFORMER, use_additional_t_cond=True, use_layer3d_rope=True)

# Qwen-Image's real latents_mean / latents_std: AutoencoderKLQwenImage's defaults (the values of
# Qwen/Qwen-Image's vae/config.json), restated here and checked against the class signature.
LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134,
                -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526,
               2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]
# Qwen-Image's VAE layout (temperal_downsample [False, True, True] so 3 spatial downsamples:
# vae_scale_factor 8, 4x temporal; z_dim 16; attn_scales [] so attention only in the mid blocks)
# narrowed to base_dim 4 (real: 96), dim_mult [1, 2, 2, 2] (real: [1, 2, 4, 4]) and one residual
# block per level (real: 2): 61,887 parameters (base_dim 4 with [1, 2, 4, 4] would be 179,295).
VAE = dict(
    base_dim=4, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1, attn_scales=[],
    temperal_downsample=[False, True, True], dropout=0.0, input_channels=3,
    latents_mean=LATENTS_MEAN, latents_std=LATENTS_STD,
)
# The decoder's last conv at std 0.15 (not 0.05) so that ~1-2% of decoded values leave [-1, 1]
# and decode's clamp matters (at 0.05 the output stays within [-0.7, 0.4]).
VAE_STD_OVERRIDES = {"decoder.conv_out.weight": 0.15}
# Qwen/Qwen-Image scheduler/scheduler_config.json
SCHEDULER = dict(
    base_image_seq_len=256, base_shift=0.5, invert_sigmas=False, max_image_seq_len=8192,
    max_shift=0.9, num_train_timesteps=1000, shift=1.0, shift_terminal=0.02,
    stochastic_sampling=False, time_shift_type="exponential", use_beta_sigmas=False,
    use_dynamic_shifting=True, use_exponential_sigmas=False, use_karras_sigmas=False,
)
MODEL_INDEX_EXTRA = {"text_encoder": ["transformers", "Qwen2_5_VLForConditionalGeneration"],
                     "tokenizer": ["transformers", "Qwen2Tokenizer"]}

SEED_TRANSFORMER, SEED_LAYERED, SEED_VAE, SEED_INPUTS = 20261220, 20261221, 20261222, 59


def randomize(model, seed, std=0.05, embedding_std=0.5, overrides=None):
    """Overwrite every parameter in named_parameters order from one generator: norm weights
    (RMSNorm weights, the VAE's RMS_norm gammas) 1 + 0.1 randn, nn.Embedding tables
    embedding_std randn, parameters named in overrides overrides[name] randn, everything else
    (linear / conv weights and every bias) std randn."""
    overrides = overrides or {}
    g = torch.Generator().manual_seed(seed)
    norm_weights, embeddings = set(), set()
    for mname, m in model.named_modules():
        if isinstance(m, (RMSNorm, torch.nn.LayerNorm, torch.nn.GroupNorm)) and m.weight is not None:
            norm_weights.add(f"{mname}.weight")
        if isinstance(m, QwenImageRMS_norm):
            norm_weights.add(f"{mname}.gamma")
        if isinstance(m, torch.nn.Embedding):
            embeddings.add(f"{mname}.weight")
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name in norm_weights:
                p.copy_(1.0 + 0.1 * r)
            elif name in embeddings:
                p.copy_(embedding_std * r)
            elif name in overrides:
                p.copy_(overrides[name] * r)
            else:
                p.copy_(std * r)


def save_st(tensors, path):
    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)}, path,
              metadata={"format": "pt"})


def sha_equal(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


def build_folder(root):
    import inspect
    sig = inspect.signature(AutoencoderKLQwenImage.__init__).parameters
    assert list(sig["latents_mean"].default) == LATENTS_MEAN
    assert list(sig["latents_std"].default) == LATENTS_STD

    torch.manual_seed(0)
    tr = QwenImageTransformer2DModel(**TRANSFORMER)
    randomize(tr, SEED_TRANSFORMER)
    tr.save_pretrained(os.path.join(root, "transformer"))

    # zero_cond_t: the same parameters (same seed), its own config; the weights file is a link
    zc_dir = os.path.join(root, "transformer_zero_cond")
    zc_file = os.path.join(zc_dir, "diffusion_pytorch_model.safetensors")
    if os.path.islink(zc_file):
        os.remove(zc_file)
    zc = QwenImageTransformer2DModel(**TRANSFORMER_ZERO_COND)
    randomize(zc, SEED_TRANSFORMER)
    zc.save_pretrained(zc_dir)
    main_file = os.path.join(root, "transformer", "diffusion_pytorch_model.safetensors")
    assert sha_equal(zc_file, main_file), "zero_cond weights should be byte-identical"
    os.remove(zc_file)
    os.symlink(os.path.join("..", "transformer", "diffusion_pytorch_model.safetensors"), zc_file)

    write_layered(root, tr)

    vae = AutoencoderKLQwenImage(**VAE)
    randomize(vae, SEED_VAE, overrides=VAE_STD_OVERRIDES)
    vae.save_pretrained(os.path.join(root, "vae"))

    sch = FlowMatchEulerDiscreteScheduler(**SCHEDULER)
    sch.save_pretrained(os.path.join(root, "scheduler"))
    pipe = QwenImagePipeline(scheduler=sch, vae=vae, text_encoder=None, tokenizer=None, transformer=tr)
    pipe.register_to_config(**MODEL_INDEX_EXTRA)
    pipe.save_config(root)  # model_index.json, through Diffusers' own to_json_string


def write_layered(root, tr):
    """transformer_layered/: transformer/'s parameters plus a seeded addition_t_embedding, as two
    shards (the first a link to transformer/'s file) with Diffusers' index file."""
    lay = QwenImageTransformer2DModel(**TRANSFORMER_LAYERED)
    missing, unexpected = lay.load_state_dict(tr.state_dict(), strict=False)
    emb_name = "time_text_embed.addition_t_embedding.weight"
    assert list(missing) == [emb_name] and not unexpected, (missing, unexpected)
    g = torch.Generator().manual_seed(SEED_LAYERED)
    with torch.no_grad():
        lay.time_text_embed.addition_t_embedding.weight.copy_(0.5 * torch.randn((2, 64), generator=g))
    d = os.path.join(root, "transformer_layered")
    os.makedirs(d, exist_ok=True)
    for f in os.listdir(d):
        os.remove(os.path.join(d, f))
    lay.save_config(d)  # config.json, as save_pretrained writes it
    shard1 = "diffusion_pytorch_model-00001-of-00002.safetensors"
    shard2 = "diffusion_pytorch_model-00002-of-00002.safetensors"
    os.symlink(os.path.join("..", "transformer", "diffusion_pytorch_model.safetensors"), os.path.join(d, shard1))
    save_file({emb_name: lay.state_dict()[emb_name].clone()}, os.path.join(d, shard2), metadata={"format": "pt"})
    sd = lay.state_dict()
    index = {"metadata": {"total_size": sum(v.numel() * v.element_size() for v in sd.values())},
             "weight_map": {k: (shard2 if k == emb_name else shard1) for k in sd}}
    with open(os.path.join(d, "diffusion_pytorch_model.safetensors.index.json"), "w", encoding="utf-8") as f:
        f.write(json.dumps(index, indent=2, sort_keys=True) + "\n")  # as save_pretrained writes it
    # the layout loads back to exactly this model
    back = QwenImageTransformer2DModel.from_pretrained(d).state_dict()
    assert back.keys() == sd.keys() and all(torch.equal(back[k], sd[k]) for k in sd)


def load_transformer(root, sub, dtype=torch.float32):
    return QwenImageTransformer2DModel.from_pretrained(os.path.join(root, sub), torch_dtype=dtype).eval()


# ---- forward cases ------------------------------------------------------------------------------

# shapes: the (frame, h, w) list of ONE sample (every sample of a batch gets the same list, as the
# pipelines build it); lengths: real text tokens per sample (None: mask None); t: t / 1000.
FORWARD_CASES = {
    # batch 2, 4 x 6 patches (N 24), text 7 with the second sample's last 3 tokens padded
    "a": dict(shapes=[(1, 4, 6)], B=2, S=7, lengths=[7, 4], t=[0.9375, 0.3]),
    # batch 1, odd sizes 3 x 5 (N 15: RoPE positions -2..0 and -3..1), one text token, mask None
    "b": dict(shapes=[(1, 3, 5)], B=1, S=1, lengths=None, t=[0.6]),
    # batch 2, 2 x 8 patches (N 16), text 12 with an all-ones mask passed explicitly, t at 0 and 1
    "c": dict(shapes=[(1, 2, 8)], B=2, S=12, lengths=[12, 12], t=[0.0, 1.0]),
    # Edit layout: target 4 x 4 then the reference image 4 x 6 along N (N 16 + 24 = 40); the
    # reference gets RoPE frame index 1; text 8 with 2 padded tokens
    "edit": dict(shapes=[(1, 4, 4), (1, 4, 6)], B=1, S=8, lengths=[6], t=[0.5]),
}
ZERO_COND_CASES = {
    # Edit-2511 layout: target 4 x 4 modulated with t, the reference 2 x 6 with t = 0
    "zc_edit": dict(shapes=[(1, 4, 4), (1, 2, 6)], B=2, S=9, lengths=[9, 5], t=[0.8, 0.35]),
}
LAYERED_CASES = {
    # Layered layout (layers=1): layers + 1 = 2 generated 4 x 4 images (frame indices 0, 1) then
    # the condition image (frame index -1); is_rgb = additional_t_cond = 0 as the pipeline passes
    "layered": dict(shapes=[(1, 4, 4)] * 3, B=1, S=6, lengths=None, t=[0.7], add_t=[0]),
    # the same inputs with the embedding table's second row
    "layered_t1": dict(shapes=[(1, 4, 4)] * 3, B=1, S=6, lengths=None, t=[0.7], add_t=[1],
                       same_inputs_as="layered"),
}


def make_inputs(case, g):
    B, S = case["B"], case["S"]
    N = sum(f * h * w for f, h, w in case["shapes"])
    x = torch.randn((B, N, TRANSFORMER["in_channels"]), generator=g, dtype=torch.float32)
    ctx = torch.randn((B, S, TRANSFORMER["joint_attention_dim"]), generator=g, dtype=torch.float32)
    mask = None
    if case["lengths"] is not None:
        mask = torch.zeros((B, S), dtype=torch.int64)
        for i, n in enumerate(case["lengths"]):
            mask[i, :n] = 1
    t = torch.tensor(case["t"], dtype=torch.float32)
    add_t = torch.tensor(case["add_t"], dtype=torch.int64) if "add_t" in case else None
    return x, ctx, mask, t, add_t


def img_shapes_arg(case):
    return [list(case["shapes"]) for _ in range(case["B"])]  # list (batch) of lists of tuples


def run(tr, case, x, ctx, mask, t, add_t, dtype=torch.float32):
    kw = dict(hidden_states=x.to(dtype), encoder_hidden_states=ctx.to(dtype),
              encoder_hidden_states_mask=None if mask is None else mask.clone(),
              timestep=t.to(dtype), img_shapes=img_shapes_arg(case), return_dict=False)
    if add_t is not None:
        kw["additional_t_cond"] = add_t.clone()
    with torch.no_grad():
        return tr(**kw)[0]


def capture(tr, prefix, store, full):
    """Hooks that copy intermediates; full=False records only the RoPE factors (and, with
    zero_cond_t, temb and modulate_index)."""
    handles = []

    def out_hook(name):
        def f(mod, args, out):
            store[f"{prefix}.{name}"] = out.detach().float().clone()
        return f

    def rope_hook(mod, args, out):
        vid, txt = out
        store[f"{prefix}.img_freqs_cos"] = vid.real.float().clone()
        store[f"{prefix}.img_freqs_sin"] = vid.imag.float().clone()
        store[f"{prefix}.txt_freqs_cos"] = txt.real.float().clone()
        store[f"{prefix}.txt_freqs_sin"] = txt.imag.float().clone()

    handles.append(tr.pos_embed.register_forward_hook(rope_hook))
    if full or tr.config.zero_cond_t:
        handles.append(tr.time_text_embed.register_forward_hook(out_hook("temb")))
    if tr.config.zero_cond_t:
        def pre(mod, args, kwargs):
            store[f"{prefix}.modulate_index"] = kwargs["modulate_index"].clone()
        handles.append(tr.transformer_blocks[0].register_forward_pre_hook(pre, with_kwargs=True))
    if full:
        handles.append(tr.img_in.register_forward_hook(out_hook("img_in")))
        handles.append(tr.txt_norm.register_forward_hook(out_hook("txt_norm")))
        handles.append(tr.txt_in.register_forward_hook(out_hook("txt_in")))
        for i, blk in enumerate(tr.transformer_blocks):
            def bh(mod, args, out, i=i):
                store[f"{prefix}.block{i}.out_txt"] = out[0].detach().clone()
                store[f"{prefix}.block{i}.out_img"] = out[1].detach().clone()
            handles.append(blk.register_forward_hook(bh))
            handles.append(blk.img_mod.register_forward_hook(out_hook(f"block{i}.img_mod")))
            handles.append(blk.txt_mod.register_forward_hook(out_hook(f"block{i}.txt_mod")))
        handles.append(tr.norm_out.register_forward_hook(out_hook("norm_out")))

    def remove():
        for h in handles:
            h.remove()
    return remove


# ---- independent float64 formulation (a check; the files do not depend on it) -------------------

def rope_positions(shapes, layered):
    """(frame, h, w) positions of every image token and the text offset, as the README states."""
    rows, maxv, last = [], 0, len(shapes) - 1
    for idx, (f, h, w) in enumerate(shapes):
        fpos = [-1] * f if (layered and idx == last) else list(range(idx, idx + f))
        hpos = [k - (h - h // 2) for k in range(h)]  # scale_rope: centred, -(h - h//2) .. h//2 - 1
        wpos = [k - (w - w // 2) for k in range(w)]
        rows += [(a, b, c) for a in fpos for b in hpos for c in wpos]
        maxv = max(maxv, h // 2, w // 2)
    if layered:
        maxv = max(maxv, last)
    return torch.tensor(rows, dtype=torch.float64), maxv


def rope_angles(pos):
    """pos [L, 3] -> angles [L, head_dim / 2]: per axis a (dims d_a), pos_a * 10000^(-2j/d_a)."""
    ang = []
    for a, d in enumerate(TRANSFORMER["axes_dims_rope"]):
        inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2, dtype=torch.float64) / d))
        ang.append(pos[:, a:a + 1] * inv[None])
    return torch.cat(ang, -1)


def apply_rope(v, ang):  # v [L, H, hd]: interleaved pairs (2j, 2j+1) times exp(i ang_j)
    c, s = torch.cos(ang)[:, None], torch.sin(ang)[:, None]
    ev, od = v[..., 0::2], v[..., 1::2]
    out = torch.empty_like(v)
    out[..., 0::2] = ev * c - od * s
    out[..., 1::2] = ev * s + od * c
    return out


def ref_forward(w, cfg, x, ctx, mask, t, shapes, add_t=None):
    """QwenImageTransformer2DModel.forward for ONE sample in float64 from the state dict:
    x [N, in], ctx [S, joint], mask [S] (or None), t float, shapes [(f, h, w), ...] -> [N, out]."""
    w = {k: v.double() for k, v in w.items()}
    NH, HD = cfg["num_attention_heads"], cfg["attention_head_dim"]
    D = NH * HD
    x, ctx = x.double(), ctx.double()

    def lin(v, n):
        return v @ w[n + ".weight"].T + w[n + ".bias"]

    def rms(v, wt, eps=1e-6):
        return v / torch.sqrt((v * v).mean(-1, keepdim=True) + eps) * wt

    def ln(v):
        return F.layer_norm(v, (D,), eps=1e-6)

    def temb_of(tv):
        # Timesteps(256, flip_sin_to_cos=True, shift 0, scale 1000): the argument is float32
        fr = torch.exp((-math.log(10000.0) * torch.arange(128, dtype=torch.float32)) / 128)
        arg = (1000 * (torch.tensor([tv], dtype=torch.float32)[:, None] * fr[None]))[0].double()
        e = torch.cat([torch.cos(arg), torch.sin(arg)])
        p = "time_text_embed.timestep_embedder."
        h = lin(F.silu(lin(e, p + "linear_1")), p + "linear_2")
        if add_t is not None:
            h = h + w["time_text_embed.addition_t_embedding.weight"][add_t]
        return h

    temb = temb_of(t)
    N = x.shape[0]
    if cfg["zero_cond_t"]:  # tokens of the first image: temb(t); every later image: temb(0)
        temb0 = temb_of(0.0)
        n0 = math.prod(shapes[0])
        tok_temb = torch.stack([temb if i < n0 else temb0 for i in range(N)])  # [N, D]
    else:
        tok_temb = temb.expand(N, D)

    pos, maxv = rope_positions(shapes, cfg["use_layer3d_rope"])
    img_ang = rope_angles(pos)
    S = ctx.shape[0]
    txt_ang = rope_angles(torch.arange(maxv, maxv + S, dtype=torch.float64)[:, None].expand(S, 3))

    h = lin(x, "img_in")
    c = lin(rms(ctx, w["txt_norm.weight"]), "txt_in")
    for b in range(cfg["num_layers"]):
        p = f"transformer_blocks.{b}."
        im = lin(F.silu(tok_temb), p + "img_mod.1")  # [N, 6D]: shift, scale, gate (x2)
        tm = lin(F.silu(temb), p + "txt_mod.1")  # [6D]
        ish1, isc1, ig1, ish2, isc2, ig2 = im.chunk(6, -1)
        tsh1, tsc1, tg1, tsh2, tsc2, tg2 = tm.chunk(6, -1)
        a_img = ln(h) * (1 + isc1) + ish1
        a_txt = ln(c) * (1 + tsc1) + tsh1
        q_i = rms(lin(a_img, p + "attn.to_q").view(N, NH, HD), w[p + "attn.norm_q.weight"])
        k_i = rms(lin(a_img, p + "attn.to_k").view(N, NH, HD), w[p + "attn.norm_k.weight"])
        v_i = lin(a_img, p + "attn.to_v").view(N, NH, HD)
        q_t = rms(lin(a_txt, p + "attn.add_q_proj").view(S, NH, HD), w[p + "attn.norm_added_q.weight"])
        k_t = rms(lin(a_txt, p + "attn.add_k_proj").view(S, NH, HD), w[p + "attn.norm_added_k.weight"])
        v_t = lin(a_txt, p + "attn.add_v_proj").view(S, NH, HD)
        q = torch.cat([apply_rope(q_t, txt_ang), apply_rope(q_i, img_ang)])  # [text, image]
        k = torch.cat([apply_rope(k_t, txt_ang), apply_rope(k_i, img_ang)])
        v = torch.cat([v_t, v_i])
        sc = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(HD)
        if mask is not None:
            keep = torch.cat([mask.bool(), torch.ones(N, dtype=torch.bool)])
            sc = sc.masked_fill(~keep[None, None, :], float("-inf"))
        o = torch.einsum("hqk,khd->qhd", torch.softmax(sc, -1), v).reshape(S + N, D)
        h = h + ig1 * lin(o[S:], p + "attn.to_out.0")
        c = c + tg1 * lin(o[:S], p + "attn.to_add_out")

        def mlp(v, n):
            return lin(F.gelu(lin(v, n + ".net.0.proj"), approximate="tanh"), n + ".net.2")
        h = h + ig2 * mlp(ln(h) * (1 + isc2) + ish2, p + "img_mlp")
        c = c + tg2 * mlp(ln(c) * (1 + tsc2) + tsh2, p + "txt_mlp")
    sc_, sh_ = lin(F.silu(temb), "norm_out.linear").chunk(2)  # scale first, then shift
    return lin(ln(h) * (1 + sc_) + sh_, "proj_out")


def check_independent(root, sub, cases, fwd):
    cfg = dict(json.load(open(os.path.join(root, sub, "config.json"))))
    index = os.path.join(root, sub, "diffusion_pytorch_model.safetensors.index.json")
    if os.path.exists(index):  # sharded: read every shard the index names
        w = {}
        for f in sorted(set(json.load(open(index))["weight_map"].values())):
            w.update(load_file(os.path.join(root, sub, f)))
    else:
        w = load_file(os.path.join(root, sub, "diffusion_pytorch_model.safetensors"))
    worst = 0.0
    for cname, case in cases.items():
        for i in range(case["B"]):
            m = fwd.get(f"{cname}.encoder_hidden_states_mask")
            at = fwd.get(f"{cname}.additional_t_cond")
            r = ref_forward(w, cfg, fwd[f"{cname}.hidden_states"][i], fwd[f"{cname}.encoder_hidden_states"][i],
                            None if m is None else m[i], fwd[f"{cname}.timestep"][i].item(), case["shapes"],
                            None if at is None else at[i].item())
            worst = max(worst, (r - fwd[f"{cname}.out"][i].double()).abs().max().item())
    print(f"{sub}: independent float64 forward vs Diffusers float32: max abs diff {worst:.2e}")
    assert worst < 1e-5, worst


# ---- references ---------------------------------------------------------------------------------

def forward_set(root, sub, cases, g, inter_full=(), inter_rope=(), bf16_of=None):
    tr = load_transformer(root, sub)
    out, inputs = {}, {}
    for cname, case in cases.items():
        if "same_inputs_as" in case:
            x, ctx, mask, t, _ = inputs[case["same_inputs_as"]]
            add_t = torch.tensor(case["add_t"], dtype=torch.int64)
        else:
            x, ctx, mask, t, add_t = make_inputs(case, g)
        inputs[cname] = (x, ctx, mask, t, add_t)
        remove = None
        if cname in inter_full or cname in inter_rope:
            remove = capture(tr, cname + ".inter", out, full=cname in inter_full)
        y = run(tr, case, x, ctx, mask, t, add_t)
        if remove:
            remove()
        N = x.shape[1]
        assert y.shape == (case["B"], N, 4 * TRANSFORMER["out_channels"]) and y.dtype == torch.float32
        out[f"{cname}.hidden_states"], out[f"{cname}.encoder_hidden_states"] = x, ctx
        if mask is not None:
            out[f"{cname}.encoder_hidden_states_mask"] = mask
        out[f"{cname}.timestep"] = t
        out[f"{cname}.img_shapes"] = torch.tensor(img_shapes_arg(case), dtype=torch.int64)
        if add_t is not None:
            out[f"{cname}.additional_t_cond"] = add_t
        out[f"{cname}.out"] = y

        # Per-sample equivalences: each sample alone; a padded sample = its truncated text, no mask
        d_alone = d_trunc = 0.0
        for i in range(case["B"]):
            one = dict(case, B=1)
            yi = run(tr, one, x[i:i + 1], ctx[i:i + 1], None if mask is None else mask[i:i + 1],
                     t[i:i + 1], None if add_t is None else add_t[i:i + 1])
            d_alone = max(d_alone, (yi - y[i:i + 1]).abs().max().item())
            if mask is not None:
                n = int(mask[i].sum())
                yt = run(tr, one, x[i:i + 1], ctx[i:i + 1, :n], None, t[i:i + 1],
                         None if add_t is None else add_t[i:i + 1])
                d_trunc = max(d_trunc, (yt - y[i:i + 1]).abs().max().item())
        msg = f"{sub} {cname}: N {N}, max |out| {y.abs().max().item():.3f}; alone vs batched {d_alone:.1e}"
        if mask is not None:
            msg += f", masked vs truncated text {d_trunc:.1e}"
            if bool(mask.all()):
                d_none = (run(tr, case, x, ctx, None, t, add_t) - y).abs().max().item()
                msg += f", all-ones mask vs None {d_none:.1e}"
                assert d_none < 1e-6
        print(msg)
        assert d_alone < 1e-5 and d_trunc < 1e-5

        if cname == bf16_of:  # bf16 model as from_pretrained(torch_dtype=bfloat16) gives it
            trb = load_transformer(root, sub, torch.bfloat16)
            yb = run(trb, case, x, ctx, mask, t, add_t, dtype=torch.bfloat16)
            assert yb.dtype == torch.bfloat16
            out[f"{cname}_bf16.out"] = yb.float()
            print(f"{sub} {cname}_bf16 vs float32: max abs diff {(yb.float() - y).abs().max().item():.3e}")
    return out


def forward_refs(root):
    g = torch.Generator().manual_seed(SEED_INPUTS)
    fwd = forward_set(root, "transformer", FORWARD_CASES, g, inter_full=("b",),
                      inter_rope=("a", "c", "edit"), bf16_of="a")
    check_independent(root, "transformer", FORWARD_CASES, fwd)
    save_st(fwd, os.path.join(root, "forward.safetensors"))

    zc = forward_set(root, "transformer_zero_cond", ZERO_COND_CASES, g, inter_rope=("zc_edit",))
    check_independent(root, "transformer_zero_cond", ZERO_COND_CASES, zc)
    # zero_cond_t changes the output (same weights, same inputs through transformer/)
    base = load_transformer(root, "transformer")
    c = ZERO_COND_CASES["zc_edit"]
    y0 = run(base, c, zc["zc_edit.hidden_states"], zc["zc_edit.encoder_hidden_states"],
             zc["zc_edit.encoder_hidden_states_mask"], zc["zc_edit.timestep"], None)
    print(f"zc_edit through transformer/ (zero_cond_t false): max abs diff "
          f"{(y0 - zc['zc_edit.out']).abs().max().item():.3e}")
    save_st(zc, os.path.join(root, "forward_zero_cond.safetensors"))

    lay = forward_set(root, "transformer_layered", LAYERED_CASES, g, inter_rope=("layered",))
    check_independent(root, "transformer_layered", LAYERED_CASES, lay)
    print(f"layered vs layered_t1: max abs diff {(lay['layered.out'] - lay['layered_t1.out']).abs().max().item():.3e}")
    save_st(lay, os.path.join(root, "forward_layered.safetensors"))


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    root = os.path.join(out, "tiny_qwen_image")
    os.makedirs(root, exist_ok=True)
    build_folder(root)
    forward_refs(root)
    print(f"wrote {root}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_transformer.py OUT_DIR  (writes OUT_DIR/tiny_qwen_image)")
    main(sys.argv[1])
