# Interop check (docs/FLUX.md, "Training"): loads a FLUX.1 LoRA that `difftrain train` wrote in
# Diffusers' layout with Diffusers 0.31's FLUX LoRA loader (FluxPipeline's load_lora_weights path:
# lora_state_dict, load_lora_into_transformer) into the folder's FluxTransformer2DModel and writes
# its forward on the transformer's io case B, to compare with `difftrain forward --lora`.
# Runs on the refstack (../shared/refstack: Diffusers without transformers, so the mixin is used
# directly rather than FluxPipeline, and torch 1.13, which lacks scaled_dot_product_attention).
#   . ../shared/refstack/env.sh
#   /usr/bin/python3 tests/interop/diffusers_flux_lora.py FLUX_DIR LORA.safetensors py_out.safetensors
import sys, math, torch
import torch.nn.functional as F
if not hasattr(F, "scaled_dot_product_attention"):  # torch 1.13: the plain definition
    def _sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None):
        w = (q @ k.transpose(-2, -1)) * (scale or 1 / math.sqrt(q.size(-1)))
        if attn_mask is not None: w = w + attn_mask
        return w.softmax(-1) @ v
    F.scaled_dot_product_attention = _sdpa
from safetensors.torch import load_file, save_file
from diffusers import FluxTransformer2DModel
from diffusers.loaders.lora_pipeline import FluxLoraLoaderMixin as FluxPipeline
folder, lora, out = sys.argv[1], sys.argv[2], sys.argv[3]
t = FluxTransformer2DModel.from_pretrained(folder + "/transformer").eval()
sd = FluxPipeline.lora_state_dict(load_file(lora))
if isinstance(sd, tuple): sd = sd[0]
FluxPipeline.load_lora_into_transformer(sd, network_alphas=None, transformer=t)
io = load_file(folder + "/transformer/io.safetensors")
g = lambda n: io["B." + n]
with torch.no_grad():
    o = t(hidden_states=g("hidden_states"), encoder_hidden_states=g("encoder_hidden_states"),
          pooled_projections=g("pooled_projections"), timestep=g("timestep"), guidance=g("guidance"),
          img_ids=g("img_ids"), txt_ids=g("txt_ids"), return_dict=False)[0]
    base_t = FluxTransformer2DModel.from_pretrained(folder + "/transformer").eval()
    b = base_t(hidden_states=g("hidden_states"), encoder_hidden_states=g("encoder_hidden_states"),
          pooled_projections=g("pooled_projections"), timestep=g("timestep"), guidance=g("guidance"),
          img_ids=g("img_ids"), txt_ids=g("txt_ids"), return_dict=False)[0]
print("lora changes diffusers output by", (o - b).abs().max().item())
save_file({"out": o.contiguous()}, out)
