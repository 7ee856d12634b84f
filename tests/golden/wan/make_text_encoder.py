#!/usr/bin/env python3
"""Makes Wan's text side: tests/golden/wan/tiny_wan/tokenizer/ (a tiny SentencePiece unigram model
in the form of umT5's tokenizer folder), tests/golden/wan/tiny_wan/text_encoder/ (a tiny
UMT5EncoderModel as Wan's Diffusers folders ship it), text_encoder_expected.safetensors (its
last_hidden_state), prompts_expected.json + prompt_embeds.safetensors (WanPipeline.encode_prompt
from prompt STRINGS). README_text.md documents every file.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0, python3-sentencepiece 0.2,
python3-regex; no transformers, no ftfy):
    OMP_NUM_THREADS=1 ../shared/refstack2/run python3 tests/golden/wan/make_text_encoder.py tests/golden/wan
Re-running writes byte-identical files (the SentencePiece trainer on one thread with a fixed
random-generator seed, float32 / bfloat16 on one CPU thread, fixed seeds, safetensors with sorted
keys and metadata {"format": "pt"}, JSON with sorted keys).

Steps:
  1. tokenizer/spiece.model: SentencePiece unigram (vocab 1000, character_coverage 1.0, nmt_nfkc,
     byte_fallback, ids pad 0 <pad>, eos 1 </s>, bos 2 <s>, unk 3 <unk>: umT5's layout) trained on
     a corpus generated here from a fixed seed (English prompt-like lines, some German / French /
     Spanish, and Wan's Chinese negative prompt words). tokenizer_config.json /
     special_tokens_map.json in umT5's T5Tokenizer form (extra_ids 300, legacy true,
     `<extra_id_N>` = 1000 + 299 - N as added tokens, model_max_length 1e30).
  2. text_encoder/config.json (UMT5Config's key set as Wan's text_encoder/config.json has it;
     d_model 32, d_kv 8, 4 heads, d_ff 64, 2 layers, vocab_size 1408 = (1000 + 300) rounded up to
     a multiple of 128 as umT5's 256384 = 256300 rounded up) and model.safetensors: float32
     random weights (seed 20261221) under UMT5EncoderModel's save_pretrained names: shared.weight
     (encoder.embed_tokens.weight is the same Parameter, declared tied, so save_pretrained drops
     it), per block encoder.block.<i>.layer.0.SelfAttention.{q,k,v,o}.weight and its OWN
     .relative_attention_bias.weight [32, 4] (every block), .layer.0.layer_norm.weight,
     .layer.1.DenseReluDense.{wi_0,wi_1,wo}.weight, .layer.1.layer_norm.weight;
     encoder.final_layer_norm.weight.
  3. The forward: a plain-torch transcription of transformers' modeling_umt5.py (UMT5EncoderModel
     -> UMT5Stack, eval): embeddings (no scaling); the padding mask becomes
     (1 - mask[:, None, None, :]) * finfo(dtype).min in the embeddings' dtype; each block computes
     its own position bias [1, H, S, S] from its own table (bidirectional buckets: 16 per sign,
     exact below 8, log-spaced up to distance 128, float32 log truncated), adds the mask to it,
     adds that to q k^T (NO 1/sqrt(d_kv) scaling), softmax in float32 cast back, o; pre-norm
     residuals; gated-gelu FFN (gelu_new(wi_0 x) * wi_1 x, then wo); T5 RMS norm (mean of squares
     in float32, no mean subtraction, cast to the weight dtype when that is half / bf16, then
     weight *); final norm. bfloat16: every weight bf16 (`_keep_in_fp32_modules = ["wo"]` only
     applies to float16 loads), each op rounding to bf16 as torch does.
  4. text_encoder_expected.safetensors (see README_text.md).
  5. WanPipeline._get_t5_prompt_embeds + encode_prompt restated in plain Python (prompt_clean:
     ftfy is NOT installed in refstack2, so is_ftfy_available() is False and basic_clean is
     html.unescape twice + strip; whitespace_clean is regex `\\s+` -> " " + strip; the tokenizer
     restated below; the encoder with the mask; each row cut to its mask length then zero-padded
     back to max_sequence_length; repeat(1, n, 1).view(B * n, S, D); negative prompts "" by
     default), and also run through Diffusers' own WanPipeline.encode_prompt with the tiny
     tokenizer and encoder plugged in (equal bit for bit, asserted).
Checks (the outputs do not depend on them): Wan's own wan/modules/t5.py structure (T5Encoder with
shared_pos=False: per-block T5RelativeEmbedding, mask by masked_fill with finfo.min, einsum
attention, fc1(x) * gate(x)) restated here in float64; a pure-Python bucket function; each row of
the padded batch run alone without padding equals the batch at its real positions; attention_mask
all ones equals no mask; sentencepiece's int ids equal the str-pieces -> piece_to_id path; a second
training of the SentencePiece model gives the same bytes.
"""
import hashlib
import html
import io
import json
import math
import os
import random
import sys
import unicodedata

import regex
import sentencepiece as spm
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

