#!/usr/bin/python3
"""The Python peer of `difftrain train`'s built-in default, for bench/vs_peer.sh (issue 22).

The same training step as ../shared/refstack/accel_train_min.py (DDPM epsilon objective, AdamW,
Diffusers' cosine schedule with warm-up, accelerator.accumulate / backward / clip_grad_norm_,
timing after `--timing_skip` optimizer steps, the same RESULT json fields), but for difftrain's
built-in Fashion-MNIST model: a class-conditional UNet2DModel (num_class_embeds=10, the labels
passed to the model as class_labels) on Fashion-MNIST read from its IDX files with numpy.
Images are placed like difftrain's MnistDataset does at resolution 32: the 28x28 image in the
middle of a 32x32 canvas of background, scaled to [-1, 1] (pixel / 127.5 - 1). No random flip,
no class dropout (difftrain's defaults). No EMA: the bench compares the training step only.

Run it under Accelerate's launcher with the refstack environment (bench/vs_peer.sh does this):
  . ../shared/refstack/env.sh
  OMP_NUM_THREADS=2 accelerate launch --cpu --num_processes 1 --num_machines 1 \
      --mixed_precision no --dynamo_backend no bench/py/peer_train_default.py --max_steps 20
  OMP_NUM_THREADS=1 accelerate launch --multi_gpu --num_processes 2 --num_machines 1 \
      --mixed_precision no --dynamo_backend no --tee 1 --log_dir /tmp/pylogs \
      bench/py/peer_train_default.py --max_steps 20 --result_json /tmp/py.json
"""
import argparse
import gzip
import json
import os
import struct
import time

import numpy as np
import torch
import torch.nn.functional as F

import accelerate
import diffusers
from accelerate import Accelerator
from accelerate.utils import set_seed
from diffusers import DDPMScheduler, UNet2DModel
from diffusers.optimization import get_scheduler


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data_dir", default="/usr/share/datasets/fashion-mnist",
                   help="folder with train-images-idx3-ubyte(.gz) and train-labels-idx1-ubyte(.gz)")
    p.add_argument("--resolution", type=int, default=32, help=">= 28: pad the 28x28 images")
    # difftrain train's defaults (see `difftrain train --help`)
    p.add_argument("--train_batch_size", type=int, default=16, help="per process")
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--max_steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--lr_scheduler", default="cosine")
    p.add_argument("--lr_warmup_steps", type=int, default=100)
    p.add_argument("--adam_beta1", type=float, default=0.95)
    p.add_argument("--adam_beta2", type=float, default=0.999)
    p.add_argument("--adam_weight_decay", type=float, default=1e-6)
    p.add_argument("--adam_epsilon", type=float, default=1e-8)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--ddpm_num_steps", type=int, default=1000)
    p.add_argument("--ddpm_beta_schedule", default="linear")
    p.add_argument("--mixed_precision", default=None, choices=["no", "bf16", "fp16"],
                   help="default: what `accelerate launch --mixed_precision` says, else no")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timing_skip", type=int, default=2, help="optimizer steps excluded from timing")
    p.add_argument("--result_json", default=None)
    return p.parse_args()


def read_idx_ubyte(path):
    """IDX file of unsigned bytes (gzip or raw) -> numpy uint8 array of the header's shape."""
    with open(path, "rb") as f:
        data = f.read()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    zero, dtype, ndim = struct.unpack(">HBB", data[:4])
    if zero != 0 or dtype != 0x08:
        raise ValueError(f"{path}: not an IDX file of unsigned bytes (magic {data[:4].hex()})")
    dims = struct.unpack(f">{ndim}I", data[4:4 + 4 * ndim])
    count = int(np.prod(dims))
    payload = np.frombuffer(data, dtype=np.uint8, count=count, offset=4 + 4 * ndim)
    return payload.reshape(dims)


def find_idx(folder, stem):
    for name in (stem + ".gz", stem):  # like difftrain: the .gz file wins when both exist
        path = os.path.join(folder, name)
        if os.path.exists(path):
            return path
    raise FileNotFoundError(f"no {stem}(.gz) in {folder}")


class FashionMnist(torch.utils.data.Dataset):
    """Train split; item i -> (image [1, R, R] float in [-1, 1], label int64)."""

    def __init__(self, folder, resolution):
        images = read_idx_ubyte(find_idx(folder, "train-images-idx3-ubyte"))  # [N, 28, 28]
        labels = read_idx_ubyte(find_idx(folder, "train-labels-idx1-ubyte"))  # [N]
        assert images.shape[0] == labels.shape[0], (images.shape, labels.shape)
        n, h, w = images.shape
        if resolution < max(h, w):
            raise ValueError(f"resolution {resolution} < {h}: this peer only pads, as difftrain does for R >= 28")
        # Centre on an R x R canvas of background (pixel 0 = -1 after scaling); with an odd margin
        # the extra row/column goes to the bottom/right, as in difftrain's MnistDataset.
        top, left = (resolution - h) // 2, (resolution - w) // 2
        canvas = np.zeros((n, 1, resolution, resolution), dtype=np.uint8)
        canvas[:, 0, top:top + h, left:left + w] = images
        self.images = torch.from_numpy(canvas)
        self.labels = torch.from_numpy(labels.astype(np.int64))

    def __len__(self):
        return self.images.shape[0]

    def __getitem__(self, i):
        return self.images[i].float() / 127.5 - 1.0, self.labels[i]


