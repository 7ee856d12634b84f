"""The Python peer of bench_flux_step: the same FLUX.1 training step with Diffusers' own
FluxTransformer2DModel (and PEFT for LoRA), as train_dreambooth_lora_flux.py / train_dreambooth_flux.py
run it per batch under Accelerate, on random inputs: FLUX.1's real width (24 heads x 128, T5 4096,
CLIP 768, guidance embedding), depth reduced (--num_layers double + --num_single_layers single
blocks); the noisy input (1 - s) x0 + s noise at a random sigma, the model at t = sigma, MSE of
the output to noise - x0 in float32, backward, clip_grad_norm_(1.0), AdamW(1e-4, weight decay
1e-2), zero_grad(set_to_none=True).

  --mode lora: the base frozen in bf16 (the LoRA script's weight_dtype), PEFT LoRA (rank r,
    alpha r, gaussian init) on the script's 12 default targets, adapters in float32
    (cast_training_params), forward under autocast(bf16) as Accelerate's prepare() wraps it.
    --base_weights_dtype int8: the frozen Linears' weights stored as int8 with one float scale per
    output row and dequantized to bf16 in each forward (weight-only int8 as optimum-quanto runs it
    on a CPU without int8 kernels; neither quanto, torchao nor bitsandbytes is in refstack2, so
    this script holds that Linear: 20 lines of plain torch).
  --mode full: every weight trains in float32 (the master weights), forward under autocast(bf16).

Memory, the same measures as bench_flux_step's: the resident set before the timed steps and its
peak during them (VmHWM reset after the warm-up through /proc/self/clear_refs), and with
bench/alloc_peak.c LD_PRELOADed the bytes malloc has handed out before the timed steps and their
peak during them (heap_before_steps_gib, peak_heap_gib).

    ../shared/refstack2/run python3 bench/py/diffusers_flux_step.py [--mode lora|full]
        [--base_weights_dtype none|int8] [--lora_rank 16] [--image_tokens 1024]
        [--text_tokens 128] [--num_layers 1] [--num_single_layers 2] [--heads 24] [--batch 1]
        [--gradient_checkpointing 0|1] [--steps 3] [--warmup 1] [--threads 0] [--device cpu]
        [--sdpa default|math] [--profile FILE]

Runs on refstack2 (Diffusers 0.40 + PEFT on torch 2.6) and on the GPU machine's PyTorch with
the Diffusers 0.31 / PEFT 0.14 trees scripts/gpu_build fetch carries (DIFFTRAIN_PY_FALLBACK, as
diffusers_unet_step.py: the peer of bench/gpu_train.sh's FLUX.1 comparison); Diffusers' code is not
changed.
"""
import argparse
import ctypes
import contextlib
import json
import resource
import statistics
import time

import torch
import torch.nn.functional as F


class Int8Linear(torch.nn.Linear):
    """A frozen nn.Linear whose weight is int8 with a float32 scale per output row (absmax / 127),
    dequantized to the compute dtype in each forward. PEFT wraps it as it wraps an nn.Linear."""

    @staticmethod
    def replace(linear):
        w = linear.weight.detach().float()
        scale = (w.abs().amax(1, keepdim=True) / 127).clamp_min(1e-12)
        q = torch.nn.Linear.__new__(Int8Linear)
        torch.nn.Module.__init__(q)
        q.in_features, q.out_features = linear.in_features, linear.out_features
        q.register_buffer("qweight", torch.round(w / scale).clamp(-127, 127).to(torch.int8))
        q.register_buffer("scale", scale)
        q.compute_dtype = linear.weight.dtype
        q.bias = linear.bias
        return q

    @property
    def weight(self):  # what PEFT reads for the device; never used to compute
        return self.qweight

    def forward(self, x):
        w = self.qweight.to(self.compute_dtype) * self.scale.to(self.compute_dtype)
        return F.linear(x, w, self.bias)


def quantize_linears(module):
    for name, child in list(module.named_children()):
        if type(child) is torch.nn.Linear:
            setattr(module, name, Int8Linear.replace(child))
        else:
            quantize_linears(child)


def heap_counter():
    """bench/alloc_peak.c's functions when it is LD_PRELOADed, else None."""
    lib = ctypes.CDLL(None)
    try:
        fns = lib.alloc_peak_reset, lib.alloc_peak_bytes, lib.alloc_live_bytes
    except AttributeError:
        return None
    fns[1].restype = fns[2].restype = ctypes.c_longlong
    return fns


def vm(key):  # GiB, from /proc/self/status
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) / 2**20
    return 0.0


