"""The Python peer of bench_unet_step: the same training step in Diffusers + Accelerate (+ PEFT
for LoRA), as Diffusers' train_text_to_image.py / train_text_to_image_lora.py /
train_text_to_image_sdxl.py / train_unconditional.py run it per batch, on random inputs. Same
flags, same JSON line, plus "step_flops" (the FLOPs of one step, forward + backward, counted once
outside the timed loop by torch.utils.flop_counter.FlopCounterMode; null where torch < 2.1 lacks
it) and the diffusers / peft versions and files that were used.

    python3 bench/py/diffusers_unet_step.py --config unet_config.json [--batch 8]
        [--resolution 64] [--text_len 77] [--mixed_precision no|bf16|fp16] [--lora_rank 0]
        [--steps 20] [--warmup 5] [--device auto|cpu|cuda] [--gradient_checkpointing 0|1]

Needs torch, diffusers, accelerate (and peft for --lora_rank > 0) importable. DIFFTRAIN_PY_FALLBACK
(folders separated by ":", e.g. a diffusers-v0.31.0/src and a peft-v0.14.0/src) is appended to
sys.path before diffusers is imported: after site-packages, so a machine's installed peft,
accelerate and transformers win and the folders only supply what is missing (diffusers).
"""
import argparse
import json
import os
import resource
import sys
import time

# Appended, not prepended: installed packages win over the carried fallback trees.
for _d in filter(None, os.environ.get("DIFFTRAIN_PY_FALLBACK", "").split(":")):
    if _d not in sys.path:
        sys.path.append(_d)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from diffusers import DDPMScheduler, UNet2DConditionModel, UNet2DModel  # noqa: E402


def count_step_flops(step):
    """FLOPs of one call of step(): forward + backward, as FlopCounterMode counts them (matmuls,
    convolutions, attention; elementwise ops and the optimizer are not counted, the usual
    model-FLOPs convention of MFU), or None where torch has no FlopCounterMode (torch < 2.1)."""
    try:
        from torch.utils.flop_counter import FlopCounterMode
    except ImportError:
        return None
    counter = FlopCounterMode(display=False)
    with counter:
        step()
    return int(counter.get_total_flops())


def package_info(name):
    """(version, file) of an imported package, or (None, None) when it was not imported."""
    m = sys.modules.get(name)
    if m is None:
        return None, None
    return getattr(m, "__version__", None), getattr(m, "__file__", None)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--resolution", type=int, default=64)
    ap.add_argument("--text_len", type=int, default=77)
    ap.add_argument("--mixed_precision", default="no")
    ap.add_argument("--lora_rank", type=int, default=0)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--gradient_checkpointing", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    torch.manual_seed(a.seed)

    accelerator = Accelerator(mixed_precision=a.mixed_precision, cpu=a.device == "cpu")
    device = accelerator.device
    with open(a.config) as f:
        config = json.load(f)
    conditional = config.get("_class_name", "UNet2DConditionModel") == "UNet2DConditionModel"
    unet = (UNet2DConditionModel if conditional else UNet2DModel).from_config(config)
    if a.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    weight_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.mixed_precision, torch.float32)
    if a.lora_rank > 0:
        # train_text_to_image_lora.py: frozen base in the weight dtype, PEFT adapters added.
        from peft import LoraConfig

        unet.requires_grad_(False)
        unet.to(device, dtype=weight_dtype)
        unet.add_adapter(LoraConfig(r=a.lora_rank, lora_alpha=a.lora_rank,
                                    init_lora_weights="gaussian",
                                    target_modules=["to_k", "to_q", "to_v", "to_out.0"]))
        if a.mixed_precision == "fp16":
            for p in unet.parameters():
                if p.requires_grad:
                    p.data = p.data.float()
    params = [p for p in unet.parameters() if p.requires_grad]
    total = sum(p.numel() for p in unet.parameters())
    trainable = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-2)
    unet, optimizer = accelerator.prepare(unet, optimizer)
    scheduler = DDPMScheduler()

    b, r = a.batch, a.resolution
    latents = torch.randn(b, config.get("in_channels", 4), r, r).to(device)
    kwargs = {}
    if conditional:
        dim = config.get("cross_attention_dim", 1280)
        dim = dim[0] if isinstance(dim, list) else dim
        kwargs["encoder_hidden_states"] = torch.randn(b, a.text_len, dim).to(device)
    if config.get("num_class_embeds"):
        kwargs["class_labels"] = torch.randint(config["num_class_embeds"], (b,)).to(device)
    if config.get("addition_embed_type") == "text_time":
        # SDXL's added_cond_kwargs: the pooled text embedding [B, D] and the micro-conditioning
        # time ids [B, 6] (original size, crop top-left, target size in pixels, as
        # train_text_to_image_sdxl.py builds them for uncropped images).
        d = config["projection_class_embeddings_input_dim"] - 6 * config["addition_time_embed_dim"]
        px = 8 * r
        time_ids = torch.tensor([[px, px, 0, 0, px, px]], dtype=torch.float32).repeat(b, 1)
        kwargs["added_cond_kwargs"] = {"text_embeds": torch.randn(b, d).to(device),
                                       "time_ids": time_ids.to(device)}

    def step():
        noise = torch.randn_like(latents)
        t = torch.randint(0, scheduler.config.num_train_timesteps, (b,), device=device).long()
        noisy = scheduler.add_noise(latents, noise, t)
        with accelerator.accumulate(unet):
            pred = unet(noisy, t, **kwargs, return_dict=False)[0]
            loss = F.mse_loss(pred.float(), noise.float(), reduction="mean")
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(params, 1.0)
            optimizer.step()
            optimizer.zero_grad()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for _ in range(a.warmup):
        step()
    sync()
    step_flops = count_step_flops(step)  # once, outside the timed loop
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(a.steps):
        loss = step()
    sync()
    seconds = time.perf_counter() - start
    out = {"impl": "diffusers", "config": a.config, "device": str(device), "batch": b,
           "resolution": r, "mixed_precision": a.mixed_precision, "lora_rank": a.lora_rank,
           "gradient_checkpointing": bool(a.gradient_checkpointing), "params": total,
           "trainable": trainable, "steps": a.steps, "samples_per_s": a.steps * b / seconds,
           "ms_per_step": 1000 * seconds / a.steps}
    if device.type == "cuda":
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
        out["peak_mem_kind"] = "max_memory_allocated"
        out["device_name"] = torch.cuda.get_device_name(device)
    else:
        out["peak_mem_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
        out["peak_mem_kind"] = "peak RSS"
    out["final_loss"] = loss.item()
    out["step_flops"] = step_flops
    out["torch"] = torch.__version__
    out["diffusers"], out["diffusers_file"] = package_info("diffusers")
    out["peft"], out["peft_file"] = package_info("peft")
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