def build_model(resolution):
    # difftrain's built-in default UNet2DModel (docs/TRAINING.md, "The built-in default")
    return UNet2DModel(sample_size=resolution, in_channels=1, out_channels=1, layers_per_block=1,
                       block_out_channels=(32, 64, 64),
                       down_block_types=("DownBlock2D", "DownBlock2D", "AttnDownBlock2D"),
                       up_block_types=("AttnUpBlock2D", "UpBlock2D", "UpBlock2D"),
                       norm_num_groups=8, attention_head_dim=32, num_class_embeds=10)


def main():
    args = parse_args()
    accelerator = Accelerator(mixed_precision=args.mixed_precision,
                              gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)  # same seed on every rank: identical initial weights
    st = accelerator.state
    if accelerator.is_main_process:
        print(f"torch {torch.__version__} accelerate {accelerate.__version__} diffusers {diffusers.__version__}; "
              f"distributed_type={st.distributed_type} backend={st.backend} num_processes={st.num_processes} "
              f"mixed_precision={accelerator.mixed_precision} device={accelerator.device} "
              f"torch_threads={torch.get_num_threads()} OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}",
              flush=True)

    model = build_model(args.resolution)
    n_params = sum(p.numel() for p in model.parameters())
    noise_scheduler = DDPMScheduler(num_train_timesteps=args.ddpm_num_steps, beta_schedule=args.ddpm_beta_schedule)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate,
                                  betas=(args.adam_beta1, args.adam_beta2),
                                  weight_decay=args.adam_weight_decay, eps=args.adam_epsilon)
    dataset = FashionMnist(args.data_dir, args.resolution)
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.train_batch_size, shuffle=True,
                                         drop_last=True, num_workers=0)
    # As in accel_train_min.py / train_unconditional.py: lengths in scheduler ticks; the prepared
    # scheduler advances num_processes ticks per optimizer step.
    lr_scheduler = get_scheduler(args.lr_scheduler, optimizer=optimizer,
                                 num_warmup_steps=args.lr_warmup_steps * accelerator.num_processes,
                                 num_training_steps=args.max_steps * accelerator.num_processes)
    model, optimizer, loader, lr_scheduler = accelerator.prepare(model, optimizer, loader, lr_scheduler)
    if accelerator.is_main_process:
        print(f"model=default params={n_params} images={len(dataset)} per-process batch="
              f"{args.train_batch_size} accum={args.gradient_accumulation_steps} global batch/opt-step="
              f"{args.train_batch_size * args.gradient_accumulation_steps * accelerator.num_processes} "
              f"micro-batches/epoch/process={len(loader)}", flush=True)

    step, t_start, losses, avg = 0, None, [], float("nan")
    model.train()
    while step < args.max_steps:
        for clean, labels in loader:
            # clean: [B, 1, R, R], labels: [B]
            noise = torch.randn_like(clean)
            bsz = clean.shape[0]
            timesteps = torch.randint(0, noise_scheduler.config.num_train_timesteps, (bsz,),
                                      device=clean.device).long()
            noisy = noise_scheduler.add_noise(clean, noise, timesteps)
            with accelerator.accumulate(model):
                pred = model(noisy, timesteps, class_labels=labels).sample
                loss = F.mse_loss(pred.float(), noise.float())  # epsilon prediction
                accelerator.backward(loss)
                gnorm = None
                if accelerator.sync_gradients:
                    gnorm = accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad()
            losses.append(loss.detach())
            if accelerator.sync_gradients:
                step += 1
                avg = accelerator.gather(torch.stack(losses).mean().reshape(1)).mean().item()
                losses = []
                if step == args.timing_skip:
                    accelerator.wait_for_everyone()
                    t_start = time.perf_counter()
                if accelerator.is_main_process:
                    print(f"step {step:3d} loss {avg:.5f} lr {lr_scheduler.get_last_lr()[0]:.3e} "
                          f"grad_norm {float(gnorm):.4f}", flush=True)
                if step >= args.max_steps:
                    break
    accelerator.wait_for_everyone()
    if t_start is None:
        raise SystemExit(f"--max_steps {args.max_steps} must exceed --timing_skip {args.timing_skip}")
    elapsed = time.perf_counter() - t_start
    with torch.no_grad():  # DDP check: every rank must hold identical weights after training
        csum = torch.stack([p.double().sum() for p in accelerator.unwrap_model(model).parameters()]).sum().reshape(1)
    all_csum = accelerator.gather(csum)
    timed = args.max_steps - args.timing_skip
    res = {
        "num_processes": accelerator.num_processes, "mixed_precision": accelerator.mixed_precision,
        "model": "default", "params": n_params, "grad_accum": args.gradient_accumulation_steps,
        "per_process_batch": args.train_batch_size, "timed_steps": timed, "seconds": round(elapsed, 3),
        "opt_steps_per_s": round(timed / elapsed, 3),
        "samples_per_s": round(timed * args.train_batch_size * args.gradient_accumulation_steps
                               * accelerator.num_processes / elapsed, 2),
        "final_loss": round(avg, 5), "torch_threads": torch.get_num_threads(),
        "param_checksum_per_rank": [round(v, 10) for v in all_csum.tolist()],
        "ranks_identical": bool((all_csum == all_csum[0]).all()),
    }
    if accelerator.is_main_process:
        print("RESULT " + json.dumps(res), flush=True)
        if args.result_json:
            with open(args.result_json, "w") as f:
                json.dump(res, f)
    accelerator.end_training()


if __name__ == "__main__":
    main()
