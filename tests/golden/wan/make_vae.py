#!/usr/bin/env python3
"""Makes tests/golden/wan/tiny_wan/{vae, vae_22}/ (tiny AutoencoderKLWan folders: the Wan 2.1
layout and the Wan 2.2 TI2V-5B 48-channel layout) and tiny_wan/vae_cases.safetensors (+
vae_cases.json): encode (posterior mean / logvar) and decode references of both.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0 at ../shared/refstack2/src):
    OMP_NUM_THREADS=1 ../shared/refstack2/run python3 tests/golden/wan/make_vae.py tests/golden/wan
Re-running writes byte-identical files (float32 on one CPU thread; save_pretrained; safetensors
with sorted keys and the single metadata entry {"format": "pt"}; JSON with sorted keys).

Everything is Diffusers' code run unmodified: each VAE is built from its config, every parameter
overwritten with seeded random values, saved with save_pretrained and loaded back with
from_pretrained before any reference is computed.

Checks (printed; the files do not depend on them): the first latent frame of a video equals the
first frame encoded alone; the first decoded frame equals the first latent frame decoded alone;
7 frames encode like 5 (frames past 1 + 4k are dropped); each batch sample alone equals the batch;
decode(z).sample is within [-1, 1]; tiled vs untiled differences.
"""
import json
import os
import sys

import torch
from safetensors.torch import save_file

import diffusers.utils.import_utils as _iu  # noqa: E402  (see ../qwen_image/make_transformer.py)
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"

import diffusers  # noqa: E402
from diffusers import AutoencoderKLWan  # noqa: E402
from diffusers.models.autoencoders.autoencoder_kl_wan import WanRMS_norm, patchify, unpatchify  # noqa: E402

# Wan 2.1's latents_mean / latents_std (AutoencoderKLWan's defaults = Wan-AI/Wan2.1-*-Diffusers
# vae/config.json), checked against the class signature below.
MEAN_21 = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508, 0.4134, -0.0715,
           0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
STD_21 = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743, 3.2687, 2.1526, 2.8652,
          1.5579, 1.6382, 1.1253, 2.8251, 1.9160]
# Wan 2.2's (Wan-AI/Wan2.2-TI2V-5B-Diffusers vae/config.json; Wan2_2_VAE in the release code)
MEAN_22 = [-0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557, -0.1382, 0.0542,
           0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825, -0.2246, -0.1207, -0.0698, 0.5109,
           0.2665, -0.2108, -0.2158, 0.2502, -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899,
           -0.2799, -0.1230, -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
           0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667]
STD_22 = [0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013, 0.8158, 1.0344, 0.5894,
          1.0901, 0.6885, 0.6165, 0.8454, 0.4978, 0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146,
          0.8986, 0.5659, 0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093, 0.5709,
          0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887, 0.3971, 1.0600, 0.3943, 0.5537,
          0.5444, 0.4089, 0.7468, 0.7744]

# Wan 2.1 (real: base_dim 96, dim_mult [1, 2, 4, 4], num_res_blocks 2)
VAE_21 = dict(
    base_dim=8, decoder_base_dim=None, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
    attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0,
    latents_mean=MEAN_21, latents_std=STD_21, is_residual=False, in_channels=3, out_channels=3,
    patch_size=None, scale_factor_temporal=4, scale_factor_spatial=8,
)
# Wan 2.2 (real: base_dim 160, decoder_base_dim 256, dim_mult [1, 2, 4, 4], num_res_blocks 2);
# decoder_base_dim != base_dim kept (12 vs 8) so that the split matters.
VAE_22 = dict(
    base_dim=8, decoder_base_dim=12, z_dim=48, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
    attn_scales=[], temperal_downsample=[False, True, True], dropout=0.0,
    latents_mean=MEAN_22, latents_std=STD_22, is_residual=True, in_channels=12, out_channels=12,
    patch_size=2, scale_factor_temporal=4, scale_factor_spatial=16,
)
VAES = {"vae": VAE_21, "vae_22": VAE_22}
SEEDS = {"vae": 20270111, "vae_22": 20270112, "inputs": 72}
STD = 0.05
GAMMA_STD = 0.1
# the decoders' last conv larger so that some decoded values leave [-1, 1] and the clamp matters
STD_OVERRIDES = {"decoder.conv_out.weight": 0.05}

