#!/usr/bin/env bash
# Z-Image (ZImageTransformer2DModel; configs/z-image-turbo): difftrain's LoRA step against Diffusers + PEFT, side by side (bench/dit_vs_diffusers.sh).
#   bash bench/z_image_vs_diffusers.sh [--rounds 2] [--threads 2] [-- extra flags for both]
#   e.g. bash bench/z_image_vs_diffusers.sh --rounds 2 --threads 2 -- --latent 64 --text_tokens 128 --steps 2 --warmup 1
exec bash "$(dirname "${BASH_SOURCE[0]}")/dit_vs_diffusers.sh" z_image "$@"
