"""The Python peer of bench_wan_step: the same LoRA training step with Diffusers' own
WanTransformer3DModel and PEFT, the flow-matching step of musubi-tuner's wan_train_network.py /
a Diffusers-style LoRA script, on random inputs: the transformer of configs/wan-2.1-t2v-14b (Wan
2.1 T2V 14B's real width: 40 heads x 128 = 5120, FFN 13824, 4096-wide UMT5 captions; --model
1.3b: configs/wan-2.1-t2v-1.3b, 12 heads x 128) built with from_config, depth reduced
(--num_layers), LoRA (rank r, alpha r, fp32 adapters) on musubi-tuner's default Wan targets (every
Linear of a WanAttentionBlock; in Diffusers' names attn1/attn2 to_q, to_k, to_v, to_out.0,
ffn.net.0.proj, ffn.net.2), latents [B, 16, F, H, W] noised at a uniform sigma s as
(1 - s) x0 + s noise, the model at timestep s * 1000, the output against noise - x0 (MSE),
backward, clip_grad_norm_(1.0), AdamW(1e-4, weight decay 1e-4). Prints one JSON line like the C++
one.

    ../shared/refstack2/run python3 bench/py/diffusers_wan_step.py [--model 14b|1.3b]
        [--frames 5] [--height 16] [--width 28] [--latent N] [--text_tokens 512]
        [--num_layers 1] [--lora_rank 16] [--batch 1] [--mixed_precision no|bf16]
        [--gradient_checkpointing 0|1] [--steps 3] [--warmup 1] [--threads 0]

--frames/--height/--width are latent units (default 5 x 16 x 28: 17 frames of 128 x 224 px, 560
patch tokens); --latent N sets height = width = N. --layers is another name for --num_layers.
With --mixed_precision bf16 the model is cast to bf16 and Diffusers' _keep_in_fp32_modules are
returned to float32, as from_pretrained(torch_dtype=bf16) leaves them.
Runs on refstack2 (Diffusers 0.40 + PEFT on torch 2.6, Debian 13 root; transformers is a stub,
so Diffusers' PEFT flags are set before diffusers.loaders is imported, as the fixture scripts in
tests/golden/z_image do; Diffusers' code is not changed).
"""
import argparse
import json
import os
import resource
import sys
import time

import torch

import diffusers.utils.import_utils as _iu

_iu._transformers_available, _iu._transformers_version = True, "4.57.0"
import diffusers.utils as _du  # noqa: E402
import diffusers.utils.constants as _dc  # noqa: E402

_du.USE_PEFT_BACKEND = _dc.USE_PEFT_BACKEND = True
from diffusers import WanTransformer3DModel  # noqa: E402
from peft import LoraConfig  # noqa: E402

CONFIGS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs")
# musubi-tuner's networks/lora_wan.py: every Linear in a WanAttentionBlock.
TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]


def main():
    a = argparse.ArgumentParser()
    for name, default in [("frames", 5), ("height", None), ("width", None), ("latent", None),
                          ("text_tokens", 512), ("lora_rank", 16), ("batch", 1),
                          ("gradient_checkpointing", 0), ("steps", 3), ("warmup", 1),
                          ("threads", 0)]:
        a.add_argument("--" + name, type=int, default=default)
    a.add_argument("--num_layers", "--layers", dest="num_layers", type=int, default=1)
    a.add_argument("--model", default="14b", choices=["14b", "1.3b"])
    a.add_argument("--mixed_precision", default="no")
    a.add_argument("--profile", default="")  # accepted for flag parity with the C++ bench
    args = a.parse_args()
    F = args.frames
    H = args.height if args.height is not None else (args.latent or 16)
    W = args.width if args.width is not None else (args.latent or 28)
    if F < 1 or H < 2 or W < 2 or H % 2 or W % 2 or args.text_tokens < 1:
        a.error("--frames must be >= 1, --height and --width even, --text_tokens >= 1")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with open(os.path.join(CONFIGS, "wan-2.1-t2v-" + args.model, "transformer",
                           "config.json")) as f:
        config = json.load(f)
    config["num_layers"] = args.num_layers
    m = WanTransformer3DModel.from_config(config)
    m.requires_grad_(False)
    weights = sum(p.numel() for p in m.parameters())
    bf16 = args.mixed_precision == "bf16"
    if bf16:  # per parameter: m.to(bf16) would warn about the _keep_in_fp32_modules
        keep = m._keep_in_fp32_modules or []
        for name, p in m.named_parameters():
            if not any(k in name.split(".") for k in keep):
                p.data = p.data.to(torch.bfloat16)
    if args.gradient_checkpointing:
        m.enable_gradient_checkpointing()
    m.train()
    r = args.lora_rank
    m.add_adapter(LoraConfig(r=r, lora_alpha=r, init_lora_weights="gaussian",
                             target_modules=TARGETS))
    params = [p for p in m.parameters() if p.requires_grad]
    for p in params:
        p.data = p.data.float()
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-4)
    B, C = args.batch, config["in_channels"]
    x0 = torch.randn(B, C, F, H, W)
    caps = torch.randn(B, args.text_tokens, config["text_dim"])
    dtype = torch.bfloat16 if bf16 else torch.float32
    fb, op, total = 0.0, 0.0, 0.0
    loss = None
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        noise = torch.randn_like(x0)
        sigma = torch.rand(B)
        sig = sigma.view(B, 1, 1, 1, 1)
        noisy = ((1.0 - sig) * x0 + sig * noise).to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            pred = m(hidden_states=noisy, timestep=sigma * 1000.0,
                     encoder_hidden_states=caps.to(dtype), return_dict=False)[0]
            loss = torch.nn.functional.mse_loss(pred.float(), noise - x0)
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
        "impl": "diffusers+peft", "torch": torch.__version__, "model": args.model,
        "threads": torch.get_num_threads(), "blocks": args.num_layers,
        "width": config["num_attention_heads"] * config["attention_head_dim"],
        "latent": [F, H, W], "tokens": [F * (H // 2) * (W // 2), args.text_tokens],
        "batch": B, "mixed_precision": args.mixed_precision, "lora_rank": r,
        "weights": weights, "trainable": sum(p.numel() for p in params), "steps": n,
        "ms_per_step": 1e3 * total / n, "ms_forward_backward": 1e3 * fb / n,
        "ms_optimizer": 1e3 * op / n,
        "peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "final_loss": float(loss)}))


if __name__ == "__main__":
    sys.exit(main())
