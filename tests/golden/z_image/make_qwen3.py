#!/usr/bin/env python3
"""Makes tests/golden/z_image/qwen3/: a tiny Qwen3 text encoder (Z-Image's `text_encoder/`) and
the hidden states its forward gives.

Run with refstack2's Python (torch 2.6 CPU, safetensors):
    ../shared/refstack2/run python3 tests/golden/z_image/make_qwen3.py tests/golden/z_image/qwen3
Re-running writes byte-identical files.

transformers is not available here, so the forward is a plain-torch transcription of
transformers' modeling_qwen3.py (Qwen3Model.forward with output_hidden_states=True, eager
attention, an attention_mask and no position_ids, as ZImagePipeline._encode_prompt calls it),
checked against (a) a float64 formulation with explicit per-head, per-position loops written
here, and (b) when RASBT_QWEN3 names a copy of rasbt/LLMs-from-scratch's
pkg/llms_from_scratch/qwen3.py, that standalone model (run per sequence, unpadded):
    git --git-dir=<mirror of rasbt/LLMs-from-scratch> show HEAD:pkg/llms_from_scratch/qwen3.py \
        > /tmp/rasbt_qwen3.py
    ../shared/refstack2/run env RASBT_QWEN3=/tmp/rasbt_qwen3.py python3 tests/golden/z_image/...
The outputs do not depend on whether (b) ran.

The bf16 run is the model as from_pretrained(torch_dtype=torch.bfloat16) has it: bf16 weights,
but RoPE's inv_freq buffer still float32 (computed with an explicit float dtype; a later
model.to(torch.bfloat16) would round it too and move hidden_states[-2] by ~0.02 here).
"""
import contextlib
import importlib.util
import io
import json
import os
import sys
import types

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

# As Qwen3Config(...).to_json_file writes it (transformers 4.51, the version Qwen3's own
# checkpoints were saved with: `torch_dtype`, `rope_theta` + `rope_scaling`, no `layer_types`).
CONFIG = {
    "architectures": ["Qwen3Model"], "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 16, "hidden_act": "silu",
    "hidden_size": 48, "initializer_range": 0.02, "intermediate_size": 80,
    "max_position_embeddings": 40960, "max_window_layers": 3, "model_type": "qwen3",
    "num_attention_heads": 6, "num_hidden_layers": 3, "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": None,
    "tie_word_embeddings": True, "torch_dtype": "float32", "transformers_version": "4.51.0",
    "use_cache": True, "use_sliding_window": False, "vocab_size": 704,
}
D, F_, L = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["num_hidden_layers"]
NH, NKV, HD = CONFIG["num_attention_heads"], CONFIG["num_key_value_heads"], CONFIG["head_dim"]
EPS, THETA, V = CONFIG["rms_norm_eps"], CONFIG["rope_theta"], CONFIG["vocab_size"]
MAX_SHARD = 300_000  # save_pretrained(max_shard_size="300KB"): two shards for this model

LENGTHS, PAD_ID, NOPAD_LEN = [7, 13, 1], 0, 9


def make_weights():
    """Random weights in Qwen3Model.state_dict() order and names (std 0.1, norms 1 + 0.1 randn)."""
    g = torch.Generator().manual_seed(20261206)
    shapes = {"embed_tokens.weight": (V, D)}
    for i in range(L):
        p = f"layers.{i}."
        shapes.update({
            p + "self_attn.q_proj.weight": (NH * HD, D), p + "self_attn.k_proj.weight": (NKV * HD, D),
            p + "self_attn.v_proj.weight": (NKV * HD, D), p + "self_attn.o_proj.weight": (D, NH * HD),
            p + "self_attn.q_norm.weight": (HD,), p + "self_attn.k_norm.weight": (HD,),
            p + "mlp.gate_proj.weight": (F_, D), p + "mlp.up_proj.weight": (F_, D),
            p + "mlp.down_proj.weight": (D, F_),
            p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)})
    shapes["norm.weight"] = (D,)
    w = {}
    for name, shape in shapes.items():
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        w[name] = 1.0 + 0.1 * r if name.endswith("norm.weight") else 0.1 * r
    return w


# ---- transcription of transformers' modeling_qwen3.py ------------------------------------------

