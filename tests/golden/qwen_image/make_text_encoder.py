#!/usr/bin/env python3
"""Makes tests/golden/qwen_image/text_encoder/ (a tiny Qwen2.5-VL as Qwen-Image's `text_encoder/`
folder holds it) and tests/golden/qwen_image/text_encoder_expected.safetensors (the hidden states
its language model gives).

Run with refstack2's Python (torch 2.6 CPU, safetensors):
    ../shared/refstack2/run python3 tests/golden/qwen_image/make_text_encoder.py tests/golden/qwen_image
Re-running writes byte-identical files (float32 on one CPU thread, a fixed seed, safetensors with
sorted keys, JSON with sorted keys).

Steps:
  1. config.json: what Qwen2_5_VLConfig.to_json_file writes for Qwen2_5_VLForConditionalGeneration
     with the key set of Qwen-Image's own text_encoder/config.json (saved by transformers 4.53.1):
     the text fields at top level AND again in `text_config` (model_type "qwen2_5_vl_text",
     `layer_types`, null image/video token ids, sliding_window null there), `rope_scaling`
     {"mrope_section", "rope_type": "default", "type": "default"}, a `vision_config`
     (model_type "qwen2_5_vl", `in_chans` and `spatial_patch_size` duplicates included) and the
     special token ids. The token ids are the tiny tokenizer's (tests/golden/z_image/tokenizer/,
     which tokenizer/ here reuses): bos <|endoftext|>, eos <|im_end|>, image <|image_pad|>, video
     <|video_pad|>, vision start / end / pad <|vision_start|> / <|vision_end|> / <|vision_pad|>.
  2. Weights: float32 random (seed 20261215; every matrix, conv kernel and bias 0.1 randn, every
     RMSNorm weight 1 + 0.1 randn), drawn in Qwen2_5_VLForConditionalGeneration's state-dict order
     and saved under the LEGACY checkpoint names Qwen-Image ships (what save_pretrained writes
     after undoing `_checkpoint_conversion_mapping`): `visual.*` (vision tower: patch_embed.proj
     Conv3d without bias, blocks.<i>.{norm1,norm2} RMSNorm, attn.qkv / attn.proj with bias,
     mlp.{gate,up,down}_proj with bias; merger.ln_q, merger.mlp.0 / mlp.2), `model.*` (language
     model: embed_tokens, layers.<i>.self_attn.{q,k,v}_proj with bias, o_proj without,
     mlp.{gate,up,down}_proj without, input_layernorm, post_attention_layernorm; norm) and
     `lm_head.weight` (untied). Two shards split as save_pretrained(max_shard_size="600KB") splits
     (huggingface_hub's greedy split in state-dict order) and model.safetensors.index.json.
  3. The forward, a plain-torch transcription of transformers' modeling_qwen2_5_vl.py (4.53-4.57:
     Qwen2_5_VLForConditionalGeneration.forward(input_ids, attention_mask,
     output_hidden_states=True) -> Qwen2_5_VLModel.forward -> get_rope_index ->
     Qwen2_5_VLTextModel.forward, eager attention, no pixel_values), as
     QwenImagePipeline._get_qwen_prompt_embeds calls it:
       - position ids (get_rope_index, no image grid): `cumsum(attention_mask) - 1`, then 1 written
         at every masked position, the same for the 3 mrope axes ([3, B, S]). Real tokens count
         0, 1, 2, ... from the first REAL token whatever the padding side (left padding does not
         shift them, unlike arange); pad positions get position 1.
       - RoPE: inv_freq = 1 / theta^(arange(0, 16, 2) / 16) (float32), angles per axis
         [3, B, S, 8] in float32, cat(freqs, freqs) -> cos, sin cast to the activation dtype;
         apply_multimodal_rotary_pos_emb splits the 16 dims as mrope_section * 2 = [2, 3, 3, 2, 3,
         3] and takes chunk i from axis i % 3 (so dims j and j + 8 share an axis), then
         q * cos + rotate_half(q) * sin (split halves). With the 3 axes equal this is ordinary
         RoPE.
       - causal mask AND the padding mask on the keys (masking_utils eager_mask: 0 / finfo.min in
         the activation dtype). A query row with no allowed key (left padding: the pad rows before
         the first real token) gets finfo.min on every key, i.e. a uniform softmax over ALL S keys
         (eager has no fix for fully masked rows).
       - decoder layers: x += o_proj(attn(input_layernorm(x))), x += mlp(post_attention_layernorm(x));
         q/k/v with bias, GQA (kv head j serves query heads 2j, 2j+1), scale head_dim^-0.5,
         softmax in float32 then cast back; RMSNorm statistics in float32, cast back, then weight *.
       - hidden_states = (embeddings, output of layer 0, output of layer 1, norm(output of
         layer 2)): 4 entries for 3 layers; the raw output of the last layer is NOT among them,
         hidden_states[-1] is last_hidden_state (after the final norm), which is what Qwen-Image
         takes.
  4. text_encoder_expected.safetensors (int64 ids / masks / positions, float32 values):
       input_ids, attention_mask [3, 13] right-padded (lengths 7, 13, 1, pad id <|endoftext|>),
         position_ids [3, 3, 13], hidden_states.0 .. .3 [3, 13, 64] (pad positions included);
       input_ids_left, attention_mask_left [3, 13]: the same sequences left-padded,
         position_ids_left, hidden_states_left.3;
       input_ids_nopad [1, 9] (mask all ones), hidden_states_nopad.0 .. .3 [1, 9, 64];
       hidden_states_bf16.3 [3, 13, 64]: the right-padded batch with the model in bfloat16
         (as from_pretrained(torch_dtype=torch.bfloat16) has it: bf16 weights, inv_freq float32;
         cos/sin, RMSNorm statistics and softmax in float32, cast to bf16 after each), stored as
         float32;
       mrope.input_ids, mrope.attention_mask [2, 16] (right-padded, lengths 16 and 11), each row
         holding <|vision_start|> + 6 x <|image_pad|> + <|vision_end|> between text tokens,
         mrope.image_grid_thw [2, 3] int64 (= [[1, 4, 6], [1, 4, 6]]: 1 x 2 x 3 merged tokens each),
         mrope.position_ids [3, 2, 16], mrope.rope_deltas [2, 1], mrope.hidden_states.3:
         model(input_ids, attention_mask, image_grid_thw=..., output_hidden_states=True) without
         pixel_values (transformers then keeps the <|image_pad|> token embeddings but gives the
         image tokens their 3-D positions: text positions run on, the image block of
         llm grid (t, h, w) gets (st + t * tokens_per_second * 0, st + h_i, st + w_j) with st the
         next text position, and text after it continues from the block's max + 1; pads get 1).
Checks (the outputs do not depend on them): a second, loop-based float64 formulation written here
(per row, head, position and frequency; positions counted in a Python loop; RoPE by explicit pair
rotation with the axis of each frequency; attention over an explicit key list, uniform over all
keys when the list is empty) matches every case at every real position and also at every pad
position; each sequence of the right-padded batch run alone, and the left-padded batch, equal the
right-padded batch at the real positions.
"""
import json
import os
import sys

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
TOKENIZER_DIR = os.path.join(HERE, "..", "z_image", "tokenizer")