# ---- sizes -------------------------------------------------------------------------------------
PIECES, EXTRA_IDS = 1000, 300
V = ((PIECES + EXTRA_IDS + 127) // 128) * 128  # 1408, as umT5's 256384 = ceil128(256000 + 300)
D, DKV, H, FF, L = 32, 8, 4, 64, 2
NUM_BUCKETS, MAX_DISTANCE, EPS = 32, 128, 1e-6
PAD_ID, EOS_ID, BOS_ID, UNK_ID = 0, 1, 2, 3
SEED = 20261221
SP_SEED = 1221


def write_json(path, obj):
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(obj, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def save_st(path, tensors):
    save_file({k: tensors[k].contiguous() for k in sorted(tensors)}, path, metadata={"format": "pt"})


# ---- 1. tokenizer --------------------------------------------------------------------------------

SUBJECTS = ("cat dog fox horse bird eagle owl rabbit tiger lion panda robot astronaut knight girl "
            "boy woman man child dancer musician chef painter sailor dragon butterfly whale "
            "dolphin turtle squirrel deer wolf bear elephant giraffe monkey penguin car train "
            "bicycle boat airplane balloon kite lantern castle lighthouse bridge tower volcano "
            "waterfall jellyfish octopus hedgehog flamingo peacock koala kangaroo zebra "
            "skateboarder surfer firefighter scientist wizard samurai ballerina gardener").split()
ADJS = ("red blue green yellow golden silver white black orange purple pink tiny huge old young "
        "happy sleepy curious fluffy shiny rusty ancient modern glowing wooden crystal misty "
        "snowy rainy sunny foggy colorful vintage elegant playful quiet busy mysterious "
        "majestic cheerful gigantic miniature translucent velvety sparkling windswept").split()
VERBS = ("walks runs jumps flies swims dances sings sleeps sits stands climbs rides drives "
         "floats glides spins waves smiles looks plays reads cooks paints explores wanders "
         "chases carries holds").split()
PLACES = ("on the grass|in the forest|over the lake|under the bridge|on the beach|in the city "
          "street|on a mountain top|in a small kitchen|across the desert|through the snow|"
          "inside a cozy room|near the river|in a flower garden|on a red sofa|in the rain|"
          "under the stars|at the train station|in a busy market|on the moon|in the ocean").split("|")
STYLES = ("realistic style|cinematic lighting|anime style|oil painting|watercolor|4k video|"
          "slow motion|close-up shot|wide angle|soft light|high detail|golden hour|"
          "the camera slowly pans|the camera zooms in|handheld camera|aerial view|"
          "film grain|studio lighting|natural colors|dramatic shadows").split("|")
FOREIGN = ["eine Katze läuft über die Straße", "ein Hund spielt im Garten", "über den Wolken",
           "un chat noir dort sur le canapé", "la forêt enchantée", "un café à Paris",
           "el perro corre en la playa", "la niña baila bajo la lluvia", "mañana por la mañana"]
WAN_NEG_ZH = ("色调艳丽，过曝，静态，细节模糊不清，字幕，风格，作品，画作，画面，静止，整体发灰，最差质量，"
              "低质量，JPEG压缩残留，丑陋的，残缺的，多余的手指，画得不好的手部，画得不好的脸部，畸形的，"
              "毁容的，形态畸形的肢体，手指融合，静止不动的画面，杂乱的背景，三条腿，背景人很多，倒着走")


def make_corpus():
    rng = random.Random(SP_SEED)
    lines = []
    for _ in range(3000):
        s = [rng.choice(["A", "a", "The", "the", "Two", "One", "Many"]), rng.choice(ADJS),
             rng.choice(SUBJECTS), rng.choice(VERBS), rng.choice(PLACES)]
        if rng.random() < 0.7:
            s.append(", " + rng.choice(STYLES))
        if rng.random() < 0.3:
            s.append(", " + rng.choice(STYLES))
        if rng.random() < 0.2:
            s.append(". " + rng.choice(FOREIGN))
        if rng.random() < 0.1:
            s.append(f" {rng.randint(0, 2030)}")
        lines.append(" ".join(s).replace(" ,", ",").replace(" .", ".") + rng.choice([".", "", "!"]))
    zh = WAN_NEG_ZH.split("，")
    for _ in range(300):
        lines.append("，".join(rng.sample(zh, rng.randint(3, 8))))
    lines += ["Bright tones, overexposed, static, blurred details, subtitles, worst quality, "
              "low quality, JPEG compression residue, ugly, incomplete, extra fingers"] * 20
    lines += ["Tom & Jerry \"cartoon\" 'style' <fast> (fun) [time] {x} #1 @home 50% $3 + - = / ;:?"] * 20
    return lines


def train_spiece():
    spm.set_random_generator_seed(SP_SEED)
    w = io.BytesIO()
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(make_corpus()), model_writer=w, model_type="unigram",
        vocab_size=PIECES, character_coverage=1.0, normalization_rule_name="nmt_nfkc",
        byte_fallback=True, pad_id=PAD_ID, eos_id=EOS_ID, bos_id=BOS_ID, unk_id=UNK_ID,
        pad_piece="<pad>", eos_piece="</s>", bos_piece="<s>", unk_piece="<unk>",
        num_threads=1, shuffle_input_sentence=False, input_sentence_size=0, minloglevel=2)
    return w.getvalue()


def added_token(content):
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False,
            "single_word": False, "special": True}


