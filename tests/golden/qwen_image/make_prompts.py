#!/usr/bin/env python3
"""Makes tests/golden/qwen_image/tokenizer/ (Qwen-Image's tokenizer folder: Qwen2.5-VL's
Qwen2Tokenizer over the tiny vocabulary of tests/golden/z_image/tokenizer/),
prompts_expected.json and prompt_embeds.safetensors: QwenImagePipeline.encode_prompt from prompt
STRINGS with the tiny text encoder of text_encoder/ (make_text_encoder.py; re-making it means
re-making this), and the Edit pipelines' prompt texts.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0, python3-regex, python3-jinja2):
    ../shared/refstack2/run python3 tests/golden/qwen_image/make_prompts.py tests/golden/qwen_image
Re-running writes byte-identical files (float32 on one CPU thread, safetensors with sorted keys,
JSON with sorted keys).

tokenizer/: vocab.json, merges.txt and tokenizer.json are relative symlinks to
../../z_image/tokenizer/ (the same 656 BPE tokens, 400 merges and 18 added tokens ids 656..673;
Qwen2.5-VL's own list differs only in its tail: it has <|fim_*|>, <|repo_name|>, <|file_sep|> and
no <think> / </think>, which no prompt here uses). tokenizer_config.json is Qwen2.5-VL-7B-
Instruct's (= Qwen-Image's tokenizer/): tokenizer_class Qwen2Tokenizer, its 13
additional_special_tokens, eos <|im_end|>, pad <|endoftext|>, bos / unk null, model_max_length
131072, no padding_side key (so "right"), errors "replace", and its chat template (the Qwen2-VL one
with image / video placeholders and `add_vision_id` "Picture N: " prefixes; byte-identical to the
official one, whose json.dumps hashes to sha256 4df95d05...; make_chat_template.QWEN2_VL_TEMPLATE);
added_tokens_decoder is the tiny tokenizer's (ids 656..673).

QwenImagePipeline._get_qwen_prompt_embeds + encode_prompt, restated in plain Python:
  1. txt = prompt_template_encode.format(p) for each prompt (no chat template is applied: the
     pipeline formats its own string "<|im_start|>system\\nDescribe the image by detailing the
     color, shape, size, texture, quantity, text, spatial relationships of the objects and
     background:<|im_end|>\\n<|im_start|>user\\n{}<|im_end|>\\n<|im_start|>assistant\\n");
  2. tokenizer(txt, max_length=tokenizer_max_length + drop_idx = 1024 + 34 = 1058, padding=True,
     truncation=True): the byte-level BPE of tests/golden/z_image/make_tokenizer.py (added tokens
     split out first, NFC, Qwen's pattern, merges by rank), no special tokens added, cut on the
     right to 1058 ids, padded on the right to the batch's longest with <|endoftext|> (656),
     attention mask 1 / 0 (int64);
  3. text_encoder(input_ids, attention_mask, output_hidden_states=True).hidden_states[-1] (the
     final-norm output) for the whole padded batch at once (make_text_encoder.text_forward);
  4. per prompt its hidden states at mask == 1 (hidden_states[mask.bool()] split by the lengths),
     minus the first drop_idx = prompt_template_encode_start_idx = 34 rows; re-padded on the right
     with ZEROS to the longest kept length, with an int64 mask of 1 / 0 ->
     (prompt_embeds [B, Lk, 64], prompt_embeds_mask [B, Lk]);
  5. encode_prompt: prompt_embeds[:, :max_sequence_length], then
     prompt_embeds.repeat(1, n, 1).view(B * n, Lk', 64) (rows p0, p0, p1, p1, ...) and
     prompt_embeds_mask[:, :max_sequence_length].repeat(1, n, 1).view(B * n, Lk') -- a 2-D mask
     given 3 repeat factors is treated as [1, B, Lk'], so its rows come out p0, p1, p0, p1: NOT the
     embeddings' order when B > 1 and n > 1 (Diffusers' own behaviour, reproduced; case
     `batch2_x2`) -- and a mask that is all ones becomes None.
The drop of 34 counts REAL Qwen tokens of the system prefix ("<|im_start|>system\\n...:<|im_end|>\\n
<|im_start|>user\\n" is 34 ids in Qwen2.5-VL's 151k vocabulary); with the tiny vocabulary that
prefix is 104 ids, so the kept embeddings still start with 70 ids of the system text. That is what
the pipeline does with this tokenizer (the index is a constant, not searched for); the JSON records
the dropped and the first kept text.

Edit pipelines (text and ids only, for a later vision-tower task): QwenImageEditPipeline formats
its template (a longer system prompt, then "<|vision_start|><|image_pad|><|vision_end|>" before the
prompt; drop_idx 64, with the tiny vocabulary the system prefix is 228 ids); QwenImageEditPlusPipeline puts "Picture {i}: <|vision_start|>
<|image_pad|><|vision_end|>" for each image i = 1.. before the prompt (template without vision
tokens, drop_idx 64). Both hand the text to Qwen2_5_VLProcessor(text=txt, images=image,
padding=True) -- no truncation -- which expands each <|image_pad|> to grid_t * grid_h * grid_w / 4
copies before tokenizing; recorded here: the text and ids with ONE <|image_pad|> per image.

Checks (the outputs do not depend on them):
  (a) the templates, drop indices and tokenizer_max_length equal the pipelines' attributes;
  (b) Diffusers' OWN QwenImagePipeline.encode_prompt (unmodified, built with
      text_encoder / tokenizer stand-ins: the tokenizer and forward above behind the two calls the
      pipeline makes, vae / transformer / scheduler None) returns exactly the same embeddings and
      mask (or None) for every case;
  (c) Diffusers' own Edit / Edit Plus _get_qwen_prompt_embeds hand the processor exactly the
      recorded texts (a processor stand-in captures `text` and stops the call);
  (d) the text encoder folder holds make_text_encoder.make_weights() and its config;
  (e) each prompt encoded alone (its own unpadded ids) gives the batch's embeddings to 1e-5.
"""
import json
import os
import re
import sys