# pixel cases: [B, 3, F, H, W]; H, W multiples of 8 (2.1) / 16 (2.2); F = 1 + 4k
CASES = {
    "vae": {"image": (1, 1, 32, 48), "f5": (1, 5, 32, 32), "f9": (1, 9, 16, 32), "batch2": (2, 5, 16, 24)},
    "vae_22": {"image": (1, 1, 32, 48), "f5": (1, 5, 32, 32), "f9": (1, 9, 16, 32), "batch2": (2, 5, 16, 32)},
}
# tiling (enable_tiling arguments, in pixels) and the latent / pixel sizes of the tiled cases
TILING = {
    "vae": dict(tile_sample_min_height=32, tile_sample_min_width=32, tile_sample_stride_height=24,
                tile_sample_stride_width=24),
    "vae_22": dict(tile_sample_min_height=64, tile_sample_min_width=64, tile_sample_stride_height=48,
                   tile_sample_stride_width=48),
}
TILED_Z = {"vae": (1, 16, 2, 5, 7), "vae_22": (1, 48, 1, 5, 6)}
# tiled encode: pixel sizes and enable_tiling arguments. 2.2: tiled_encode walks the PATCHIFIED
# tensor with these pixel-unit sizes (so a 32 tile covers 64 pixels); (64, 48) would give one tile
# covering the whole 80 x 96 input, identical to untiled, hence the smaller arguments.
TILED_X = {
    "vae": ((1, 3, 1, 48, 56), TILING["vae"]),
    "vae_22": ((1, 3, 1, 80, 96), dict(tile_sample_min_height=32, tile_sample_min_width=32,
                                       tile_sample_stride_height=24, tile_sample_stride_width=24)),
}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    gammas = {f"{n}.gamma" for n, m in model.named_modules() if isinstance(m, WanRMS_norm)}
    with torch.no_grad():
        for name, p in model.named_parameters():
            r = torch.randn(p.shape, generator=g, dtype=torch.float32)
            if name in gammas:
                p.copy_(1.0 + GAMMA_STD * r)
            else:
                p.copy_(STD_OVERRIDES.get(name, STD) * r)


def save_st(tensors, path):
    save_file({k: tensors[k].detach().float().clone().contiguous() for k in sorted(tensors)}, path,
              metadata={"format": "pt"})


def maxdiff(a, b):
    return (a - b).abs().max().item()