def tokenizer_files():
    extra = [f"<extra_id_{i}>" for i in range(EXTRA_IDS)]
    decoder = {"0": added_token("<pad>"), "1": added_token("</s>"), "2": added_token("<s>"),
               "3": added_token("<unk>")}
    for i in range(EXTRA_IDS):  # umT5: <extra_id_299> is the first id after the pieces
        decoder[str(PIECES + i)] = added_token(f"<extra_id_{EXTRA_IDS - 1 - i}>")
    config = {"added_tokens_decoder": decoder, "additional_special_tokens": extra,
              "bos_token": "<s>", "clean_up_tokenization_spaces": True, "eos_token": "</s>",
              "extra_ids": EXTRA_IDS, "legacy": True,
              "model_max_length": 1000000000000000019884624838656, "pad_token": "<pad>",
              "sp_model_kwargs": {}, "spaces_between_special_tokens": False,
              "tokenizer_class": "T5Tokenizer", "unk_token": "<unk>"}
    special = {"additional_special_tokens": extra, "bos_token": "<s>", "eos_token": "</s>",
               "pad_token": "<pad>", "unk_token": "<unk>"}
    return config, special


class T5TokenizerSlow:
    """transformers' T5Tokenizer (slow, legacy=True) __call__ restated for
    padding="max_length", truncation=True, add_special_tokens=True, return_attention_mask=True."""

    def __init__(self, model_bytes, config):
        self.sp = spm.SentencePieceProcessor(model_proto=model_bytes)
        # added tokens (PreTrainedTokenizer._added_tokens_encoder): content -> id
        self.added = {e["content"]: int(i) for i, e in config["added_tokens_decoder"].items()}

    def split_added(self, text):
        """PreTrainedTokenizer.tokenize's Trie split: leftmost, longest added-token match; the
        added tokens here all have lstrip / rstrip False, so neighbours are not stripped."""
        out, buf, i = [], "", 0
        by_len = sorted(self.added, key=len, reverse=True)
        while i < len(text):
            hit = next((t for t in by_len if text.startswith(t, i)), None)
            if hit is None:
                buf += text[i]
                i += 1
                continue
            if buf:
                out.append((buf, False))
                buf = ""
            out.append((hit, True))
            i += len(hit)
        if buf:
            out.append((buf, False))
        return out

    def pieces(self, text):
        toks = []
        for chunk, is_added in self.split_added(text):
            toks += [chunk] if is_added else self.sp.encode(chunk, out_type=str)  # legacy _tokenize
        return toks

    def token_ids(self, text):
        # convert_tokens_to_ids: added tokens by their id, pieces by sp.piece_to_id (unknown
        # surface strings -> unk id 3)
        ids = [self.added[t] if t in self.added else self.sp.piece_to_id(t) for t in self.pieces(text)]
        if "<" not in text:  # no added token possible: must equal sentencepiece's own ids
            assert ids == self.sp.encode(text), text
        return ids

    def encode(self, text, max_length):
        ids = self.token_ids(text)
        truncated = len(ids) + 1 > max_length  # num_special_tokens_to_add = 1 (</s>)
        if truncated:
            ids = ids[:max_length - 1]  # truncation_side right
        if not ids or ids[-1] != EOS_ID:  # _add_eos_if_not_present
            ids = ids + [EOS_ID]
        n = len(ids)
        return ids + [PAD_ID] * (max_length - n), [1] * n + [0] * (max_length - n), truncated

    def __call__(self, texts, padding=None, max_length=None, truncation=None,
                 add_special_tokens=None, return_attention_mask=None, return_tensors=None):
        assert (padding, truncation, add_special_tokens, return_attention_mask, return_tensors) == (
            "max_length", True, True, True, "pt")
        rows = [self.encode(t, max_length) for t in texts]

        class Out:
            input_ids = torch.tensor([r[0] for r in rows], dtype=torch.int64)
            attention_mask = torch.tensor([r[1] for r in rows], dtype=torch.int64)
        return Out()


# ---- 2. text encoder files ----------------------------------------------------------------------

def make_config():
    return {"architectures": ["UMT5EncoderModel"], "classifier_dropout": 0.0, "d_ff": FF,
            "d_kv": DKV, "d_model": D, "decoder_start_token_id": 0, "dense_act_fn": "gelu_new",
            "dropout_rate": 0.1, "eos_token_id": EOS_ID, "feed_forward_proj": "gated-gelu",
            "initializer_factor": 1.0, "is_encoder_decoder": True, "is_gated_act": True,
            "layer_norm_epsilon": EPS, "model_type": "umt5", "num_decoder_layers": L,
            "num_heads": H, "num_layers": L, "output_past": True, "pad_token_id": PAD_ID,
            "relative_attention_max_distance": MAX_DISTANCE,
            "relative_attention_num_buckets": NUM_BUCKETS, "scalable_attention": True,
            "tie_word_embeddings": False, "tokenizer_class": "T5Tokenizer",
            "torch_dtype": "float32", "transformers_version": "4.49.0.dev0", "use_cache": True,
            "vocab_size": V}


