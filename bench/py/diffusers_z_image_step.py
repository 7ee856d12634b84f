"""The Python peer of bench_z_image_step: the same LoRA training step with Diffusers' own
ZImageTransformer2DModel and PEFT, as train_dreambooth_lora_z_image.py runs it per batch, on
random inputs: Z-Image's real width (dim 3840, 30 heads, 2560-wide captions, axes_dims 32/48/48),
depth reduced (--num_layers, --num_refiner_layers), LoRA (rank r, alpha r, the script's targets
to_k/to_q/to_v/to_out.0, fp32 adapters), the noisy input at a random sigma, the model on lists
with t = 1 - sigma, the negated output against noise - x0 (MSE), backward,
clip_grad_norm_(1.0), AdamW(1e-4, weight decay 1e-4). Prints one JSON line like the C++ one.

    ../shared/refstack2/run python3 bench/py/diffusers_z_image_step.py [--latent 64]
        [--text_tokens 128] [--num_layers 1] [--num_refiner_layers 1] [--lora_rank 16]
        [--batch 1] [--mixed_precision no|bf16] [--gradient_checkpointing 0|1]
        [--steps 3] [--warmup 1] [--threads 0]

Runs on refstack2 (Diffusers 0.40 + PEFT on torch 2.6, Debian 13 root; transformers is a stub,
so Diffusers' PEFT flags are set before diffusers.loaders is imported, as the fixture scripts in
tests/golden/z_image do; Diffusers' code is not changed).
"""
import argparse
import json
import resource
import sys
import time

import torch

import diffusers.utils.import_utils as _iu

_iu._transformers_available, _iu._transformers_version = True, "4.57.0"
import diffusers.utils as _du  # noqa: E402
import diffusers.utils.constants as _dc  # noqa: E402

_du.USE_PEFT_BACKEND = _dc.USE_PEFT_BACKEND = True
from diffusers import ZImageTransformer2DModel  # noqa: E402
from peft import LoraConfig  # noqa: E402


def main():
    a = argparse.ArgumentParser()
    for name, default in [("latent", 64), ("text_tokens", 128), ("num_layers", 1),
                          ("num_refiner_layers", 1), ("lora_rank", 16), ("batch", 1),
                          ("gradient_checkpointing", 0), ("steps", 3), ("warmup", 1),
                          ("threads", 0)]:
        a.add_argument("--" + name, type=int, default=default)
    a.add_argument("--mixed_precision", default="no")
    args = a.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    m = ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=3840,
        n_layers=args.num_layers, n_refiner_layers=args.num_refiner_layers, n_heads=30,
        n_kv_heads=30, norm_eps=1e-5, qk_norm=True, cap_feat_dim=2560, rope_theta=256.0,
        t_scale=1000.0, axes_dims=[32, 48, 48], axes_lens=[1024, 512, 512])
    m.requires_grad_(False)
    bf16 = args.mixed_precision == "bf16"
    if bf16:
        m.to(torch.bfloat16)
    if args.gradient_checkpointing:
        m.enable_gradient_checkpointing()
    m.train()
    r = args.lora_rank
    m.add_adapter(LoraConfig(r=r, lora_alpha=r, init_lora_weights="gaussian",
                             target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)
    B = args.batch
    x0 = [torch.randn(16, 1, args.latent, args.latent) for _ in range(B)]
    caps = [torch.randn(args.text_tokens, 2560) for _ in range(B)]
    dtype = torch.bfloat16 if bf16 else torch.float32
    fb, op, total = 0.0, 0.0, 0.0
    loss = None
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        sigma = torch.rand(B)
        noise = [torch.randn_like(x) for x in x0]
        noisy = [((1 - sigma[b]) * x0[b] + sigma[b] * noise[b]).to(dtype) for b in range(B)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            out = m(noisy, 1 - sigma, [c.to(dtype) for c in caps], return_dict=False)[0]
            pred = -torch.stack(out).float()
            loss = torch.nn.functional.mse_loss(pred, torch.stack(noise) - torch.stack(x0))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t2 = time.perf_counter()
        if s >= args.warmup:
            fb += t1 - t0
            op += t2 - t1
            total += t2 - t0
    n = args.steps
    print(json.dumps({
        "impl": "diffusers+peft", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "blocks": [args.num_layers, args.num_refiner_layers], "width": 3840,
        "tokens": [(args.latent // 2) ** 2, args.text_tokens], "batch": B,
        "mixed_precision": args.mixed_precision, "lora_rank": r,
        "trainable": sum(p.numel() for p in params), "steps": n,
        "ms_per_step": 1e3 * total / n, "ms_forward_backward": 1e3 * fb / n,
        "ms_optimizer": 1e3 * op / n,
        "peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "final_loss": float(loss)}))


if __name__ == "__main__":
    sys.exit(main())
