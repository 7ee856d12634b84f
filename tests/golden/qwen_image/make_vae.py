#!/usr/bin/env python3
"""Makes tests/golden/qwen_image/tiny_qwen_image/vae_cases.safetensors: references of
AutoencoderKLQwenImage.encode / decode (plain, batched, video, tiled) with the tiny VAE that
make_transformer.py saves in tiny_qwen_image/vae/ (run that first; re-making it means re-making
this).

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 at ../shared/refstack2/src):
    ../shared/refstack2/run python3 tests/golden/qwen_image/make_vae.py tests/golden/qwen_image
Re-running writes a byte-identical file (float32 on one CPU thread; safetensors' save_file with
sorted keys and the single metadata entry {"format": "pt"}).

Everything is Diffusers' code run unmodified: AutoencoderKLQwenImage.from_pretrained(vae/), then
vae.encode(x).latent_dist (.mean, .logvar, .std) and vae.decode(z).sample; enable_tiling(...) for
the tiled cases. Forward hooks on vae.encoder / vae.decoder / vae.decoder.mid_block only observe.
Inputs are seeded: images and videos `torch.rand * 2 - 1` (uniform in [-1, 1)), the tiled decode's
latent `torch.randn`.

Tensors (all float32; shapes [B, C, F, H, W]):
  image.x [1, 3, 1, 40, 56]; image.mean / .logvar / .std [1, 16, 1, 5, 7] (the posterior:
    logvar clamped to [-30, 20], std = exp(logvar / 2)); image.latents_normalised
    (mean - latents_mean) * (1 / latents_std) as train_dreambooth_lora_qwen_image.py normalises;
    image.sample [1, 3, 1, 40, 56] = decode(mean) (clamped to [-1, 1]); image.decoder_raw, the
    decoder's output before that clamp; image.inter.enc_out [1, 32, 1, 5, 7] (encoder output,
    before quant_conv), image.inter.dec_mid [1, 8, 1, 5, 7] (decoder mid block output).
  video.x [1, 3, 5, 32, 32]; video.mean / .logvar / .std [1, 16, 2, 4, 4]; video.sample
    [1, 3, 5, 32, 32] = decode(video.mean).
  batch.x [2, 3, 1, 24, 32]; batch.mean / .logvar / .std [2, 16, 1, 3, 4]; batch.sample.
  tiled_decode.z [1, 16, 1, 12, 14]; tiled_decode.sample [1, 3, 1, 96, 112] (NOT clamped: the tiled
    path skips the clamp).
  tiled_encode.x [1, 3, 1, 96, 112]; tiled_encode.mean / .logvar / .std [1, 16, 1, 12, 14];
    tiled_encode.mean_untiled.
  Tiling: vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32,
    tile_sample_stride_height=24, tile_sample_stride_width=24).

Checks (the outputs do not depend on them): each batch sample alone equals the batched result; the
video's first latent frame equals the encoding of its first frame alone and the first decoded
frame equals the decoding of the first latent frame alone (causality); frames after the last full
chunk of 4 are dropped by encode (a 7-frame video encodes like its first 5 frames, a 3-frame one
like its first frame); use_slicing gives the same batch results; decode(z).sample equals
clamp(decoder_raw, -1, 1).
"""
import os
import sys

import torch
from safetensors.torch import save_file

import diffusers.utils.import_utils as _iu  # noqa: E402  (see make_transformer.py)
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"

import diffusers  # noqa: E402
from diffusers import AutoencoderKLQwenImage  # noqa: E402

TILING = dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
              tile_sample_stride_width=24)
SEED = 60


def save_st(tensors, path):
    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)}, path,
              metadata={"format": "pt"})


