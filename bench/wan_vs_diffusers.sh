#!/usr/bin/env bash
# Wan 2.1 (WanTransformer3DModel; configs/wan-2.1-t2v-14b, --model 1.3b for the small one): difftrain's LoRA step against Diffusers + PEFT, side by side (bench/dit_vs_diffusers.sh).
#   bash bench/wan_vs_diffusers.sh [--rounds 2] [--threads 2] [-- extra flags for both]
#   e.g. bash bench/wan_vs_diffusers.sh --rounds 2 --threads 2 -- --frames 5 --height 16 --width 28 --text_tokens 512 --steps 2 --warmup 1
exec bash "$(dirname "${BASH_SOURCE[0]}")/dit_vs_diffusers.sh" wan "$@"