import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
Z_IMAGE = os.path.join(HERE, "..", "z_image")
sys.path.insert(0, HERE)
sys.path.insert(0, Z_IMAGE)
import make_chat_template  # noqa: E402  (the Qwen2-VL chat template, official text)
import make_text_encoder  # noqa: E402  (plain-torch Qwen2.5-VL language model)
import make_tokenizer  # noqa: E402  (plain-Python byte-level BPE; tests/golden/z_image/)

# Flip Diffusers' transformers-availability flag before diffusers.loaders is imported, so the
# Qwen-Image pipeline modules import (refstack2's transformers is a stub; nothing of it runs).
import diffusers.utils.import_utils as _iu  # noqa: E402
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"

import diffusers  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import QwenImageEditPipeline  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus import QwenImageEditPlusPipeline  # noqa: E402

# pipeline_qwenimage.py, QwenImagePipeline.__init__ (checked against the instance: (a))
TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, "
            "quantity, text, spatial relationships of the objects and background:<|im_end|>\n"
            "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n")
DROP_IDX, TOKENIZER_MAX_LENGTH = 34, 1024
EDIT_SYSTEM = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, "
               "size, texture, objects, background), then explain how the user's text instruction "
               "should alter or modify the image. Generate a new image that meets the user's "
               "requirements while maintaining consistency with the original input where "
               "appropriate.<|im_end|>\n<|im_start|>user\n")
EDIT_TEMPLATE = EDIT_SYSTEM + "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PLUS_TEMPLATE = EDIT_SYSTEM + "{}<|im_end|>\n<|im_start|>assistant\n"
EDIT_PLUS_IMG = "Picture {}: <|vision_start|><|image_pad|><|vision_end|>"
EDIT_DROP_IDX = 64