def main():
    a = argparse.ArgumentParser()
    for name, default in [("image_tokens", 1024), ("text_tokens", 128), ("num_layers", 1),
                          ("heads", 24),
                          ("num_single_layers", 2), ("lora_rank", 16), ("batch", 1),
                          ("gradient_checkpointing", 0), ("steps", 3), ("warmup", 1),
                          ("threads", 0)]:
        a.add_argument("--" + name, type=int, default=default)
    a.add_argument("--mode", default="lora", choices=["lora", "full"])
    a.add_argument("--base_weights_dtype", default="none", choices=["none", "int8"])
    a.add_argument("--mixed_precision", default="bf16", choices=["bf16"])
    a.add_argument("--device", default="cpu")
    a.add_argument("--sdpa", default="default", choices=["default", "math"],
                   help="math: torch's SDPA on its reference (math) backend instead of the fused "
                        "kernel it picks (torch.nn.attention.sdpa_kernel)")
    a.add_argument("--profile", default="",
                   help="write the operator table of the timed steps (self CPU time) to this file")
    args = a.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    torch.manual_seed(0)
    from diffusers import FluxTransformer2DModel
    m = FluxTransformer2DModel(
        patch_size=1, in_channels=64, num_layers=args.num_layers,
        num_single_layers=args.num_single_layers, attention_head_dim=128, num_attention_heads=args.heads,
        joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
        axes_dims_rope=(16, 56, 56))
    if args.gradient_checkpointing:
        m.enable_gradient_checkpointing()
    m.train()
    if args.mode == "lora":
        from peft import LoraConfig
        m.requires_grad_(False)
        m.to(torch.bfloat16)
        if args.base_weights_dtype == "int8":
            quantize_linears(m)
        m.to(dev)
        targets = ["attn.to_k", "attn.to_q", "attn.to_v", "attn.to_out.0", "attn.add_k_proj",
                   "attn.add_q_proj", "attn.add_v_proj", "attn.to_add_out", "ff.net.0.proj",
                   "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
        m.add_adapter(LoraConfig(r=args.lora_rank, lora_alpha=args.lora_rank,
                                 init_lora_weights="gaussian", target_modules=targets))
        params = [p for p in m.parameters() if p.requires_grad]
        for p in params:
            p.data = p.data.float()
    else:
        if args.base_weights_dtype != "none":
            raise SystemExit("diffusers_flux_step: --base_weights_dtype is for --mode lora")
        m.to(dev)
        params = list(m.parameters())
    opt = torch.optim.AdamW(params, lr=1e-4, weight_decay=1e-2)
    it, tt, b = args.image_tokens, args.text_tokens, args.batch
    side = int(round(it ** 0.5))
    idx = torch.arange(it, device=dev).float()
    img_ids = torch.stack([torch.zeros_like(idx), torch.div(idx, side, rounding_mode="floor"),
                           torch.remainder(idx, side)], 1)
    txt_ids = torch.zeros(tt, 3, device=dev)
    x0 = torch.randn(b, it, 64, device=dev)
    text = torch.randn(b, tt, 4096, device=dev)
    pooled = torch.randn(b, 768, device=dev)
    g = torch.full((b,), 3.5, device=dev)

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def sdpa():
        if args.sdpa == "default":
            return contextlib.nullcontext()
        from torch.nn.attention import SDPBackend, sdpa_kernel
        return sdpa_kernel(SDPBackend.MATH)

    # For the whole run, backward included: gradient checkpointing recomputes the forward there,
    # and must take the same attention kernel as the forward did.
    kernel = contextlib.ExitStack()  # held until main() returns
    kernel.enter_context(sdpa())
    prof = None
    times, fb, op = [], [], []
    rss_before = heap_before = 0.0
    heap = None if cuda else heap_counter()
    loss = None
    for s in range(args.warmup + args.steps):
        if s == args.warmup:
            sync()
            if cuda:
                torch.cuda.reset_peak_memory_stats(dev)
            else:
                with open("/proc/self/clear_refs", "w") as f:
                    f.write("5")
            rss_before = vm("VmRSS")
            if heap is not None:
                heap[0]()
                heap_before = heap[2]() / 2**30
            if args.profile:
                prof = torch.autograd.profiler.profile()
                prof.__enter__()
        heap_step_start = heap[2]() if heap is not None else 0
        t0 = time.perf_counter()
        sigma = torch.rand(b, device=dev)
        noise = torch.randn_like(x0)
        sv = sigma.view(b, 1, 1)
        noisy = (1 - sv) * x0 + sv * noise
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            pred = m(hidden_states=noisy, encoder_hidden_states=text, pooled_projections=pooled,
                     timestep=sigma, guidance=g, img_ids=img_ids, txt_ids=txt_ids,
                     return_dict=False)[0]
        loss = F.mse_loss(pred.float(), noise - x0)
        forward_keeps = (heap[2]() - heap_step_start) / 2**30 if heap is not None else 0
        loss.backward()
        sync()
        t1 = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        t2 = time.perf_counter()
        if s >= args.warmup:
            times.append(t2 - t0)
            fb.append(t1 - t0)
            op.append(t2 - t1)
    if prof is not None:
        prof.__exit__(None, None, None)
        with open(args.profile, "w") as f:
            f.write(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=40))
    out = {"impl": "diffusers+peft", "torch": torch.__version__, "mode": args.mode,
           "base_weights_dtype": args.base_weights_dtype, "sdpa": args.sdpa, "device": str(dev),
           "threads": torch.get_num_threads(), "tokens": [it, tt],
           "blocks": [args.num_layers, args.num_single_layers],
           "gradient_checkpointing": args.gradient_checkpointing,
           "trainable": sum(p.numel() for p in params), "steps": args.steps,
           "ms_per_step": 1e3 * statistics.median(times),
           "ms_forward_backward": 1e3 * statistics.median(fb),
           "ms_optimizer": 1e3 * statistics.median(op), "final_loss": loss.item()}
    if cuda:
        out["peak_mem_gib"] = torch.cuda.max_memory_allocated(dev) / 2**30
        out["peak_mem_kind"] = "max_memory_allocated"
    else:
        out["rss_before_steps_gib"] = rss_before
        out["peak_mem_gib"] = vm("VmHWM")
        out["peak_mem_kind"] = "peak RSS during the timed steps"
        if heap is not None:
            out["heap_before_steps_gib"] = heap_before
            out["peak_heap_gib"] = heap[1]() / 2**30
            out["forward_keeps_gib"] = forward_keeps
        out["lifetime_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    print(json.dumps(out))


if __name__ == "__main__":
    main()