V, D, L, NH, NKV, HD, FF = 704, 64, 3, 4, 2, 16, 96
EPS, THETA = 1e-6, 1000000.0
MROPE = [2, 3, 3]
VIS = dict(depth=2, hidden_size=32, num_heads=2, intermediate_size=48, out_hidden_size=64,
           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, window_size=112,
           fullatt_block_indexes=[1], in_channels=3, tokens_per_second=2)
MAX_SHARD = 600_000  # save_pretrained(max_shard_size="600KB"): two shards for this model
SEED = 20261215
LENGTHS, NOPAD_LEN = [7, 13, 1], 9


def tokenizer_ids():
    with open(os.path.join(TOKENIZER_DIR, "tokenizer_config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    return {e["content"]: int(i) for i, e in cfg["added_tokens_decoder"].items()}


def make_config():
    ids = tokenizer_ids()
    tok = {"bos_token_id": ids["<|endoftext|>"], "eos_token_id": ids["<|im_end|>"],
           "vision_start_token_id": ids["<|vision_start|>"],
           "vision_end_token_id": ids["<|vision_end|>"], "vision_token_id": ids["<|vision_pad|>"]}
    rope = {"mrope_section": MROPE, "rope_type": "default", "type": "default"}
    text = {"attention_dropout": 0.0, "hidden_act": "silu", "hidden_size": D,
            "initializer_range": 0.02, "intermediate_size": FF, "max_position_embeddings": 128000,
            "max_window_layers": L, "num_attention_heads": NH, "num_hidden_layers": L,
            "num_key_value_heads": NKV, "rms_norm_eps": EPS, "rope_scaling": rope,
            "rope_theta": THETA, "tie_word_embeddings": False, "torch_dtype": "float32",
            "use_cache": True, "use_sliding_window": False, "vocab_size": V, **tok}
    text_config = dict(text, architectures=["Qwen2_5_VLForConditionalGeneration"],
                       image_token_id=None, video_token_id=None,
                       layer_types=["full_attention"] * L, model_type="qwen2_5_vl_text",
                       sliding_window=None)
    vision_config = {"depth": VIS["depth"], "fullatt_block_indexes": VIS["fullatt_block_indexes"],
                     "hidden_act": "silu", "hidden_size": VIS["hidden_size"],
                     "in_channels": VIS["in_channels"], "in_chans": VIS["in_channels"],
                     "initializer_range": 0.02, "intermediate_size": VIS["intermediate_size"],
                     "model_type": "qwen2_5_vl", "num_heads": VIS["num_heads"],
                     "out_hidden_size": VIS["out_hidden_size"], "patch_size": VIS["patch_size"],
                     "spatial_merge_size": VIS["spatial_merge_size"],
                     "spatial_patch_size": VIS["patch_size"],
                     "temporal_patch_size": VIS["temporal_patch_size"],
                     "tokens_per_second": VIS["tokens_per_second"], "torch_dtype": "float32",
                     "window_size": VIS["window_size"]}
    return dict(text, architectures=["Qwen2_5_VLForConditionalGeneration"],
                image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                model_type="qwen2_5_vl", sliding_window=32768, text_config=text_config,
                transformers_version="4.53.1", vision_config=vision_config)


def state_dict_shapes():
    """Qwen2_5_VLForConditionalGeneration.state_dict() order, legacy (Qwen-Image) names."""
    s = {}
    vd, vf, vm = VIS["hidden_size"], VIS["intermediate_size"], VIS["spatial_merge_size"]
    s["visual.patch_embed.proj.weight"] = (vd, VIS["in_channels"], VIS["temporal_patch_size"],
                                           VIS["patch_size"], VIS["patch_size"])
    for i in range(VIS["depth"]):
        p = f"visual.blocks.{i}."
        s.update({p + "norm1.weight": (vd,), p + "norm2.weight": (vd,),
                  p + "attn.qkv.weight": (3 * vd, vd), p + "attn.qkv.bias": (3 * vd,),
                  p + "attn.proj.weight": (vd, vd), p + "attn.proj.bias": (vd,),
                  p + "mlp.gate_proj.weight": (vf, vd), p + "mlp.gate_proj.bias": (vf,),
                  p + "mlp.up_proj.weight": (vf, vd), p + "mlp.up_proj.bias": (vf,),
                  p + "mlp.down_proj.weight": (vd, vf), p + "mlp.down_proj.bias": (vd,)})
    mh = vd * vm * vm
    s.update({"visual.merger.ln_q.weight": (vd,), "visual.merger.mlp.0.weight": (mh, mh),
              "visual.merger.mlp.0.bias": (mh,),
              "visual.merger.mlp.2.weight": (VIS["out_hidden_size"], mh),
              "visual.merger.mlp.2.bias": (VIS["out_hidden_size"],)})
    s["model.embed_tokens.weight"] = (V, D)
    for i in range(L):
        p = f"model.layers.{i}."
        s.update({p + "self_attn.q_proj.weight": (NH * HD, D), p + "self_attn.q_proj.bias": (NH * HD,),
                  p + "self_attn.k_proj.weight": (NKV * HD, D), p + "self_attn.k_proj.bias": (NKV * HD,),
                  p + "self_attn.v_proj.weight": (NKV * HD, D), p + "self_attn.v_proj.bias": (NKV * HD,),
                  p + "self_attn.o_proj.weight": (D, NH * HD),
                  p + "mlp.gate_proj.weight": (FF, D), p + "mlp.up_proj.weight": (FF, D),
                  p + "mlp.down_proj.weight": (D, FF),
                  p + "input_layernorm.weight": (D,), p + "post_attention_layernorm.weight": (D,)})
    s["model.norm.weight"] = (D,)
    s["lm_head.weight"] = (V, D)
    return s


def make_weights():
    g = torch.Generator().manual_seed(SEED)
    w = {}
    for name, shape in state_dict_shapes().items():
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        is_norm = name.endswith(("norm.weight", "norm1.weight", "norm2.weight", "layernorm.weight",
                                 "ln_q.weight"))
        w[name] = 1.0 + 0.1 * r if is_norm else 0.1 * r
    return w


def write_text_encoder(te, w, config):
    os.makedirs(te, exist_ok=True)
    with open(os.path.join(te, "config.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(config, indent=2, sort_keys=True) + "\n")
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
    with open(os.path.join(te, "model.safetensors.index.json"), "w", encoding="utf-8",
              newline="\n") as f:
        f.write(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                           indent=2, sort_keys=True) + "\n")
    return [len(s) for s in shards]


# ---- transcription of transformers' modeling_qwen2_5_vl.py (language model) ----------------------

def rms_norm(x, weight):  # Qwen2RMSNorm.forward
    h = x.to(torch.float32)
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS)
    return weight * h.to(x.dtype)


def get_rope_index(cfg, input_ids, attention_mask, image_grid_thw=None):
    """Qwen2_5_VLModel.get_rope_index (images only; no videos) -> position_ids [3, B, S], deltas."""
    if image_grid_thw is None:  # text only
        position_ids = attention_mask.long().cumsum(-1) - 1
        position_ids.masked_fill_(attention_mask == 0, 1)
        position_ids = position_ids.unsqueeze(0).expand(3, -1, -1)
        max_position_ids = position_ids.max(0, keepdim=False)[0].max(-1, keepdim=True)[0]
        return position_ids, max_position_ids + 1 - attention_mask.shape[-1]
    merge = cfg["vision_config"]["spatial_merge_size"]
    image_token_id, vision_start = cfg["image_token_id"], cfg["vision_start_token_id"]
    position_ids = torch.ones(3, input_ids.shape[0], input_ids.shape[1], dtype=input_ids.dtype)
    deltas, image_index = [], 0
    for i, ids in enumerate(input_ids):
        ids = ids[attention_mask[i] == 1]
        starts = torch.argwhere(ids == vision_start).squeeze(1)
        image_nums = int((ids[starts + 1] == image_token_id).sum())
        tokens = ids.tolist()
        pos_list, st = [], 0
        for _ in range(image_nums):
            ed = tokens.index(image_token_id, st)
            t, h, w = (int(v) for v in image_grid_thw[image_index])
            image_index += 1
            gt, gh, gw = t, h // merge, w // merge
            text_len = ed - st
            st_idx = pos_list[-1].max() + 1 if pos_list else 0
            pos_list.append(torch.arange(text_len).view(1, -1).expand(3, -1) + st_idx)
            # second_per_grid_t = 0 for images: the temporal index is 0 for every image token
            t_index = (torch.arange(gt).view(-1, 1).expand(-1, gh * gw) * 0 *
                       cfg["vision_config"]["tokens_per_second"]).long().flatten()
            h_index = torch.arange(gh).view(1, -1, 1).expand(gt, -1, gw).flatten()
            w_index = torch.arange(gw).view(1, 1, -1).expand(gt, gh, -1).flatten()
            pos_list.append(torch.stack([t_index, h_index, w_index]) + text_len + st_idx)
            st = ed + gt * gh * gw
        if st < len(tokens):
            st_idx = pos_list[-1].max() + 1 if pos_list else 0
            pos_list.append(torch.arange(len(tokens) - st).view(1, -1).expand(3, -1) + st_idx)
        llm_positions = torch.cat(pos_list, dim=1).reshape(3, -1)
        position_ids[..., i, attention_mask[i] == 1] = llm_positions
        deltas.append(llm_positions.max() + 1 - len(input_ids[i]))
    return position_ids, torch.tensor(deltas).unsqueeze(1)


def rotary(x, position_ids):  # Qwen2_5_VLRotaryEmbedding.forward (default rope, scaling 1)
    inv_freq = 1.0 / (THETA ** (torch.arange(0, HD, 2, dtype=torch.int64).float() / HD))
    inv = inv_freq[None, None, :, None].float().expand(3, position_ids.shape[1], -1, 1)
    pos = position_ids[:, :, None, :].float()
    freqs = (inv @ pos).transpose(2, 3)  # [3, B, S, HD/2], float32
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x):
    return torch.cat((-x[..., HD // 2:], x[..., :HD // 2]), dim=-1)


def apply_mrope(q, k, cos, sin):  # apply_multimodal_rotary_pos_emb, unsqueeze_dim=1
    sec = MROPE * 2
    cos = torch.cat([m[i % 3] for i, m in enumerate(cos.split(sec, dim=-1))], dim=-1).unsqueeze(1)
    sin = torch.cat([m[i % 3] for i, m in enumerate(sin.split(sec, dim=-1))], dim=-1).unsqueeze(1)
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def causal_mask(attention_mask, dtype):  # masking_utils.create_causal_mask -> eager_mask
    s = attention_mask.shape[1]
    q, kv = torch.arange(s)[:, None], torch.arange(s)[None, :]
    allowed = (kv <= q)[None, None] & attention_mask.bool()[:, None, None, :]
    return torch.where(allowed, torch.tensor(0.0, dtype=dtype), torch.finfo(dtype).min)


def attention(w, p, x, cos, sin, mask):  # Qwen2_5_VLAttention.forward + eager_attention_forward
    b, s, _ = x.shape
    q = F.linear(x, w[p + "q_proj.weight"], w[p + "q_proj.bias"]).view(b, s, -1, HD).transpose(1, 2)
    k = F.linear(x, w[p + "k_proj.weight"], w[p + "k_proj.bias"]).view(b, s, -1, HD).transpose(1, 2)
    v = F.linear(x, w[p + "v_proj.weight"], w[p + "v_proj.bias"]).view(b, s, -1, HD).transpose(1, 2)
    q, k = apply_mrope(q, k, cos, sin)
    rep = NH // NKV  # repeat_kv
    k = k[:, :, None].expand(b, NKV, rep, s, HD).reshape(b, NH, s, HD)
    v = v[:, :, None].expand(b, NKV, rep, s, HD).reshape(b, NH, s, HD)
    scores = torch.matmul(q, k.transpose(2, 3)) * HD ** -0.5 + mask[:, :, :, :s]
    probs = F.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.matmul(probs, v).transpose(1, 2).reshape(b, s, -1)
    return F.linear(out, w[p + "o_proj.weight"])


def text_forward(w, cfg, input_ids, attention_mask, image_grid_thw=None):
    """Qwen2_5_VLForConditionalGeneration(input_ids, attention_mask, [image_grid_thw,]
    output_hidden_states=True): (hidden_states list, position_ids, rope_deltas)."""
    x = F.embedding(input_ids, w["model.embed_tokens.weight"])
    position_ids, deltas = get_rope_index(cfg, input_ids, attention_mask, image_grid_thw)
    cos, sin = rotary(x, position_ids)
    mask = causal_mask(attention_mask, x.dtype)
    hidden = []
    for i in range(L):  # Qwen2_5_VLDecoderLayer.forward
        hidden.append(x)  # all_hidden_states += (hidden_states,) before each layer
        p = f"model.layers.{i}."
        x = x + attention(w, p + "self_attn.", rms_norm(x, w[p + "input_layernorm.weight"]),
                          cos, sin, mask)
        h = rms_norm(x, w[p + "post_attention_layernorm.weight"])
        x = x + F.linear(F.silu(F.linear(h, w[p + "mlp.gate_proj.weight"])) *
                         F.linear(h, w[p + "mlp.up_proj.weight"]), w[p + "mlp.down_proj.weight"])
    hidden.append(rms_norm(x, w["model.norm.weight"]))  # then the normed last_hidden_state
    return hidden, position_ids, deltas


# ---- independent float64 formulation with explicit loops -----------------------------------------

def loop_positions(cfg, ids, mask, grid=None):
    """3-axis positions per row, counted in a Python loop (pads: 1 on every axis)."""
    merge = cfg["vision_config"]["spatial_merge_size"]
    out, img = [], 0
    for b in range(len(ids)):
        real = [t for t in range(len(ids[b])) if mask[b][t]]
        pos, nxt, k = {}, 0, 0
        while k < len(real):
            if grid is not None and ids[b][real[k]] == cfg["image_token_id"]:
                gt, gh, gw = grid[img][0], grid[img][1] // merge, grid[img][2] // merge
                img += 1
                top = nxt
                for _ in range(gt):  # temporal index 0 for images
                    for hi in range(gh):
                        for wi in range(gw):
                            pos[real[k]] = (nxt, nxt + hi, nxt + wi)
                            top = max(top, nxt + hi, nxt + wi)
                            k += 1
                nxt = top + 1  # text after the block continues from its max + 1
            else:
                pos[real[k]] = (nxt, nxt, nxt)
                nxt += 1
                k += 1
        out.append([pos.get(t, (1, 1, 1)) for t in range(len(ids[b]))])
    return out  # [B][S] -> (axis 0, axis 1, axis 2)


def loop_forward(w, cfg, input_ids, attention_mask, grid=None):
    w = {k: v.double() for k, v in w.items()}
    B, S = input_ids.shape
    half, rep = HD // 2, NH // NKV
    axis = [0] * MROPE[0] + [1] * MROPE[1] + [2] * MROPE[2]  # axis of frequency j
    ids, mask = input_ids.tolist(), attention_mask.tolist()
    P = loop_positions(cfg, ids, mask, grid)

    def norm(vec, weight):
        return weight * vec / torch.sqrt((vec * vec).sum() / vec.numel() + EPS)

    def rope(vec, pos3):
        out = vec.clone()
        for j in range(half):
            a = torch.tensor(pos3[axis[j]] * THETA ** (-2.0 * j / HD), dtype=torch.float64)
            out[j] = vec[j] * torch.cos(a) - vec[j + half] * torch.sin(a)
            out[j + half] = vec[j + half] * torch.cos(a) + vec[j] * torch.sin(a)
        return out

    x = w["model.embed_tokens.weight"][input_ids]
    hidden = [x.clone()]
    for li in range(L):
        p = f"model.layers.{li}."
        new = x.clone()
        for b in range(B):
            hn = torch.stack([norm(x[b, t], w[p + "input_layernorm.weight"]) for t in range(S)])
            q = (hn @ w[p + "self_attn.q_proj.weight"].T + w[p + "self_attn.q_proj.bias"]).view(S, NH, HD)
            k = (hn @ w[p + "self_attn.k_proj.weight"].T + w[p + "self_attn.k_proj.bias"]).view(S, NKV, HD)
            v = (hn @ w[p + "self_attn.v_proj.weight"].T + w[p + "self_attn.v_proj.bias"]).view(S, NKV, HD)
            ctx = torch.zeros(S, NH, HD, dtype=torch.float64)
            for h in range(NH):
                kv = h // rep
                qs = [rope(q[t, h], P[b][t]) for t in range(S)]
                ks = [rope(k[t, kv], P[b][t]) for t in range(S)]
                for t in range(S):
                    keys = [s for s in range(t + 1) if mask[b][s]]
                    if not keys:  # every key masked: finfo.min everywhere -> uniform over all S
                        ctx[t, h] = v[:, kv].mean(0)
                        continue
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
    hidden[-1] = torch.stack([torch.stack([norm(x[b, t], w["model.norm.weight"]) for t in range(S)])
                              for b in range(B)])
    return hidden, P


def max_diff(a, b, mask=None):
    d = (a.double() - b.double()).abs()
    if mask is not None:
        d = d[mask.bool()]
    return d.max().item()


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    cfg = make_config()
    w = make_weights()
    te = os.path.join(out, "text_encoder")
    shard_counts = write_text_encoder(te, w, cfg)
    pad = cfg["bos_token_id"]  # <|endoftext|>, Qwen2.5-VL's pad token

    # Inputs: random real ids (1 .. V-1), right padding as the tokenizer pads
    g = torch.Generator().manual_seed(1215)
    S = max(LENGTHS)
    seqs = [torch.randint(1, V, (n,), generator=g) for n in LENGTHS]
    ids = torch.full((len(LENGTHS), S), pad, dtype=torch.int64)
    amask = torch.zeros((len(LENGTHS), S), dtype=torch.int64)
    ids_l, amask_l = ids.clone(), amask.clone()
    for i, (n, sq) in enumerate(zip(LENGTHS, seqs)):
        ids[i, :n], amask[i, :n] = sq, 1
        ids_l[i, S - n:], amask_l[i, S - n:] = sq, 1
    ids_nopad = torch.randint(1, V, (1, NOPAD_LEN), generator=g)
    ones = torch.ones_like(ids_nopad)
    # mrope case: text, <|vision_start|>, 6 <|image_pad|> (grid 1 x 4 x 6 -> 1 x 2 x 3 merged),
    # <|vision_end|>, text; row 1 shorter (right padding)
    vs, ve, ip = cfg["vision_start_token_id"], cfg["vision_end_token_id"], cfg["image_token_id"]
    rows = [[*torch.randint(1, 600, (3,), generator=g).tolist(), vs, *[ip] * 6, ve,
             *torch.randint(1, 600, (5,), generator=g).tolist()],
            [*torch.randint(1, 600, (1,), generator=g).tolist(), vs, *[ip] * 6, ve,
             *torch.randint(1, 600, (2,), generator=g).tolist()]]
    SM = max(len(r) for r in rows)
    m_ids = torch.full((2, SM), pad, dtype=torch.int64)
    m_mask = torch.zeros((2, SM), dtype=torch.int64)
    for i, r in enumerate(rows):
        m_ids[i, :len(r)], m_mask[i, :len(r)] = torch.tensor(r), 1
    m_grid = torch.tensor([[1, 4, 6], [1, 4, 6]], dtype=torch.int64)

    with torch.no_grad():
        hs, pos, _ = text_forward(w, cfg, ids, amask)
        hs_l, pos_l, _ = text_forward(w, cfg, ids_l, amask_l)
        hs_np, _, _ = text_forward(w, cfg, ids_nopad, ones)
        hs_bf, _, _ = text_forward({k: v.to(torch.bfloat16) for k, v in w.items()}, cfg, ids, amask)
        hs_m, pos_m, deltas_m = text_forward(w, cfg, m_ids, m_mask, m_grid)
    assert len(hs) == L + 1

    # float64 loops
    report = {}
    for name, (h, i_, m_, grid, p_) in {
            "right": (hs, ids, amask, None, pos), "left": (hs_l, ids_l, amask_l, None, pos_l),
            "nopad": (hs_np, ids_nopad, ones, None, None),
            "mrope": (hs_m, m_ids, m_mask, m_grid.tolist(), pos_m)}.items():
        ref, P = loop_forward(w, cfg, i_, m_, grid)
        if p_ is not None:
            assert torch.equal(p_.permute(1, 2, 0), torch.tensor(P)), name
        real = max(max_diff(a, r, m_) for a, r in zip(h, ref))
        every = max(max_diff(a, r) for a, r in zip(h, ref))
        report[name] = (real, every)
        print(f"float64 loop vs transcription, {name}: max abs diff {real:.3e} at real positions, "
              f"{every:.3e} at every position")
        assert real < 1e-5 and every < 1e-5, (name, real, every)
    # each row alone, and left padding, equal the right-padded batch at the real positions
    d_alone = d_left = 0.0
    with torch.no_grad():
        for i, n in enumerate(LENGTHS):
            alone, _, _ = text_forward(w, cfg, ids[i:i + 1, :n], amask[i:i + 1, :n])
            d_alone = max(d_alone, max((a[0] - b[i, :n]).abs().max().item() for a, b in zip(alone, hs)))
            d_left = max(d_left, (hs_l[-1][i, S - n:] - hs[-1][i, :n]).abs().max().item())
    print(f"rows alone vs right-padded batch (real positions): {d_alone:.3e}; "
          f"left- vs right-padded (real positions): {d_left:.3e}")
    assert d_alone < 1e-5 and d_left < 1e-5
    dbf = max_diff(hs_bf[-1].float(), hs[-1], amask)
    print(f"bf16 vs float32 hidden_states[-1] (real positions): max abs diff {dbf:.3e} "
          f"(max |value| {hs[-1].abs().max().item():.3f})")
    print(f"position_ids right: {pos[0].tolist()}\nposition_ids left: {pos_l[0].tolist()}")
    print(f"mrope position_ids: {pos_m.tolist()}\nrope_deltas {deltas_m.tolist()}")

    exp = {"input_ids": ids, "attention_mask": amask, "position_ids": pos.contiguous(),
           "input_ids_left": ids_l, "attention_mask_left": amask_l,
           "position_ids_left": pos_l.contiguous(), f"hidden_states_left.{L}": hs_l[-1],
           "input_ids_nopad": ids_nopad, f"hidden_states_bf16.{L}": hs_bf[-1].float(),
           "mrope.input_ids": m_ids, "mrope.attention_mask": m_mask, "mrope.image_grid_thw": m_grid,
           "mrope.position_ids": pos_m.contiguous(), "mrope.rope_deltas": deltas_m,
           f"mrope.hidden_states.{L}": hs_m[-1]}
    for k in range(L + 1):
        exp[f"hidden_states.{k}"] = hs[k]
        exp[f"hidden_states_nopad.{k}"] = hs_np[k]
    save_file({k: exp[k].contiguous() for k in sorted(exp)},
              os.path.join(out, "text_encoder_expected.safetensors"), metadata={"format": "pt"})
    print(f"wrote {te} ({shard_counts} tensors per shard) and "
          f"{os.path.join(out, 'text_encoder_expected.safetensors')}")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_text_encoder.py OUT_DIR  (tests/golden/qwen_image)")
    main(sys.argv[1])