def state_dict_shapes():
    """UMT5EncoderModel.state_dict() order, minus the tied encoder.embed_tokens.weight."""
    s = {"shared.weight": (V, D)}
    for i in range(L):
        p = f"encoder.block.{i}.layer."
        s.update({p + "0.SelfAttention.q.weight": (H * DKV, D),
                  p + "0.SelfAttention.k.weight": (H * DKV, D),
                  p + "0.SelfAttention.v.weight": (H * DKV, D),
                  p + "0.SelfAttention.o.weight": (D, H * DKV),
                  p + "0.SelfAttention.relative_attention_bias.weight": (NUM_BUCKETS, H),
                  p + "0.layer_norm.weight": (D,),
                  p + "1.DenseReluDense.wi_0.weight": (FF, D),
                  p + "1.DenseReluDense.wi_1.weight": (FF, D),
                  p + "1.DenseReluDense.wo.weight": (D, FF),
                  p + "1.layer_norm.weight": (D,)})
    s["encoder.final_layer_norm.weight"] = (D,)
    return s


def make_weights():
    g = torch.Generator().manual_seed(SEED)
    w = {}
    for name, shape in state_dict_shapes().items():
        r = torch.randn(shape, generator=g, dtype=torch.float32)
        if name == "shared.weight":
            w[name] = r  # HF init: N(0, 1)
        elif name.endswith("layer_norm.weight"):
            w[name] = 1.0 + 0.1 * r
        elif name.endswith("relative_attention_bias.weight"):
            w[name] = 0.5 * r
        else:
            w[name] = 0.2 * r
    return w


# ---- 3. transcription of transformers' modeling_umt5.py (encoder) ------------------------------

def layer_norm(h, weight):  # UMT5LayerNorm
    variance = h.to(torch.float32).pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + EPS)
    if weight.dtype in (torch.float16, torch.bfloat16):
        h = h.to(weight.dtype)
    return weight * h


def gelu_new(x):  # NewGELUActivation
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def relative_position_bucket(relative_position):  # UMT5Attention._relative_position_bucket, encoder
    num_buckets = NUM_BUCKETS // 2
    buckets = (relative_position > 0).to(torch.long) * num_buckets
    relative_position = torch.abs(relative_position)
    max_exact = num_buckets // 2
    is_small = relative_position < max_exact
    log_ratio = torch.log(relative_position.float() / max_exact) / math.log(MAX_DISTANCE / max_exact)
    log_ratio = log_ratio * (num_buckets - max_exact)
    large = max_exact + log_ratio.to(torch.long)
    large = torch.min(large, torch.full_like(large, num_buckets - 1))
    return buckets + torch.where(is_small, relative_position, large)


def compute_bias(table, q_len, k_len):  # UMT5Attention.compute_bias -> [1, H, q, k]
    ctx = torch.arange(q_len, dtype=torch.long)[:, None]
    mem = torch.arange(k_len, dtype=torch.long)[None, :]
    values = F.embedding(relative_position_bucket(mem - ctx), table)
    return values.permute([2, 0, 1]).unsqueeze(0)


def umt5_encode(weights, input_ids, attention_mask=None, dtype=torch.float32):
    """UMT5EncoderModel(input_ids, attention_mask, output_hidden_states=True) -> dict with
    last_hidden_state, hidden_states (L + 1), last_block_output, position_bias (per block)."""
    w = {k: v.to(dtype) for k, v in weights.items()}
    B, S = input_ids.shape
    h = F.embedding(input_ids, w["shared.weight"])
    ext = None
    if attention_mask is not None:
        ext = attention_mask[:, None, None, :].to(dtype=h.dtype)
        ext = (1.0 - ext) * torch.finfo(h.dtype).min
    hidden_states, biases = [], []
    for i in range(L):
        hidden_states.append(h)
        p = f"encoder.block.{i}.layer."
        x = layer_norm(h, w[p + "0.layer_norm.weight"])
        q = F.linear(x, w[p + "0.SelfAttention.q.weight"]).view(B, -1, H, DKV).transpose(1, 2)
        k = F.linear(x, w[p + "0.SelfAttention.k.weight"]).view(B, -1, H, DKV).transpose(1, 2)
        v = F.linear(x, w[p + "0.SelfAttention.v.weight"]).view(B, -1, H, DKV).transpose(1, 2)
        scores = torch.matmul(q, k.transpose(3, 2))
        bias = compute_bias(w[p + "0.SelfAttention.relative_attention_bias.weight"], S, S)
        biases.append(bias)
        if ext is not None:
            bias = bias + ext
        scores = scores + bias
        attn = F.softmax(scores.float(), dim=-1).type_as(scores)
        ctx = torch.matmul(attn, v).transpose(1, 2).contiguous().view(B, S, -1)
        h = h + F.linear(ctx, w[p + "0.SelfAttention.o.weight"])
        x = layer_norm(h, w[p + "1.layer_norm.weight"])
        ff = gelu_new(F.linear(x, w[p + "1.DenseReluDense.wi_0.weight"])) * \
            F.linear(x, w[p + "1.DenseReluDense.wi_1.weight"])
        wo = w[p + "1.DenseReluDense.wo.weight"]
        if ff.dtype != wo.dtype:
            ff = ff.to(wo.dtype)
        h = h + F.linear(ff, wo)
    last_block = h
    h = layer_norm(h, w["encoder.final_layer_norm.weight"])
    hidden_states.append(h)
    return {"last_hidden_state": h, "hidden_states": hidden_states, "last_block_output": last_block,
            "position_bias": biases}