LONG = ("A sprawling cyberpunk city at night, neon signs reflected in rain puddles, flying cars "
        "between glass towers, cinematic lighting, 8k")
CASES = [
    dict(name="single", prompt=["a photo of a cat sitting on a red chair"],
         num_images_per_prompt=1, max_sequence_length=1024),
    dict(name="empty", prompt=[""], num_images_per_prompt=1, max_sequence_length=1024),
    dict(name="cjk_emoji", prompt=["一只可爱的小猫坐在窗台上 🐱🎉 東京の夜景"],
         num_images_per_prompt=1, max_sequence_length=1024),
    # three lengths: padding in the tokenizer batch and in the re-padded embeddings, mask kept
    dict(name="batch3", prompt=["a cat", "", "小狗在山上跑，月亮很圆。 A dog runs on the hill 🌕"],
         num_images_per_prompt=1, max_sequence_length=1024),
    # two images per prompt with unequal lengths: the mask's rows come out p0, p1, p0, p1
    dict(name="batch2_x2", prompt=["red fox", "a blue bird on a branch"],
         num_images_per_prompt=2, max_sequence_length=1024),
    # max_sequence_length 8 cuts the kept embeddings (still inside the system text here)
    dict(name="cut8", prompt=[LONG], num_images_per_prompt=1, max_sequence_length=8),
    # padded batch, then the cut leaves no padding: the mask becomes None (3 images per prompt)
    dict(name="batch2_cut8", prompt=["a cat", "a red fox in the snow"], num_images_per_prompt=3,
         max_sequence_length=8),
    # the rendered text exceeds tokenizer_max_length + drop_idx = 1058 ids: the tokenizer cuts it
    # (template tail included), leaving exactly 1024 kept embeddings
    dict(name="truncated_1058", prompt=["word " * 400], num_images_per_prompt=1,
         max_sequence_length=1024),
]
EDIT_PROMPTS = ["Make the cat wear a red hat", "把天空变成紫色 🌌"]


# ---- tokenizer folder ------------------------------------------------------------------------------

def write_tokenizer_folder(out):
    tok_dir = os.path.join(out, "tokenizer")
    os.makedirs(tok_dir, exist_ok=True)
    for name in ("vocab.json", "merges.txt", "tokenizer.json"):
        link = os.path.join(tok_dir, name)
        target = os.path.join("..", "..", "z_image", "tokenizer", name)
        if os.path.islink(link) and os.readlink(link) == target:
            continue
        if os.path.lexists(link):
            os.remove(link)
        os.symlink(target, link)
    with open(os.path.join(Z_IMAGE, "tokenizer", "tokenizer_config.json"), encoding="utf-8") as f:
        z = json.load(f)
    added = z["added_tokens_decoder"]
    specials = [e["content"] for _, e in sorted(added.items(), key=lambda kv: int(kv[0]))
                if e["special"] and e["content"] != "<|endoftext|>"]
    assert specials == make_tokenizer.SPECIAL[1:]  # Qwen2.5-VL's 13 additional special tokens
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "additional_special_tokens": specials,
        "bos_token": None,
        "chat_template": make_chat_template.QWEN2_VL_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    with open(os.path.join(tok_dir, "tokenizer_config.json"), "w", encoding="utf-8",
              newline="\n") as f:
        f.write(json.dumps(cfg, ensure_ascii=False, indent=2, sort_keys=True) + "\n")
    return tok_dir


class Encoding:
    def __init__(self, input_ids, attention_mask):
        self.input_ids, self.attention_mask = input_ids, attention_mask

    def to(self, device):
        return self


