"""The Python peer of bench_qwen_image_step: the same LoRA training step with Diffusers' own
QwenImageTransformer2DModel and PEFT, as train_dreambooth_lora_qwen_image.py runs it per batch, on
random inputs: the transformer of configs/qwen-image (Qwen-Image's real width: 24 heads x 128 =
3072, 3584-wide Qwen2.5-VL captions, axes_dims_rope 16/56/56) built with from_config, depth
reduced (--num_layers), LoRA (rank r, alpha r, the script's default targets to_k/to_q/to_v/to_out.0,
fp32 adapters), latents [B, 16, 1, H, W] noised at a random sigma, packed with
QwenImagePipeline._pack_latents and img_shapes (1, H/2, W/2), the model at timestep sigma (the
script's timesteps / 1000) with the caption mask, the output unpacked (_unpack_latents) against
noise - x0 (MSE), backward, clip_grad_norm_(1.0), AdamW(1e-4, weight decay 1e-4). Prints one JSON
line like the C++ one.

    ../shared/refstack2/run python3 bench/py/diffusers_qwen_image_step.py [--latent 64]
        [--text_tokens 128] [--text_padding 0] [--num_layers 1] [--lora_rank 16] [--batch 1]
        [--mixed_precision no|bf16] [--gradient_checkpointing 0|1] [--steps 3] [--warmup 1]
        [--threads 0]

--layers is another name for --num_layers; --text_padding N marks the last N caption tokens as
padding (0: every token real, what the script's one-caption batch gives).
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
from diffusers import QwenImageTransformer2DModel  # noqa: E402
# Its module directly: the top-level name is a dummy without the real transformers.
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline  # noqa: E402
from peft import LoraConfig  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "configs",
                      "qwen-image", "transformer", "config.json")


def main():
    a = argparse.ArgumentParser()
    for name, default in [("latent", 64), ("text_tokens", 128), ("text_padding", 0),
                          ("lora_rank", 16), ("batch", 1), ("gradient_checkpointing", 0),
                          ("steps", 3), ("warmup", 1), ("threads", 0)]:
        a.add_argument("--" + name, type=int, default=default)
    a.add_argument("--num_layers", "--layers", dest="num_layers", type=int, default=1)
    a.add_argument("--mixed_precision", default="no")
    args = a.parse_args()
    if args.latent % 2 or not 0 <= args.text_padding < args.text_tokens:
        a.error("--latent must be even and --text_padding in [0, --text_tokens)")
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    with open(CONFIG) as f:
        config = json.load(f)
    config["num_layers"] = args.num_layers
    m = QwenImageTransformer2DModel.from_config(config)
    m.requires_grad_(False)
    weights = sum(p.numel() for p in m.parameters())
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
    B, H, C = args.batch, args.latent, config["in_channels"] // 4
    vae_scale_factor = 8  # only to undo _unpack_latents' pixel sizes
    x0 = torch.randn(B, C, 1, H, H)
    caps = torch.randn(B, args.text_tokens, config["joint_attention_dim"])
    mask = torch.ones(B, args.text_tokens, dtype=torch.long)
    if args.text_padding:
        mask[:, args.text_tokens - args.text_padding:] = 0
    img_shapes = [(1, H // 2, H // 2)] * B
    dtype = torch.bfloat16 if bf16 else torch.float32
    fb, op, total = 0.0, 0.0, 0.0
    loss = None
    for s in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        noise = torch.randn_like(x0)
        sigma = torch.rand(B)
        sig = sigma.view(B, 1, 1, 1, 1)
        noisy = ((1.0 - sig) * x0 + sig * noise).to(dtype).permute(0, 2, 1, 3, 4)
        packed = QwenImagePipeline._pack_latents(noisy, B, C, H, H)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            pred = m(hidden_states=packed, encoder_hidden_states=caps.to(dtype),
                     encoder_hidden_states_mask=mask, timestep=sigma, img_shapes=img_shapes,
                     return_dict=False)[0]
            pred = QwenImagePipeline._unpack_latents(pred, H * vae_scale_factor,
                                                     H * vae_scale_factor, vae_scale_factor)
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
        "impl": "diffusers+peft", "torch": torch.__version__, "threads": torch.get_num_threads(),
        "blocks": args.num_layers, "width": config["num_attention_heads"] * config[
            "attention_head_dim"],
        "tokens": [(H // 2) ** 2, args.text_tokens], "text_padding": args.text_padding,
        "batch": B, "mixed_precision": args.mixed_precision, "lora_rank": r,
        "weights": weights, "trainable": sum(p.numel() for p in params), "steps": n,
        "ms_per_step": 1e3 * total / n, "ms_forward_backward": 1e3 * fb / n,
        "ms_optimizer": 1e3 * op / n,
        "peak_mem_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "final_loss": float(loss)}))


if __name__ == "__main__":
    sys.exit(main())