def main(out):
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    import inspect
    sig = inspect.signature(AutoencoderKLWan.__init__).parameters
    assert list(sig["latents_mean"].default) == MEAN_21 and list(sig["latents_std"].default) == STD_21
    root = os.path.join(out, "tiny_wan")
    os.makedirs(root, exist_ok=True)
    for name, cfg in VAES.items():
        m = AutoencoderKLWan(**cfg)
        randomize(m, SEEDS[name])
        m.save_pretrained(os.path.join(root, name))
        print(f"{name}: {sum(p.numel() for p in m.parameters())} parameters")

    g = torch.Generator().manual_seed(SEEDS["inputs"])
    res, meta = {}, {}
    for vname in VAES:
        vae = AutoencoderKLWan.from_pretrained(os.path.join(root, vname)).eval()
        zc = vae.config.z_dim

        def enc(x):
            with torch.no_grad():
                return vae.encode(x).latent_dist

        def dec(z):
            with torch.no_grad():
                return vae.decode(z).sample

        for cname, (B, Fr, H, W) in CASES[vname].items():
            x = torch.rand((B, 3, Fr, H, W), generator=g) * 2 - 1
            d = enc(x)
            chunks = []  # decoder outputs per latent frame (a hook observes; cat + unpatchify = raw)
            hk = vae.decoder.register_forward_hook(lambda m, a, o: chunks.append(o.detach().clone()))
            s = dec(d.mean)
            hk.remove()
            raw = torch.cat(chunks, 2)
            if vae.config.patch_size is not None:
                raw = unpatchify(raw, vae.config.patch_size)
            assert torch.equal(s, raw.clamp(-1, 1))
            p = f"{vname}.{cname}"
            res[p + ".x"], res[p + ".mean"], res[p + ".logvar"], res[p + ".sample"] = x, d.mean, d.logvar, s
            lm = torch.tensor(vae.config.latents_mean).view(1, zc, 1, 1, 1)
            ls = torch.tensor(vae.config.latents_std).view(1, zc, 1, 1, 1)
            res[p + ".latents_normalised"] = (d.mean - lm) / ls
            if cname == "f5":
                res[p + ".decoded_raw"] = raw
                res[p + ".decoder_chunk_frames"] = torch.tensor([c.shape[2] for c in chunks], dtype=torch.float32)
            if vname == "vae_22" and cname == "image":
                res[p + ".patchified"] = patchify(x, 2)
            lat_f = 1 + (Fr - 1) // 4
            sc = vae.config.scale_factor_spatial
            assert d.mean.shape == (B, zc, lat_f, H // sc, W // sc), d.mean.shape
            assert s.shape == x.shape and s.abs().max() <= 1
            # logvar is clamped to [-30, 20] by DiagonalGaussianDistribution; not reached here
            meta[p] = dict(x=list(x.shape), mean=list(d.mean.shape), sample=list(s.shape),
                           logvar_range=[round(d.logvar.min().item(), 4), round(d.logvar.max().item(), 4)])
            # how often decode's clamp bites (raw decoder output outside [-1, 1])
            frac_clamped = ((s.abs() == 1).float().mean().item())
            print(f"{p}: x {tuple(x.shape)} -> mean {tuple(d.mean.shape)} |mean| <= {d.mean.abs().max().item():.3f} "
                  f"logvar [{d.logvar.min().item():.2f}, {d.logvar.max().item():.2f}]; sample {tuple(s.shape)}, "
                  f"{100 * frac_clamped:.1f}% at +-1")
            if cname == "f5":
                with torch.no_grad():
                    m0 = enc(x[:, :, :1]).mean
                    s0 = dec(d.mean[:, :, :1])
                    extra = torch.rand((B, 3, 2, H, W), generator=torch.Generator().manual_seed(1)) * 2 - 1
                    m7 = enc(torch.cat([x, extra], 2)).mean
                print(f"  first latent frame vs first frame alone {maxdiff(d.mean[:, :, :1], m0):.1e}; first "
                      f"decoded frame vs first latent frame alone {maxdiff(s[:, :, :1], s0):.1e}; 7 frames "
                      f"-> {m7.shape[2]} latent frames, vs 5 frames {maxdiff(m7, d.mean):.1e}")
                assert maxdiff(d.mean[:, :, :1], m0) < 1e-5 and maxdiff(s[:, :, :1], s0) < 1e-5
                assert m7.shape == d.mean.shape and maxdiff(m7, d.mean) < 1e-5
            if cname == "batch2":
                de = max(maxdiff(enc(x[i:i + 1]).mean, d.mean[i:i + 1]) for i in range(B))
                dd = max(maxdiff(dec(d.mean[i:i + 1]), s[i:i + 1]) for i in range(B))
                print(f"  each sample alone vs batched: encode {de:.1e}, decode {dd:.1e}")
                assert de < 1e-4 and dd < 1e-4

        # tiled decode (and tiled encode for 2.1)
        zt = torch.randn(TILED_Z[vname], generator=g)
        untiled = dec(zt)
        vae.enable_tiling(**TILING[vname])
        tiled = dec(zt)
        p = f"{vname}.tiled_decode"
        res[p + ".z"], res[p + ".sample"], res[p + ".sample_untiled"] = zt, tiled, untiled
        meta[p] = dict(z=list(zt.shape), sample=list(tiled.shape), enable_tiling=TILING[vname],
                       tiled_vs_untiled_maxdiff=float(f"{maxdiff(tiled, untiled):.3g}"))
        print(f"{p}: z {tuple(zt.shape)} -> {tuple(tiled.shape)}; tiled vs untiled {maxdiff(tiled, untiled):.3e}")
        if vname in TILED_X:
            xshape, xtiling = TILED_X[vname]
            xt = torch.rand(xshape, generator=g) * 2 - 1
            vae.disable_tiling()
            du = enc(xt)
            vae.enable_tiling(**xtiling)
            dt = enc(xt)
            p = f"{vname}.tiled_encode"
            res[p + ".x"], res[p + ".mean"], res[p + ".logvar"] = xt, dt.mean, dt.logvar
            res[p + ".mean_untiled"] = du.mean
            meta[p] = dict(x=list(xt.shape), mean=list(dt.mean.shape), enable_tiling=xtiling,
                           tiled_vs_untiled_mean_maxdiff=float(f"{maxdiff(dt.mean, du.mean):.3g}"))
            print(f"{p}: x {tuple(xt.shape)} -> {tuple(dt.mean.shape)}; tiled vs untiled {maxdiff(dt.mean, du.mean):.3e}")
        vae.disable_tiling()

    path = os.path.join(root, "vae_cases.safetensors")
    save_st(res, path)
    with open(os.path.join(root, "vae_cases.json"), "w", encoding="utf-8") as fh:
        fh.write(json.dumps({"cases": meta, "configs": VAES, "seeds": SEEDS}, indent=2, sort_keys=True) + "\n")
    print(f"vae_cases.safetensors: {len(res)} tensors, {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.dirname(os.path.abspath(__file__)))