class Tokenizer:
    """The call QwenImagePipeline._get_qwen_prompt_embeds makes on its Qwen2Tokenizer."""

    def __init__(self, tok_dir):
        with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        with open(os.path.join(tok_dir, "vocab.json"), encoding="utf-8") as f:
            self.vocab = json.load(f)
        with open(os.path.join(tok_dir, "merges.txt"), encoding="utf-8") as f:
            merges = [tuple(line.rstrip("\n").split(" ")) for line in f if not line.startswith("#")]
        self.ranks = {pair: r for r, pair in enumerate(merges)}
        self.added = {e["content"]: int(i) for i, e in cfg["added_tokens_decoder"].items()}
        assert not cfg["add_bos_token"] and cfg.get("padding_side", "right") == "right"
        self.pad_token = cfg["pad_token"]
        self.pad_id = self.added[self.pad_token]
        self.id_to_token = {i: t for t, i in self.vocab.items()}
        self.id_to_token.update({i: t for t, i in self.added.items()})
        self.byte_decoder = {c: b for b, c in make_tokenizer.BYTE_ENCODER.items()}

    def encode(self, text):  # no special tokens added
        return make_tokenizer.encode(text, self.vocab, self.ranks, self.added)

    def decode(self, ids):
        out, buf = [], bytearray()
        for i in ids:
            t = self.id_to_token[i]
            if i in self.added.values():
                out.append(buf.decode("utf-8", errors="replace"))
                buf = bytearray()
                out.append(t)
            else:
                buf.extend(self.byte_decoder[c] for c in t)
        out.append(buf.decode("utf-8", errors="replace"))
        return "".join(out)

    def __call__(self, texts, max_length, padding, truncation, return_tensors):
        assert padding is True and truncation is True and return_tensors == "pt"
        enc = [self.encode(t)[:max_length] for t in texts]  # truncation_side "right"
        S = max(len(e) for e in enc)  # padding=True: to the longest in the batch
        ids = torch.full((len(texts), S), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(texts), S), dtype=torch.int64)
        for i, e in enumerate(enc):
            ids[i, :len(e)] = torch.tensor(e, dtype=torch.int64)  # padding_side "right"
            mask[i, :len(e)] = 1
        return Encoding(ids, mask)


# ---- text encoder -------------------------------------------------------------------------------