def maxdiff(a, b):
    return (a - b).abs().max().item()


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    root = os.path.join(out, "tiny_qwen_image")
    vae = AutoencoderKLQwenImage.from_pretrained(os.path.join(root, "vae")).eval()
    assert vae.spatial_compression_ratio == 8 and not vae.use_tiling and not vae.use_slicing
    g = torch.Generator().manual_seed(SEED)
    res = {}

    def enc(name, x):
        with torch.no_grad():
            d = vae.encode(x).latent_dist
        res[f"{name}.x"], res[f"{name}.mean"], res[f"{name}.logvar"], res[f"{name}.std"] = x, d.mean, d.logvar, d.std
        assert torch.equal(d.std, torch.exp(0.5 * d.logvar))
        return d.mean

    def dec(z):
        with torch.no_grad():
            return vae.decode(z).sample

    # image: encode, normalise as the training script does, decode the mean
    x = torch.rand((1, 3, 1, 40, 56), generator=g) * 2 - 1
    store = {}
    hooks = [vae.encoder.register_forward_hook(lambda m, a, o: store.__setitem__("enc_out", o.clone())),
             vae.decoder.register_forward_hook(lambda m, a, o: store.__setitem__("decoder_raw", o.clone())),
             vae.decoder.mid_block.register_forward_hook(lambda m, a, o: store.__setitem__("dec_mid", o.clone()))]
    mean = enc("image", x)
    lm = torch.tensor(vae.config.latents_mean).view(1, vae.config.z_dim, 1, 1, 1)
    ls = 1.0 / torch.tensor(vae.config.latents_std).view(1, vae.config.z_dim, 1, 1, 1)
    res["image.latents_normalised"] = (mean - lm) * ls
    sample = dec(mean)
    for h in hooks:
        h.remove()
    res["image.sample"], res["image.decoder_raw"] = sample, store["decoder_raw"]
    res["image.inter.enc_out"], res["image.inter.dec_mid"] = store["enc_out"], store["dec_mid"]
    assert torch.equal(sample, store["decoder_raw"].clamp(-1, 1))
    clipped = (store["decoder_raw"].abs() > 1).float().mean().item()
    print(f"image: mean {tuple(mean.shape)} |mean| <= {mean.abs().max().item():.3f}, logvar in "
          f"[{res['image.logvar'].min().item():.3f}, {res['image.logvar'].max().item():.3f}]; decoder raw in "
          f"[{store['decoder_raw'].min().item():.3f}, {store['decoder_raw'].max().item():.3f}], {100 * clipped:.1f}% clamped")

    # video: 5 frames -> 2 latent frames (first frame alone, then one chunk of 4) -> 5 frames
    xv = torch.rand((1, 3, 5, 32, 32), generator=g) * 2 - 1
    mv = enc("video", xv)
    sv = dec(mv)
    res["video.sample"] = sv
    assert mv.shape == (1, 16, 2, 4, 4) and sv.shape == (1, 3, 5, 32, 32)
    with torch.no_grad():
        m0 = vae.encode(xv[:, :, :1]).latent_dist.mean
        s0 = dec(mv[:, :, :1])
        extra = torch.rand((1, 3, 2, 32, 32), generator=torch.Generator().manual_seed(1))
        m7 = vae.encode(torch.cat([xv, extra], 2)).latent_dist.mean  # 7 frames
        m3 = vae.encode(xv[:, :, :3]).latent_dist.mean  # 3 frames
    print(f"video: first latent frame vs the first frame encoded alone {maxdiff(mv[:, :, :1], m0):.1e}; "
          f"first decoded frame vs the first latent frame decoded alone {maxdiff(sv[:, :, :1], s0):.1e}; "
          f"7 frames -> {m7.shape[2]} latent frames (= 5 frames: {maxdiff(m7, mv):.1e}), "
          f"3 frames -> {m3.shape[2]} (= 1 frame: {maxdiff(m3, m0):.1e})")
    assert maxdiff(mv[:, :, :1], m0) < 1e-6 and maxdiff(sv[:, :, :1], s0) < 1e-6
    assert m7.shape == mv.shape and maxdiff(m7, mv) < 1e-6 and m3.shape == m0.shape and maxdiff(m3, m0) < 1e-6

    # batch of 2 images
    xb = torch.rand((2, 3, 1, 24, 32), generator=g) * 2 - 1
    mb = enc("batch", xb)
    sb = dec(mb)
    res["batch.sample"] = sb
    with torch.no_grad():
        d_enc = max(maxdiff(vae.encode(xb[i:i + 1]).latent_dist.mean, mb[i:i + 1]) for i in range(2))
        d_dec = max(maxdiff(dec(mb[i:i + 1]), sb[i:i + 1]) for i in range(2))
        vae.enable_slicing()
        d_slice = max(maxdiff(vae.encode(xb).latent_dist.mean, mb), maxdiff(dec(mb), sb))
        vae.disable_slicing()
    # not bit-exact: oneDNN's convolutions round differently for batch 1 and batch 2
    print(f"batch: each sample alone vs batched: encode mean {d_enc:.1e}, decode {d_dec:.1e}; "
          f"use_slicing vs not {d_slice:.1e}")
    assert d_enc < 1e-5 and d_dec < 1e-4 and d_slice < 1e-4

    # tiled decode and encode (plain-path results first, tiling off)
    zt = torch.randn((1, 16, 1, 12, 14), generator=g)
    xt = torch.rand((1, 3, 1, 96, 112), generator=g) * 2 - 1
    res["tiled_decode.z"] = zt
    untiled = dec(zt)
    with torch.no_grad():
        res["tiled_encode.mean_untiled"] = vae.encode(xt).latent_dist.mean
    vae.enable_tiling(**TILING)
    assert (vae.tile_sample_min_height, vae.tile_sample_min_width, vae.tile_sample_stride_height,
            vae.tile_sample_stride_width) == (32, 32, 24, 24)
    st = dec(zt)
    res["tiled_decode.sample"] = st
    enc("tiled_encode", xt)
    vae.disable_tiling()
    assert st.shape == (1, 3, 1, 96, 112) and res["tiled_encode.mean"].shape == (1, 16, 1, 12, 14)
    print(f"tiled decode: range [{st.min().item():.3f}, {st.max().item():.3f}] (no clamp), vs plain "
          f"{maxdiff(st, untiled):.3f}, vs plain after clamping both "
          f"{maxdiff(st.clamp(-1, 1), untiled):.3f}; tiled encode mean vs plain "
          f"{maxdiff(res['tiled_encode.mean'], res['tiled_encode.mean_untiled']):.3f}")

    save_st(res, os.path.join(root, "vae_cases.safetensors"))
    print(f"wrote {os.path.join(root, 'vae_cases.safetensors')}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_vae.py OUT_DIR  (reads and writes OUT_DIR/tiny_qwen_image)")
    main(sys.argv[1])