# ---- checks: Wan's t5.py structure in float64, a pure-Python bucket ----------------------------

def bucket_py(rel):
    n, base = abs(rel), (NUM_BUCKETS // 2 if rel > 0 else 0)
    half = NUM_BUCKETS // 2
    max_exact = half // 2
    if n < max_exact:
        return base + n
    return base + min(half - 1, max_exact + int(math.log(n / max_exact) / math.log(MAX_DISTANCE / max_exact)
                                                 * (half - max_exact)))


def wan_t5_encoder_f64(weights, ids, mask=None):
    """wan/modules/t5.py T5Encoder(shared_pos=False) restated in float64."""
    w = {k: v.double() for k, v in weights.items()}
    b, s = ids.shape
    x = w["shared.weight"][ids]
    rel = torch.arange(s)[None, :] - torch.arange(s)[:, None]
    bucket = torch.tensor([[bucket_py(int(r)) for r in row] for row in rel])

    def norm(t, wt):
        return wt * (t * torch.rsqrt(t.pow(2).mean(dim=-1, keepdim=True) + EPS))

    for i in range(L):
        p = f"encoder.block.{i}.layer."
        e = w[p + "0.SelfAttention.relative_attention_bias.weight"][bucket].permute(2, 0, 1)[None]
        y = norm(x, w[p + "0.layer_norm.weight"])
        q = (y @ w[p + "0.SelfAttention.q.weight"].T).view(b, -1, H, DKV)
        k = (y @ w[p + "0.SelfAttention.k.weight"].T).view(b, -1, H, DKV)
        v = (y @ w[p + "0.SelfAttention.v.weight"].T).view(b, -1, H, DKV)
        attn_bias = torch.zeros(b, H, s, s, dtype=torch.float64) + e
        if mask is not None:
            attn_bias.masked_fill_(mask.view(b, 1, 1, -1) == 0, torch.finfo(torch.float64).min)
        a = torch.einsum("binc,bjnc->bnij", q, k) + attn_bias
        a = F.softmax(a, dim=-1)
        o = torch.einsum("bnij,bjnc->binc", a, v).reshape(b, -1, H * DKV)
        x = x + o @ w[p + "0.SelfAttention.o.weight"].T
        y = norm(x, w[p + "1.layer_norm.weight"])
        g = y @ w[p + "1.DenseReluDense.wi_0.weight"].T
        g = 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g.pow(3.0))))
        x = x + ((y @ w[p + "1.DenseReluDense.wi_1.weight"].T) * g) @ w[p + "1.DenseReluDense.wo.weight"].T
    return norm(x, w["encoder.final_layer_norm.weight"])


def maxdiff(a, b, mask=None):
    d = (a.double() - b.double()).abs()
    if mask is not None:
        d = d[mask.bool()]
    return float(d.max()) if d.numel() else 0.0


# ---- 5. WanPipeline prompt encoding restated -----------------------------------------------------

WS = regex.compile(r"\s+")


def basic_clean(text):  # ftfy not installed (is_ftfy_available() False in refstack2)
    text = html.unescape(html.unescape(text))
    return text.strip()


def whitespace_clean(text):
    return WS.sub(" ", text).strip()


def prompt_clean(text):
    return whitespace_clean(basic_clean(text))


class Encoder:
    """What WanPipeline needs of its text_encoder: __call__(ids, mask).last_hidden_state, .dtype."""

    def __init__(self, weights, dtype):
        self.weights, self.dtype = weights, dtype

    def __call__(self, input_ids, attention_mask):
        out = umt5_encode(self.weights, input_ids, attention_mask, self.dtype)

        class Out:
            last_hidden_state = out["last_hidden_state"]
        return Out()


def get_t5_prompt_embeds(tok, enc, prompt, n, msl):
    prompt = [prompt] if isinstance(prompt, str) else prompt
    cleaned = [prompt_clean(p) for p in prompt]
    t = tok(cleaned, padding="max_length", max_length=msl, truncation=True, add_special_tokens=True,
            return_attention_mask=True, return_tensors="pt")
    seq_lens = t.attention_mask.gt(0).sum(dim=1).long()
    h = enc(t.input_ids, t.attention_mask).last_hidden_state.to(dtype=enc.dtype)
    out = torch.zeros(len(prompt), msl, D, dtype=h.dtype)
    for b, s in enumerate(seq_lens.tolist()):
        out[b, :s] = h[b, :s]
    out = out.repeat(1, n, 1).view(len(prompt) * n, msl, -1)  # rows p0 x n, p1 x n, ...
    return out, {"cleaned": cleaned, "input_ids": t.input_ids, "attention_mask": t.attention_mask,
                 "seq_lens": seq_lens.tolist()}