def load_text_encoder(te_dir):
    with open(os.path.join(te_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    w = {}
    for shard in sorted(set(index["weight_map"].values())):
        w.update(load_file(os.path.join(te_dir, shard)))
    assert set(w) == set(index["weight_map"])
    with open(os.path.join(te_dir, "config.json")) as f:
        cfg = json.load(f)
    assert cfg == make_text_encoder.make_config()  # (d)
    made = make_text_encoder.make_weights()
    assert set(made) == set(w) and all(torch.equal(made[k], w[k]) for k in w)
    return w, cfg


class TextEncoder:
    """Qwen2_5_VLForConditionalGeneration(input_ids, attention_mask, output_hidden_states=True)."""
    dtype = torch.float32

    def __init__(self, w, cfg):
        self.w, self.cfg, self.calls = w, cfg, []

    def __call__(self, input_ids, attention_mask, output_hidden_states):
        assert output_hidden_states
        self.calls.append((input_ids.clone(), attention_mask.clone()))
        with torch.no_grad():
            hs, _, _ = make_text_encoder.text_forward(self.w, self.cfg, input_ids, attention_mask)
        return type("Out", (), {"hidden_states": tuple(hs)})()


# ---- plain restatement -----------------------------------------------------------------------------

def get_qwen_prompt_embeds(tok, te, prompts):
    txt = [TEMPLATE.format(p) for p in prompts]
    enc = tok(txt, max_length=TOKENIZER_MAX_LENGTH + DROP_IDX, padding=True, truncation=True,
              return_tensors="pt")
    hidden = te(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                output_hidden_states=True).hidden_states[-1]
    kept = [hidden[i][enc.attention_mask[i].bool()][DROP_IDX:] for i in range(len(prompts))]
    Lk = max(k.shape[0] for k in kept)
    embeds = torch.zeros(len(prompts), Lk, hidden.shape[-1])
    mask = torch.zeros(len(prompts), Lk, dtype=torch.int64)
    for i, k in enumerate(kept):
        embeds[i, :k.shape[0]] = k
        mask[i, :k.shape[0]] = 1
    return txt, enc, embeds, mask


def encode_prompt(embeds, mask, n, max_sequence_length):
    B = embeds.shape[0]
    e = embeds[:, :max_sequence_length]
    m = mask[:, :max_sequence_length]
    Lk = e.shape[1]
    e = e.repeat_interleave(n, dim=0)  # p0, p0, p1, p1 (== repeat(1, n, 1).view(B * n, Lk, -1))
    m = m.repeat(n, 1)  # p0, p1, p0, p1 (== repeat(1, n, 1).view(B * n, Lk) on a 2-D mask)
    assert e.shape[0] == m.shape[0] == B * n
    return e, (None if bool(m.all()) else m)


_SCALAR = r"(?:-?\d+|null|true|false)"


def compact_scalar_lists(text):
    """indent=2 JSON with every list of plain integers (or null / booleans) on one line."""
    return re.sub(r"\[\n\s+(" + _SCALAR + r"(?:,\n\s+" + _SCALAR + r")*)\n\s*\]",
                  lambda m: "[" + ", ".join(x.strip() for x in m.group(1).split(",")) + "]", text)


class _Stop(Exception):
    pass


class ProcessorProbe:
    """Captures the text an Edit pipeline hands its Qwen2_5_VLProcessor, then stops the call."""

    def __call__(self, text, images=None, padding=None, return_tensors=None):
        self.text, self.padding, self.n_images = text, padding, len(images) if isinstance(images, list) else images
        raise _Stop()


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()

    tok_dir = write_tokenizer_folder(out)
    tok = Tokenizer(tok_dir)
    w, cfg = load_text_encoder(os.path.join(out, "text_encoder"))
    te = TextEncoder(w, cfg)

    pipe = QwenImagePipeline(scheduler=None, vae=None, text_encoder=te, tokenizer=tok, transformer=None)
    # (a) the constants are the pipeline's
    assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx,
            pipe.tokenizer_max_length) == (TEMPLATE, DROP_IDX, TOKENIZER_MAX_LENGTH)
    edit = QwenImageEditPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None,
                                 processor=ProcessorProbe(), transformer=None)
    plus = QwenImageEditPlusPipeline(scheduler=None, vae=None, text_encoder=None, tokenizer=None,
                                     processor=ProcessorProbe(), transformer=None)
    assert (edit.prompt_template_encode, edit.prompt_template_encode_start_idx) == (EDIT_TEMPLATE, EDIT_DROP_IDX)
    assert (plus.prompt_template_encode, plus.prompt_template_encode_start_idx) == (EDIT_PLUS_TEMPLATE, EDIT_DROP_IDX)

    prefix_ids = tok.encode(TEMPLATE.split("{}")[0])
    tensors, cases = {}, {}
    max_alone = 0.0
    for case in CASES:
        name, prompts = case["name"], case["prompt"]
        n, msl = case["num_images_per_prompt"], case["max_sequence_length"]
        te.calls.clear()
        txt, enc, g_e, g_m = get_qwen_prompt_embeds(tok, te, prompts)
        final_e, final_m = encode_prompt(g_e, g_m, n, msl)
        # (b) Diffusers' own encode_prompt through the stand-ins
        with torch.no_grad():
            d_e, d_m = pipe.encode_prompt(list(prompts), device=torch.device("cpu"),
                                          num_images_per_prompt=n, max_sequence_length=msl)
        assert torch.equal(d_e, final_e), name
        assert (d_m is None and final_m is None) or torch.equal(d_m, final_m), name
        assert len(te.calls) == 2 and all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
                                          for a, b in [(te.calls[0], te.calls[1])])
        # (e) each prompt alone
        for i in range(len(prompts)):
            _, _, a_e, _ = get_qwen_prompt_embeds(tok, te, [prompts[i]])
            k = int(g_m[i].sum())
            assert a_e.shape[1] == k
            max_alone = max(max_alone, (a_e[0] - g_e[i, :k]).abs().max().item())
        full = [tok.encode(t) for t in txt]
        real = [int(m.sum()) for m in enc.attention_mask]
        same = torch.equal(final_e, g_e) and (
            bool(g_m.all()) if final_m is None else torch.equal(final_m, g_m))
        tensors[f"{name}.input_ids"] = enc.input_ids
        tensors[f"{name}.attention_mask"] = enc.attention_mask
        tensors[f"{name}.get.prompt_embeds"] = g_e
        tensors[f"{name}.get.prompt_embeds_mask"] = g_m
        if not same:
            tensors[f"{name}.prompt_embeds"] = final_e
            if final_m is not None:
                tensors[f"{name}.prompt_embeds_mask"] = final_m
        cases[name] = {
            "arguments": {"prompt": prompts, "num_images_per_prompt": n, "max_sequence_length": msl},
            "rendered": txt,
            "ids": [e[:r].tolist() for e, r in zip(enc.input_ids, real)],
            "untruncated_lengths": [len(f) for f in full],
            "truncated_by_tokenizer": [len(f) > TOKENIZER_MAX_LENGTH + DROP_IDX for f in full],
            "tokenizer_output_shape": list(enc.input_ids.shape),
            "real_lengths": real,
            "kept_lengths": [r - DROP_IDX for r in real],
            "get_prompt_embeds_shape": list(g_e.shape),
            "get_prompt_embeds_mask_lengths": [int(m.sum()) for m in g_m],
            "prompt_embeds_shape": list(final_e.shape),
            "prompt_embeds_mask_lengths": None if final_m is None else [int(m.sum()) for m in final_m],
            "prompt_embeds_mask_is_none": final_m is None,
            "prompt_embeds_row_source": [i // n for i in range(len(prompts) * n)],
            "prompt_embeds_mask_row_source": [i % len(prompts) for i in range(len(prompts) * n)],
            "final_equals_get": same,
        }
        if name == "truncated_1058":
            assert full[0][:TOKENIZER_MAX_LENGTH + DROP_IDX] == enc.input_ids[0].tolist()
            cases[name]["kept_tail_text"] = tok.decode(enc.input_ids[0, -12:].tolist())
            cases[name]["dropped_tail_text"] = tok.decode(full[0][TOKENIZER_MAX_LENGTH + DROP_IDX:])
        print(f"{name}: tokenizer {tuple(enc.input_ids.shape)} real {real} "
              f"untruncated {[len(f) for f in full]} -> get {tuple(g_e.shape)} -> "
              f"final {tuple(final_e.shape)} mask {'None' if final_m is None else tuple(final_m.shape)}"
              f"; Diffusers' encode_prompt equal")
    print(f"(e) each prompt alone vs the batch: max abs diff {max_alone:.3e}")
    assert max_alone < 1e-5

    # Edit / Edit Plus texts
    def probe(p, prompts, image):
        try:
            p._get_qwen_prompt_embeds(list(prompts), image=image, device=torch.device("cpu"),
                                      dtype=torch.float32)
        except _Stop:
            pass
        assert p.processor.padding is True
        return p.processor.text

    edit_doc = {}
    for pname, p, tmpl, variants in [
            ("QwenImageEditPipeline", edit, EDIT_TEMPLATE, [("one_image", "img")]),
            ("QwenImageEditPlusPipeline", plus, EDIT_PLUS_TEMPLATE,
             [("one_image", ["img1"]), ("two_images", ["img1", "img2"])])]:
        entry = {"template": tmpl, "prompt_template_encode_start_idx": EDIT_DROP_IDX,
                 "processor_call": "processor(text=txt, images=image, padding=True, "
                                   "return_tensors='pt'); no truncation",
                 "system_prefix_ids_tiny": len(tok.encode(EDIT_SYSTEM)), "cases": {}}
        if pname == "QwenImageEditPlusPipeline":
            entry["image_prompt_template"] = EDIT_PLUS_IMG
        for vname, image in variants:
            texts = probe(p, EDIT_PROMPTS, image)
            if pname == "QwenImageEditPipeline":
                mine = [tmpl.format(e) for e in EDIT_PROMPTS]
            else:
                base = "".join(EDIT_PLUS_IMG.format(i + 1) for i in range(len(image)))
                mine = [tmpl.format(base + e) for e in EDIT_PROMPTS]
            assert texts == mine, (pname, vname)  # (c)
            ids = [tok.encode(t) for t in texts]
            assert all(x.count(tok.added["<|image_pad|>"]) == (len(image) if isinstance(image, list) else 1)
                       for x in ids)
            entry["cases"][vname] = {
                "prompts": EDIT_PROMPTS, "rendered": texts, "ids": ids,
                "lengths": [len(x) for x in ids],
                "image_pad_positions": [[j for j, t in enumerate(x) if t == tok.added["<|image_pad|>"]]
                                        for x in ids],
                "dropped_text": [tok.decode(x[:EDIT_DROP_IDX]) for x in ids],
            }
        edit_doc[pname] = entry
        print(f"{pname}: texts equal Diffusers' ({', '.join(entry['cases'])}); lengths "
              f"{[c['lengths'] for c in entry['cases'].values()]}")

    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)},
              os.path.join(out, "prompt_embeds.safetensors"), metadata={"format": "pt"})
    doc = {
        "diffusers_version": diffusers.__version__,
        "pipeline": "QwenImagePipeline._get_qwen_prompt_embeds + encode_prompt",
        "prompt_template_encode": TEMPLATE,
        "prompt_template_encode_start_idx": DROP_IDX,
        "tokenizer_max_length": TOKENIZER_MAX_LENGTH,
        "tokenizer_call": "tokenizer(txt, max_length=1058, padding=True, truncation=True, "
                          "return_tensors='pt'): right truncation, right padding to the longest",
        "text_encoder": "text_encoder/ (hidden_states[-1], after the final norm)",
        "pad_token": tok.pad_token, "pad_token_id": tok.pad_id,
        "template_prefix_ids_tiny": len(prefix_ids),
        "template_prefix_ids_real_vocab": DROP_IDX,
        "dropped_text": tok.decode(prefix_ids[:DROP_IDX]),
        "first_kept_text": tok.decode(prefix_ids[DROP_IDX:]),
        "mask_repeat_note": "encode_prompt repeats prompt_embeds per prompt (rows p0, p0, p1, p1) "
                            "but the 2-D mask as a whole (rows p0, p1, p0, p1): "
                            "prompt_embeds_row_source / prompt_embeds_mask_row_source",
        "storage_note": "<case>.prompt_embeds / .prompt_embeds_mask are stored only when "
                        "final_equals_get is false; otherwise encode_prompt returns "
                        "<case>.get.prompt_embeds and (prompt_embeds_mask_is_none ? None : "
                        "<case>.get.prompt_embeds_mask)",
        "masks_note": "every mask is ones then zeros along the row, so the JSON gives its per-row "
                      "lengths (the tensors are in prompt_embeds.safetensors); ids are the "
                      "tokenizer's at the real positions (after its truncation)",
        "cases": cases,
        "edit_pipelines": edit_doc,
    }
    with open(os.path.join(out, "prompts_expected.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(compact_scalar_lists(json.dumps(doc, ensure_ascii=False, indent=2, sort_keys=True))
                + "\n")
    print(f"wrote {tok_dir}, prompt_embeds.safetensors, prompts_expected.json")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_prompts.py OUT_DIR  (tests/golden/qwen_image)")
    main(sys.argv[1])