def rms_norm(x, weight):  # Qwen3RMSNorm.forward: float32 statistics, cast back, then weight *
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def rotary(x, position_ids):  # Qwen3RotaryEmbedding: compute_default_rope_parameters + forward
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HD, 2, dtype=torch.int64).float() / HD))
    inv = inv_freq[None, :, None].expand(position_ids.shape[0], -1, 1)
    freqs = (inv @ position_ids[:, None, :].float()).transpose(1, 2)  # float32 always
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)  # attention_scaling is 1.0


def rotate_half(x):  # rotate_half: split halves (not interleaved pairs)
    return torch.cat((-x[..., HD // 2:], x[..., :HD // 2]), dim=-1)


def causal_mask(attention_mask, dtype):  # masking_utils.create_causal_mask -> eager_mask
    b, s = attention_mask.shape
    q, kv = torch.arange(s)[:, None], torch.arange(s)[None, :]
    # causal_mask_function (kv <= q) AND padding_mask_function (padding_mask[b, kv]); the
    # padding mask looks at keys only, so padded query rows still see every real key before them
    allowed = (kv <= q)[None, None] & attention_mask.bool()[:, None, None, :]
    return torch.where(allowed, torch.tensor(0.0, dtype=dtype), torch.finfo(dtype).min)


def attention(w, p, x, cos, sin, mask):  # Qwen3Attention.forward + eager_attention_forward
    b, s, _ = x.shape
    q = rms_norm(F.linear(x, w[p + "q_proj.weight"]).view(b, s, -1, HD), w[p + "q_norm.weight"])
    k = rms_norm(F.linear(x, w[p + "k_proj.weight"]).view(b, s, -1, HD), w[p + "k_norm.weight"])
    v = F.linear(x, w[p + "v_proj.weight"]).view(b, s, -1, HD)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    c, sn = cos.unsqueeze(1), sin.unsqueeze(1)  # apply_rotary_pos_emb, unsqueeze_dim=1
    q, k = q * c + rotate_half(q) * sn, k * c + rotate_half(k) * sn
    rep = NH // NKV  # repeat_kv: kv head j serves query heads j*rep .. j*rep+rep-1
    k = k[:, :, None].expand(b, NKV, rep, s, HD).reshape(b, NH, s, HD)
    v = v[:, :, None].expand(b, NKV, rep, s, HD).reshape(b, NH, s, HD)
    scores = torch.matmul(q, k.transpose(2, 3)) * HD ** -0.5 + mask[:, :, :, :s]
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
    return F.linear(out, w[p + "o_proj.weight"])


def qwen3_forward(w, input_ids, attention_mask):
    """Qwen3Model.forward(input_ids, attention_mask, output_hidden_states=True).hidden_states."""
    x = F.embedding(input_ids, w["embed_tokens.weight"])
    # No position_ids given: cache_position = arange(S), position_ids = cache_position[None]
    # (the same 0..S-1 for every row, whatever the padding).
    position_ids = torch.arange(input_ids.shape[1])[None]
    cos, sin = rotary(x, position_ids)
    mask = causal_mask(attention_mask, x.dtype)  # mask dtype = inputs_embeds dtype
    hidden = [x]  # capture hooks: layer 0's input once, then every layer's output
    for i in range(L):  # Qwen3DecoderLayer.forward
        p = f"layers.{i}."
        x = x + attention(w, p + "self_attn.", rms_norm(x, w[p + "input_layernorm.weight"]),
                          cos, sin, mask)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + F.linear(F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) *
                         F.linear(h, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
        hidden.append(x)
    # check_model_inputs: the last captured entry is replaced by last_hidden_state = norm(x)
    hidden[-1] = rms_norm(x, w["norm.weight"])
    return hidden


# ---- (a) independent float64 formulation with explicit loops ----------------------------------

def loop_forward(w, input_ids, attention_mask):
    w = {k: v.double() for k, v in w.items()}
    B, S = input_ids.shape
    half, rep = HD // 2, NH // NKV

    def norm(vec, weight):  # one vector
        return weight * vec / torch.sqrt((vec * vec).sum() / vec.numel() + EPS)

    def rope(vec, pos):  # rotate pair (i, i + HD/2) by pos * THETA^(-2i/HD)
        out = vec.clone()
        for i in range(half):
            a = pos * THETA ** (-2.0 * i / HD)
            ca, sa = torch.cos(torch.tensor(a, dtype=torch.float64)), torch.sin(torch.tensor(a, dtype=torch.float64))
            out[i] = vec[i] * ca - vec[i + half] * sa
            out[i + half] = vec[i + half] * ca + vec[i] * sa
        return out

    x = w["embed_tokens.weight"][input_ids]
    hidden = [x.clone()]
    for li in range(L):
        p = f"layers.{li}."
        new = x.clone()
        for b in range(B):
            hn = torch.stack([norm(x[b, t], w[p + "input_layernorm.weight"]) for t in range(S)])
            q = (hn @ w[p + "self_attn.q_proj.weight"].T).view(S, NH, HD)
            k = (hn @ w[p + "self_attn.k_proj.weight"].T).view(S, NKV, HD)
            v = (hn @ w[p + "self_attn.v_proj.weight"].T).view(S, NKV, HD)
            ctx = torch.zeros(S, NH, HD, dtype=torch.float64)
            for h in range(NH):
                kv = h // rep
                qs = [rope(norm(q[t, h], w[p + "self_attn.q_norm.weight"]), t) for t in range(S)]
                ks = [rope(norm(k[t, kv], w[p + "self_attn.k_norm.weight"]), t) for t in range(S)]
                for t in range(S):
                    keys = [s for s in range(t + 1) if attention_mask[b, s]]
                    assert keys, "a query row with no key to attend to"
                    sc = torch.stack([(qs[t] * ks[s]).sum() / HD ** 0.5 for s in keys])
                    pr = torch.exp(sc - sc.max())
                    pr = pr / pr.sum()
                    for j, s in enumerate(keys):
                        ctx[t, h] += pr[j] * v[s, kv]
            a = ctx.reshape(S, NH * HD) @ w[p + "self_attn.o_proj.weight"].T
            for t in range(S):
                r = x[b, t] + a[t]
                hn2 = norm(r, w[p + "post_attention_layernorm.weight"])
                g = hn2 @ w[p + "mlp.gate_proj.weight"].T
                u = hn2 @ w[p + "mlp.up_proj.weight"].T
                new[b, t] = r + (g / (1 + torch.exp(-g)) * u) @ w[p + "mlp.down_proj.weight"].T
        x = new
        hidden.append(x.clone())
    hidden[-1] = torch.stack([torch.stack([norm(x[b, t], w["norm.weight"]) for t in range(S)])
                              for b in range(B)])
    return hidden


# ---- (b) rasbt/LLMs-from-scratch's standalone Qwen3, when a copy of its file is given ---------

def load_rasbt(path):
    if not path or not os.path.exists(path):
        return None
    sys.modules.setdefault("requests", types.ModuleType("requests"))  # its download helpers only
    spec = importlib.util.spec_from_file_location("rasbt_qwen3", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def rasbt_forward(mod, w, ids):
    """Hidden states of rasbt's Qwen3Model for one unpadded sequence ids [1, n], or None."""
    if mod is None:
        return None
    cfg = {"vocab_size": V, "context_length": 64, "emb_dim": D, "n_heads": NH, "n_layers": L,
           "hidden_dim": F_, "head_dim": HD, "qk_norm": True, "n_kv_groups": NKV,
           "rope_base": THETA, "dtype": torch.float32}
    model = mod.Qwen3Model(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints "Model uses weight tying."
        mod.load_weights_into_qwen(model, cfg, {"model." + k: v for k, v in w.items()})
    with torch.no_grad():
        x = model.tok_emb(ids)
        n = ids.shape[1]
        mask = torch.triu(torch.ones(n, n, dtype=torch.bool), diagonal=1)
        hidden = [x]
        for block in model.trf_blocks:
            x = block(x, mask, model.cos, model.sin)
            hidden.append(x)
        hidden[-1] = model.final_norm(x)
    return hidden


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    w = make_weights()

    # text_encoder/: config.json, two shards and their index, as save_pretrained writes them
    te = os.path.join(out, "text_encoder")
    os.makedirs(te, exist_ok=True)
    with open(os.path.join(te, "config.json"), "w") as f:
        f.write(json.dumps(CONFIG, indent=2, sort_keys=True) + "\n")
    shards, size = [[]], 0  # huggingface_hub's split_state_dict_into_shards_factory, greedy
    for name, t in w.items():
        n = t.numel() * t.element_size()
        if size + n > MAX_SHARD and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    assert len(shards) == 2
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file({k: w[k].contiguous() for k in sorted(names)}, os.path.join(te, fname),
                  metadata={"format": "pt"})
        weight_map.update({k: fname for k in names})
    total = sum(t.numel() * t.element_size() for t in w.values())
    with open(os.path.join(te, "model.safetensors.index.json"), "w") as f:
        f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                           indent=2, sort_keys=True) + "\n")

    # Inputs: right padding, as the tokenizer pads (padding="max_length", padding_side right)
    g = torch.Generator().manual_seed(58)
    S = max(LENGTHS)
    ids = torch.full((len(LENGTHS), S), PAD_ID, dtype=torch.int64)
    amask = torch.zeros((len(LENGTHS), S), dtype=torch.int64)
    for i, n in enumerate(LENGTHS):
        ids[i, :n] = torch.randint(1, V, (n,), generator=g)
        amask[i, :n] = 1
    ids_nopad = torch.randint(1, V, (1, NOPAD_LEN), generator=g)
    ones = torch.ones_like(ids_nopad)

    with torch.no_grad():
        hs = qwen3_forward(w, ids, amask)
        hs_nopad = qwen3_forward(w, ids_nopad, ones)
        # bf16: every activation bf16; RMSNorm statistics, RoPE angles and softmax in float32
        hs_bf16 = qwen3_forward({k: v.to(torch.bfloat16) for k, v in w.items()}, ids, amask)
    assert len(hs) == L + 1

    # (a) float64 loops, every position (padded rows too)
    ref, ref_nopad = loop_forward(w, ids, amask), loop_forward(w, ids_nopad, ones)
    da = max(max((a.double() - r).abs().max().item() for a, r in zip(x, y))
             for x, y in ((hs, ref), (hs_nopad, ref_nopad)))
    print(f"(a) float64 loop formulation vs transcription: max abs diff {da:.3e}")
    assert da < 1e-5, da
    # (b) rasbt's model, each sequence alone (causal + right padding: real rows never see pads)
    rmod = load_rasbt(os.environ.get("RASBT_QWEN3"))
    db = []
    for i, n in enumerate(LENGTHS):
        r = rasbt_forward(rmod, w, ids[i:i + 1, :n])
        if r is not None:
            db += [(a[i, :n] - b[0]).abs().max().item() for a, b in zip(hs, r)]
    r = rasbt_forward(rmod, w, ids_nopad)
    if r is not None:
        db += [(a - b).abs().max().item() for a, b in zip(hs_nopad, r)]
        print(f"(b) rasbt Qwen3Model vs transcription (real positions): max abs diff {max(db):.3e}")
        assert max(db) < 1e-5, max(db)
    else:
        print("(b) rasbt Qwen3Model: skipped (RASBT_QWEN3 names no copy of its qwen3.py)")
    dbf = (hs_bf16[-2].float() - hs[-2]).abs().max().item()
    print(f"bf16 vs float32 hidden_states[-2]: max abs diff {dbf:.3e} "
          f"(max |value| {hs[-2].abs().max().item():.3f})")

    exp = {"input_ids": ids, "attention_mask": amask, "input_ids_nopad": ids_nopad,
           f"hidden_states_bf16.{L - 1}": hs_bf16[-2].float()}
    for k in range(L + 1):
        exp[f"hidden_states.{k}"] = hs[k]
        exp[f"hidden_states_nopad.{k}"] = hs_nopad[k]
    for i in range(len(LENGTHS)):  # ZImagePipeline._encode_prompt: hidden_states[-2][i][mask_i]
        exp[f"prompt_embeds.{i}"] = hs[-2][i][amask[i].bool()]
    save_file({k: exp[k].contiguous() for k in sorted(exp)}, os.path.join(out, "expected.safetensors"),
              metadata={"format": "pt"})
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_qwen3.py OUT_DIR")
    main(sys.argv[1])