def encode_prompt(tok, enc, prompt, negative_prompt, cfg, n, msl):
    prompt = [prompt] if isinstance(prompt, str) else prompt
    pe, info = get_t5_prompt_embeds(tok, enc, prompt, n, msl)
    ne, ninfo = None, None
    if cfg:
        negative_prompt = negative_prompt or ""
        negative_prompt = len(prompt) * [negative_prompt] if isinstance(negative_prompt, str) else negative_prompt
        assert type(prompt) is type(negative_prompt) and len(prompt) == len(negative_prompt)
        ne, ninfo = get_t5_prompt_embeds(tok, enc, negative_prompt, n, msl)
    return pe, ne, info, ninfo


LONG_PROMPT = ("A golden retriever puppy runs across a sunny meadow full of yellow flowers, the camera "
               "slowly pans to follow it, cinematic lighting, high detail, 4k video")
CASES = {
    "plain": dict(prompt="A fluffy cat walks on the grass, realistic style.", negative_prompt=None,
                  do_classifier_free_guidance=True, num_videos_per_prompt=1, max_sequence_length=512),
    "html_entities": dict(prompt="Tom &amp; Jerry chase each other &lt;fast&gt; &quot;cartoon&quot; "
                                 "&#39;style&#39; &amp;amp; fun&nbsp;time &#x41;",
                          negative_prompt="low &amp;amp; bad", do_classifier_free_guidance=True,
                          num_videos_per_prompt=1, max_sequence_length=512),
    "whitespace": dict(prompt="  a   dog\trunning \n\n on the   beach\u3000 ", negative_prompt="blurry,   low quality ",
                       do_classifier_free_guidance=True, num_videos_per_prompt=1, max_sequence_length=512),
    "empty": dict(prompt="", negative_prompt=None, do_classifier_free_guidance=True,
                  num_videos_per_prompt=1, max_sequence_length=512),
    "batch3_x2": dict(prompt=["a red car drives in the city street", "Two birds fly over the lake, golden hour",
                              "un chat noir dort sur le canapé"],
                      negative_prompt=["色调艳丽，过曝，静态，细节模糊不清，字幕", "blurry", ""],
                      do_classifier_free_guidance=True, num_videos_per_prompt=2, max_sequence_length=512),
    "msl16": dict(prompt=[LONG_PROMPT, "a cat"], negative_prompt="worst quality, low quality",
                  do_classifier_free_guidance=True, num_videos_per_prompt=1, max_sequence_length=16),
    "no_cfg_x3": dict(prompt="a panda eats bamboo", negative_prompt=None,
                      do_classifier_free_guidance=False, num_videos_per_prompt=3, max_sequence_length=512),
    "plain_bf16": dict(prompt="A fluffy cat walks on the grass, realistic style.", negative_prompt=None,
                       do_classifier_free_guidance=True, num_videos_per_prompt=1, max_sequence_length=512,
                       dtype="bfloat16"),
}
TOKENIZER_ONLY = [
    "a cat", "", "  A  fluffy   cat\t", "ＡＢＣ ﬁne ① ½", "日本の猫 🐱 smile", "café naïve Zürich",
    "a <extra_id_0> dog", "a cat</s>", "<pad> x <unk>", WAN_NEG_ZH, LONG_PROMPT,
]


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tiny = os.path.join(out, "tiny_wan")
    tok_dir, te_dir = os.path.join(tiny, "tokenizer"), os.path.join(tiny, "text_encoder")
    os.makedirs(tok_dir, exist_ok=True)
    os.makedirs(te_dir, exist_ok=True)
    checks = {}

    # 1. tokenizer
    model_bytes = train_spiece()
    again = train_spiece()
    assert model_bytes == again, "SentencePiece training is not deterministic"
    checks["spiece_retrain_identical"] = True
    with open(os.path.join(tok_dir, "spiece.model"), "wb") as f:
        f.write(model_bytes)
    tcfg, special = tokenizer_files()
    write_json(os.path.join(tok_dir, "tokenizer_config.json"), tcfg)
    write_json(os.path.join(tok_dir, "special_tokens_map.json"), special)
    tok = T5TokenizerSlow(model_bytes, tcfg)
    sp = tok.sp
    assert sp.get_piece_size() == PIECES
    assert (sp.pad_id(), sp.eos_id(), sp.bos_id(), sp.unk_id()) == (PAD_ID, EOS_ID, BOS_ID, UNK_ID)

    # 2. text encoder
    cfg = make_config()
    write_json(os.path.join(te_dir, "config.json"), cfg)
    w = make_weights()
    save_st(os.path.join(te_dir, "model.safetensors"), w)

    # 4. text_encoder_expected
    prompts = ["a fluffy cat walks on the grass", LONG_PROMPT, ""]
    S = 20
    rows = [tok.encode(prompt_clean(p), S) for p in prompts]
    ids = torch.tensor([r[0] for r in rows])
    amask = torch.tensor([r[1] for r in rows])
    lengths = amask.sum(1).tolist()
    res = umt5_encode(w, ids, amask)
    exp = {"input_ids": ids, "attention_mask": amask, "last_block_output": res["last_block_output"],
           "last_hidden_state": res["last_hidden_state"].clone()}
    for k, hs in enumerate(res["hidden_states"]):
        exp[f"hidden_states.{k}"] = hs
    for i, b in enumerate(res["position_bias"]):
        exp[f"position_bias.{i}"] = b
    ref = wan_t5_encoder_f64(w, ids, amask)
    checks["padded_vs_wan_f64_real_positions"] = maxdiff(res["last_hidden_state"], ref, amask)
    checks["padded_vs_wan_f64_all_positions"] = maxdiff(res["last_hidden_state"], ref)
    alone = 0.0
    for bi, n in enumerate(lengths):
        one = umt5_encode(w, ids[bi:bi + 1, :n], None)["last_hidden_state"][0]
        alone = max(alone, maxdiff(one, res["last_hidden_state"][bi, :n]))
    checks["padded_rows_alone_vs_batch"] = alone
    nomask = umt5_encode(w, ids, None)["last_hidden_state"]
    exp["last_hidden_state_nomask"] = nomask
    checks["nomask_vs_wan_f64"] = maxdiff(nomask, wan_t5_encoder_f64(w, ids, None))
    checks["nomask_vs_mask_real_positions (the mask matters)"] = maxdiff(nomask, res["last_hidden_state"], amask)
    bf = umt5_encode(w, ids, amask, torch.bfloat16)["last_hidden_state"]
    exp["last_hidden_state_bf16"] = bf.float()
    checks["bf16_vs_float32_real_positions"] = maxdiff(bf, res["last_hidden_state"], amask)
    checks["float32_max_abs_real_positions"] = float(res["last_hidden_state"][amask.bool()].abs().max())

    # unpadded case
    ids_np = torch.tensor([tok.encode(prompt_clean("Two birds fly over the lake, golden hour"), 64)[0]])
    n_np = int((ids_np != PAD_ID).sum())
    ids_np = ids_np[:, :n_np]
    r_np = umt5_encode(w, ids_np, None)
    exp["input_ids_nopad"] = ids_np
    exp["last_hidden_state_nopad"] = r_np["last_hidden_state"]
    checks["nopad_vs_wan_f64"] = maxdiff(r_np["last_hidden_state"], wan_t5_encoder_f64(w, ids_np))
    checks["nopad_ones_mask_vs_none"] = maxdiff(
        umt5_encode(w, ids_np, torch.ones_like(ids_np))["last_hidden_state"], r_np["last_hidden_state"])

    # long case: distances up to 199 (buckets 15 / 31), 150 + 200 real tokens
    g = torch.Generator().manual_seed(SEED + 1)
    SL = 200
    ids_l = torch.zeros(2, SL, dtype=torch.int64)
    mask_l = torch.zeros(2, SL, dtype=torch.int64)
    for bi, n in enumerate([150, 200]):
        ids_l[bi, :n - 1] = torch.randint(4, PIECES, (n - 1,), generator=g)
        ids_l[bi, n - 1] = EOS_ID
        mask_l[bi, :n] = 1
    r_l = umt5_encode(w, ids_l, mask_l)
    exp["input_ids_long"], exp["attention_mask_long"] = ids_l, mask_l
    exp["last_hidden_state_long"] = r_l["last_hidden_state"]
    checks["long_vs_wan_f64_real_positions"] = maxdiff(r_l["last_hidden_state"], wan_t5_encoder_f64(w, ids_l, mask_l), mask_l)

    rel = torch.arange(-600, 601, dtype=torch.int64)
    bk = relative_position_bucket(rel)
    exp["bucket_relative_position"], exp["bucket"] = rel, bk
    checks["bucket_vs_python_float64_-600..600_mismatches"] = int(sum(
        int(b) != bucket_py(int(r)) for r, b in zip(rel, bk)))
    save_st(os.path.join(out, "text_encoder_expected.safetensors"), exp)

    # 5. prompts
    # Flip Diffusers' transformers-availability flag before diffusers.loaders is imported, so the
    # Wan pipeline module imports (refstack2's transformers is a stub; nothing of it runs).
    import diffusers.utils.import_utils as _iu
    assert "diffusers.loaders" not in sys.modules
    _iu._transformers_available, _iu._transformers_version = True, "4.57.0"
    from diffusers.pipelines.wan import pipeline_wan
    assert not pipeline_wan.is_ftfy_available()
    pipe = pipeline_wan.WanPipeline.__new__(pipeline_wan.WanPipeline)
    emb, cases_json = {}, {}
    dev = torch.device("cpu")
    for name, c in CASES.items():
        dtype = torch.bfloat16 if c.get("dtype") == "bfloat16" else torch.float32
        enc = Encoder(w, dtype)
        args = {k: v for k, v in c.items() if k != "dtype"}
        pe, ne, info, ninfo = encode_prompt(tok, enc, args["prompt"], args["negative_prompt"],
                                            args["do_classifier_free_guidance"],
                                            args["num_videos_per_prompt"], args["max_sequence_length"])
        pipe.__dict__.update(tokenizer=tok, text_encoder=enc)
        dpe, dne = pipe.encode_prompt(**args, device=dev)
        assert torch.equal(dpe, pe) and ((dne is None and ne is None) or torch.equal(dne, ne)), name
        for p in ([args["prompt"]] if isinstance(args["prompt"], str) else args["prompt"]):
            assert pipeline_wan.prompt_clean(p) == prompt_clean(p)
        emb[f"{name}.prompt_embeds"] = pe.float()
        emb[f"{name}.input_ids"] = info["input_ids"]
        emb[f"{name}.attention_mask"] = info["attention_mask"]
        entry = {"arguments": args, "dtype": str(dtype).replace("torch.", ""),
                 "cleaned_prompts": info["cleaned"], "seq_lens": info["seq_lens"],
                 "ids": [r[:s].tolist() for r, s in zip(info["input_ids"], info["seq_lens"])],
                 "pieces": [tok.pieces(p) for p in info["cleaned"]],
                 "prompt_embeds_shape": list(pe.shape),
                 "prompt_embeds_row_source": [b for b in range(len(info["seq_lens"]))
                                              for _ in range(args["num_videos_per_prompt"])]}
        if ne is not None:
            emb[f"{name}.negative_prompt_embeds"] = ne.float()
            emb[f"{name}.negative_input_ids"] = ninfo["input_ids"]
            emb[f"{name}.negative_attention_mask"] = ninfo["attention_mask"]
            entry.update({"negative_cleaned_prompts": ninfo["cleaned"], "negative_seq_lens": ninfo["seq_lens"],
                          "negative_ids": [r[:s].tolist() for r, s in zip(ninfo["input_ids"], ninfo["seq_lens"])],
                          "negative_prompt_embeds_shape": list(ne.shape)})
        else:
            entry["negative_prompt_embeds"] = None
        # the embeddings beyond each row's length are exactly zero
        for key in ("prompt_embeds", "negative_prompt_embeds"):
            t = emb.get(f"{name}.{key}")
            if t is not None:
                lens = info["seq_lens"] if key == "prompt_embeds" else ninfo["seq_lens"]
                for r in range(t.shape[0]):
                    assert not t[r, lens[r // args["num_videos_per_prompt"]]:].any()
        cases_json[name] = entry
    checks["diffusers_encode_prompt_equal"] = True
    # plain vs plain_bf16 (same prompt)
    checks["prompt_embeds_bf16_vs_float32"] = maxdiff(emb["plain_bf16.prompt_embeds"], emb["plain.prompt_embeds"])

    tok_cases = []
    for text in TOKENIZER_ONLY:
        ids32, m32, tr = tok.encode(text, 32)
        tok_cases.append({"text": text, "pieces": tok.pieces(text), "token_ids": tok.token_ids(text),
                          "input_ids_32": ids32, "truncated_32": tr, "seq_len_32": sum(m32),
                          "sentencepiece_encode": sp.encode(text),
                          "splits_added_tokens": any(a for _, a in tok.split_added(text))})
    ws_regex = [cp for cp in range(0x110000) if WS.fullmatch(chr(cp))]
    ws_strip = [cp for cp in range(0x110000) if chr(cp).isspace()]
    import diffusers
    doc = {
        "pipeline": "WanPipeline._get_t5_prompt_embeds + encode_prompt",
        "diffusers_version": diffusers.__version__,
        "ftfy_available": False,
        "cases": cases_json,
        "tokenizer_cases": tok_cases,
        "tokenizer_cases_note": ("T5Tokenizer (slow, legacy) ids with max_length 32; splits_added_tokens marks "
                                 "texts where transformers splits out <pad> / </s> / <s> / <unk> / <extra_id_N> "
                                 "before SentencePiece (sentencepiece_encode is SentencePiece on the whole text)"),
        "regex_whitespace_codepoints": ws_regex,
        "str_isspace_codepoints": ws_strip,
        "spiece_sha256": hashlib.sha256(model_bytes).hexdigest(),
        "checks": checks,
        "storage_note": ("prompt_embeds.safetensors: <case>.prompt_embeds [B*n, msl, 32], "
                         "<case>.negative_prompt_embeds (when CFG), <case>.input_ids / .attention_mask and "
                         "<case>.negative_input_ids / .negative_attention_mask [B, msl] int64; bf16 cases stored as float32"),
    }
    save_st(os.path.join(out, "prompt_embeds.safetensors"), emb)
    write_json(os.path.join(out, "prompts_expected.json"), doc)
    for k, v in checks.items():
        print(f"{k}: {v}")
    print("pieces of the padded batch:", lengths)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_text_encoder.py OUT_DIR  (tests/golden/wan)")
    main(sys.argv[1])
