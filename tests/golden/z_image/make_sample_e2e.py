#!/usr/bin/env python3
"""Makes tests/golden/z_image/tiny_z_image/sample_e2e.safetensors and sample_e2e.json: end-to-end
references of ZImagePipeline.__call__ from prompt STRINGS, with the tiny fixtures here: the
tokenizer in tokenizer/, the Qwen3 text encoder in qwen3/text_encoder/ and the pipeline folder
tiny_z_image/ (made by make_tokenizer.py, make_qwen3.py and make_transformer.py; re-making any of
them means re-making this).

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0, python3-jinja2, python3-regex):
    ../shared/refstack2/run python3 tests/golden/z_image/make_sample_e2e.py tests/golden/z_image
Re-running writes byte-identical files (float32 on one CPU thread, fixed seeds, safetensors with
sorted keys, JSON with sorted keys).

transformers is not available in refstack2, so ZImagePipeline._encode_prompt is reproduced in
plain Python, step by step:
  1. messages = [{"role": "user", "content": prompt}], rendered with the chat template of
     tokenizer/tokenizer_config.json as apply_chat_template(messages, tokenize=False,
     add_generation_prompt=True, enable_thinking=True) renders it (make_chat_template.py's
     environment and variables: python3-jinja2 in Transformers' sandbox);
  2. tokenizer(texts, padding="max_length", max_length=max_sequence_length, truncation=True,
     return_tensors="pt"): the byte-level BPE of make_tokenizer.py (added tokens split out first,
     NFC, Qwen's pre-tokenizer pattern, merges by rank), no special tokens added, cut on the right
     to max_length, padded on the right with the pad token <|endoftext|> (attention mask 0);
  3. text_encoder(input_ids, attention_mask=mask.bool(), output_hidden_states=True)
     .hidden_states[-2] for the whole batch of prompts at once (make_qwen3.py's plain-torch
     transcription of Qwen3Model.forward, weights from qwen3/text_encoder/'s shards);
  4. row i at its real positions (mask == 1): one [L_i, 48] tensor per prompt.
Negative prompts the same way, when CFG is on (guidance_scale > 0): a str becomes [str], None
becomes ["" for each prompt]. The real ZImagePipeline, unmodified and loaded with
from_pretrained(folder, text_encoder=None, tokenizer=None), is then called with
prompt_embeds= / negative_prompt_embeds= lists built that way.

Checks (the outputs do not depend on them):
  (a) the rendered texts and ids equal chat_template/expected.json's pipeline_prompts (the same
      prompts, rendered and tokenized by make_chat_template.py);
  (b) the Qwen3 forward reproduces qwen3/expected.safetensors' hidden states on its recorded
      input_ids / attention_mask (and its unpadded sequence), and the shards hold
      make_qwen3.make_weights();
  (c) the pipeline's OWN encode_prompt path: the same pipeline given the prompt strings (and the
      negative prompt as given, or none), with duck-typed stand-ins for the tokenizer
      (apply_chat_template + __call__ as above) and the text encoder (returns .hidden_states),
      gives exactly the same latents: the plumbing (negative default, batching, masks,
      num_images_per_prompt repetition) is Diffusers' own;
  (d) each prompt encoded alone without padding gives the same embeddings (to 1e-5);
  (e) `truncated`: the rendered ids are longer than max_sequence_length, all kept ids are real;
  (f) `cfg_default_negative`: called with prompt_embeds= but no negative_prompt_embeds, the
      pipeline raises ValueError (the "" default exists only on the prompt-string path; the
      message is in the JSON).

Writes, under OUT/tiny_z_image/:
  sample_e2e.safetensors  <case>.input_ids.<j>, .attention_mask.<j> (int64 [max_sequence_length]),
                          .prompt_embeds.<j> [L_j, 48], and for CFG cases
                          .negative_input_ids.<j>, .negative_attention_mask.<j>,
                          .negative_prompt_embeds.<j>; .latents (output_type "latent")
                          [B, 16, h, w]; .image (output_type "np") [B, H, W, 3] float32 in [0, 1]
  sample_e2e.json         every argument of every case, the rendered texts, the ids at the real
                          positions, the real lengths, what a missing negative prompt became
"""
import copy
import json
import os
import sys
import types

import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import make_chat_template  # noqa: E402  (jinja2 environment of apply_chat_template)
import make_qwen3  # noqa: E402  (plain-torch Qwen3Model forward)
import make_tokenizer  # noqa: E402  (plain-Python byte-level BPE)

# As make_transformer.py: flip Diffusers' transformers-availability flag before anything imports
# diffusers.loaders, so that pipeline_z_image.py imports (refstack2's transformers is a stub; with
# text_encoder=None, tokenizer=None nothing of it runs). Diffusers' code itself is untouched.
import diffusers.utils.import_utils as _iu  # noqa: E402
assert "diffusers.loaders" not in sys.modules
_iu._transformers_available, _iu._transformers_version = True, "4.57.0"

import diffusers  # noqa: E402
from diffusers.pipelines.z_image.pipeline_z_image import ZImagePipeline  # noqa: E402

CASES = [
    # Turbo: no CFG, two prompts (ASCII; CJK + emoji), default max_sequence_length 512
    dict(name="turbo", prompt=["a cat", "一只猫 🐱 on the mat"], negative_prompt=None,
         guidance_scale=0.0, cfg_normalization=False, cfg_truncation=1.0,
         num_images_per_prompt=1, num_inference_steps=3, height=32, width=48, seed=42,
         max_sequence_length=512),
    # CFG with a given negative prompt (a str), two images per prompt, leading / trailing spaces
    # and newlines in the prompt
    dict(name="cfg", prompt=["  a red fox, 4k\n\nsnow  "], negative_prompt="blurry",
         guidance_scale=3.0, cfg_normalization=False, cfg_truncation=1.0,
         num_images_per_prompt=2, num_inference_steps=2, height=48, width=32, seed=7,
         max_sequence_length=512),
    # CFG without a negative prompt: the pipeline encodes "" for each prompt; renormalisation on
    dict(name="cfg_default_negative", prompt=["a cat"], negative_prompt=None,
         guidance_scale=2.0, cfg_normalization=True, cfg_truncation=1.0,
         num_images_per_prompt=1, num_inference_steps=2, height=32, width=32, seed=3,
         max_sequence_length=512),
    # max_sequence_length 12 cuts the rendered template (32 ids) after the 12th id; special
    # tokens typed inside the prompt are matched as added tokens
    dict(name="truncated", prompt=["text with <|im_start|> and <think> inside"],
         negative_prompt=None, guidance_scale=0.0, cfg_normalization=False, cfg_truncation=1.0,
         num_images_per_prompt=1, num_inference_steps=2, height=32, width=32, seed=5,
         max_sequence_length=12),
]
CALL_KEYS = ["height", "width", "num_inference_steps", "guidance_scale", "cfg_normalization",
             "cfg_truncation", "num_images_per_prompt", "max_sequence_length"]


# ---- tokenizer: chat template + byte-level BPE + padding / truncation ---------------------------

class Tokenizer:
    """The two calls _encode_prompt makes on its Qwen2Tokenizer, from tokenizer/'s files."""

    def __init__(self, tok_dir):
        with open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8") as f:
            cfg = json.load(f)
        with open(os.path.join(tok_dir, "vocab.json"), encoding="utf-8") as f:
            self.vocab = json.load(f)
        with open(os.path.join(tok_dir, "merges.txt"), encoding="utf-8") as f:
            merges = [tuple(line.rstrip("\n").split(" ")) for line in f if not line.startswith("#")]
        self.ranks = {pair: r for r, pair in enumerate(merges)}
        self.added = {e["content"]: int(i) for i, e in cfg["added_tokens_decoder"].items()}
        assert self.added == {t: len(self.vocab) + k for k, t in
                              enumerate(make_tokenizer.SPECIAL + make_tokenizer.ADDED)}
        assert not cfg["add_bos_token"] and cfg.get("padding_side", "right") == "right"
        self.pad_token = cfg["pad_token"]
        self.pad_id = self.added[self.pad_token]
        assert cfg["chat_template"] == make_tokenizer.QWEN3_CHAT_TEMPLATE
        assert {"eos_token": cfg["eos_token"], "pad_token": cfg["pad_token"]} == \
            make_chat_template.SPECIAL_TOKENS  # the special tokens the template is given
        self.template = make_chat_template.environment().from_string(cfg["chat_template"])

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=False, **kwargs):
        assert tokenize is False
        return self.template.render(**make_chat_template.variables(
            messages, add_generation_prompt, **kwargs))

    def encode(self, text):  # no special tokens added (Qwen2's post-processor adds none)
        return make_tokenizer.encode(text, self.vocab, self.ranks, self.added)

    def __call__(self, texts, padding, max_length, truncation, return_tensors):
        assert padding == "max_length" and truncation is True and return_tensors == "pt"
        ids = torch.full((len(texts), max_length), self.pad_id, dtype=torch.int64)
        mask = torch.zeros((len(texts), max_length), dtype=torch.int64)
        for i, text in enumerate(texts):
            t = self.encode(text)[:max_length]  # truncation_side "right"
            ids[i, :len(t)] = torch.tensor(t, dtype=torch.int64)  # padding_side "right"
            mask[i, :len(t)] = 1
        return types.SimpleNamespace(input_ids=ids, attention_mask=mask)


# ---- text encoder -------------------------------------------------------------------------------

def load_qwen3(te_dir):
    with open(os.path.join(te_dir, "model.safetensors.index.json")) as f:
        index = json.load(f)
    w = {}
    for shard in sorted(set(index["weight_map"].values())):
        w.update(load_file(os.path.join(te_dir, shard)))
    assert set(w) == set(index["weight_map"])
    with open(os.path.join(te_dir, "config.json")) as f:
        assert json.load(f) == make_qwen3.CONFIG  # the constants make_qwen3's forward uses
    return w


class TextEncoder:
    """Qwen3Model(input_ids, attention_mask, output_hidden_states=True) -> .hidden_states."""

    def __init__(self, w):
        self.w = w

    def __call__(self, input_ids, attention_mask, output_hidden_states):
        assert output_hidden_states
        with torch.no_grad():
            hs = make_qwen3.qwen3_forward(self.w, input_ids, attention_mask)
        return types.SimpleNamespace(hidden_states=tuple(hs))


def encode_prompts(tok, te, prompts, max_len):
    """ZImagePipeline._encode_prompt(prompts, max_sequence_length=max_len), restated."""
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], tokenize=False,
                                     add_generation_prompt=True, enable_thinking=True)
             for p in prompts]
    inputs = tok(texts, padding="max_length", max_length=max_len, truncation=True,
                 return_tensors="pt")
    masks = inputs.attention_mask.bool()
    hidden = te(input_ids=inputs.input_ids, attention_mask=masks,
                output_hidden_states=True).hidden_states[-2]
    embeds = [hidden[i][masks[i]] for i in range(len(prompts))]
    full = [tok.encode(t) for t in texts]
    # (d) each prompt alone, its kept ids without padding: the same embeddings (to 1e-5)
    d = 0.0
    for i, e in enumerate(embeds):
        ids = inputs.input_ids[i:i + 1, :e.shape[0]]
        alone = te(input_ids=ids, attention_mask=torch.ones_like(ids, dtype=torch.bool),
                   output_hidden_states=True).hidden_states[-2][0]
        d = max(d, (alone - e).abs().max().item())
    assert d < 1e-5, d
    return dict(texts=texts, full_ids=full, input_ids=inputs.input_ids,
                attention_mask=inputs.attention_mask, embeds=embeds, alone_diff=d)


# ---- checks (a) and (b) -------------------------------------------------------------------------

def check_chat_template_fixture(tok):
    with open(os.path.join(HERE, "chat_template", "expected.json"), encoding="utf-8") as f:
        pp = json.load(f)["pipeline_prompts"]
    for entry in pp:
        text = tok.apply_chat_template([{"role": "user", "content": entry["prompt"]}],
                                       tokenize=False, add_generation_prompt=True,
                                       enable_thinking=True)
        assert text == entry["text"], (text, entry["text"])
        assert tok.encode(text) == entry["ids"], entry["prompt"]
    used = {p for c in CASES for p in c["prompt"] + [c["negative_prompt"] or ""]}
    uncovered = sorted(used - {e["prompt"] for e in pp})
    assert uncovered == ["blurry"], uncovered  # every other prompt here is one of those six
    print(f"(a) chat_template/expected.json pipeline_prompts: {len(pp)} texts and ids equal "
          f"(covers every prompt used here but {uncovered})")


def check_qwen3_fixture(w):
    ref = load_file(os.path.join(HERE, "qwen3", "expected.safetensors"))
    made = make_qwen3.make_weights()
    assert set(made) == set(w) and all(torch.equal(made[k], w[k]) for k in w)
    with torch.no_grad():
        hs = make_qwen3.qwen3_forward(w, ref["input_ids"], ref["attention_mask"])
        hs_np = make_qwen3.qwen3_forward(w, ref["input_ids_nopad"], torch.ones_like(ref["input_ids_nopad"]))
    d = 0.0
    for k in range(len(hs)):
        d = max(d, (hs[k] - ref[f"hidden_states.{k}"]).abs().max().item(),
                (hs_np[k] - ref[f"hidden_states_nopad.{k}"]).abs().max().item())
    for i in range(ref["input_ids"].shape[0]):
        e = hs[-2][i][ref["attention_mask"][i].bool()]
        d = max(d, (e - ref[f"prompt_embeds.{i}"]).abs().max().item())
    assert d < 1e-5, d
    print(f"(b) qwen3/expected.safetensors: hidden states and prompt_embeds max abs diff {d:.3e}; "
          "shards hold make_qwen3.make_weights()")


# ---- pipeline -----------------------------------------------------------------------------------

def call(pipe, case, output_type, **kw):
    args = {k: case[k] for k in CALL_KEYS}
    return pipe(generator=torch.Generator("cpu").manual_seed(case["seed"]), output_type=output_type,
                return_dict=False, **args, **kw)[0]


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    root = os.path.join(out, "tiny_z_image")

    tok = Tokenizer(os.path.join(HERE, "tokenizer"))
    w = load_qwen3(os.path.join(HERE, "qwen3", "text_encoder"))
    te = TextEncoder(w)
    check_chat_template_fixture(tok)
    check_qwen3_fixture(w)

    pipe = ZImagePipeline.from_pretrained(root, text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.text_encoder is None and pipe.tokenizer is None
    # (c) the same components with duck-typed tokenizer / text encoder: Diffusers' encode_prompt
    shim = ZImagePipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=te, tokenizer=tok,
                          transformer=pipe.transformer)
    shim.set_progress_bar_config(disable=True)

    tensors, meta = {}, {}
    for case in CASES:
        name, n_prompts, L = case["name"], len(case["prompt"]), case["max_sequence_length"]
        cfg = case["guidance_scale"] > 0  # ZImagePipeline.do_classifier_free_guidance
        pos = encode_prompts(tok, te, case["prompt"], L)
        neg = None
        if cfg:  # encode_prompt: None -> [""] * len(prompt); a str -> [str]
            negp = case["negative_prompt"]
            negp = ["" for _ in case["prompt"]] if negp is None else \
                [negp] if isinstance(negp, str) else list(negp)
            assert len(negp) == n_prompts
            neg = encode_prompts(tok, te, negp, L)

        kw = {"prompt_embeds": [e.clone() for e in pos["embeds"]]}
        if neg is not None:
            kw["negative_prompt_embeds"] = [e.clone() for e in neg["embeds"]]
        with torch.no_grad():
            lat = call(pipe, case, "latent", **copy.deepcopy(kw))
            img = call(pipe, case, "np", **copy.deepcopy(kw))
        img = torch.from_numpy(img)
        B = n_prompts * case["num_images_per_prompt"]
        assert lat.dtype == torch.float32 and lat.shape == (B, 16, case["height"] // 8, case["width"] // 8)
        assert img.dtype == torch.float32 and img.shape == (B, case["height"], case["width"], 3)
        assert img.min() >= 0 and img.max() <= 1

        # (c) Diffusers' own encode_prompt from the strings, through the stand-ins
        prompt_arg = list(case["prompt"])
        with torch.no_grad():
            lat_c = call(shim, case, "latent", prompt=prompt_arg,
                         negative_prompt=case["negative_prompt"])
        assert torch.equal(lat_c, lat), (name, (lat_c - lat).abs().max().item())
        # _encode_prompt writes the rendered texts into the caller's list in place
        mutated = prompt_arg == pos["texts"]

        for j in range(n_prompts):
            tensors[f"{name}.input_ids.{j}"] = pos["input_ids"][j]
            tensors[f"{name}.attention_mask.{j}"] = pos["attention_mask"][j]
            tensors[f"{name}.prompt_embeds.{j}"] = pos["embeds"][j]
            if neg is not None:
                tensors[f"{name}.negative_input_ids.{j}"] = neg["input_ids"][j]
                tensors[f"{name}.negative_attention_mask.{j}"] = neg["attention_mask"][j]
                tensors[f"{name}.negative_prompt_embeds.{j}"] = neg["embeds"][j]
        tensors[f"{name}.latents"] = lat
        tensors[f"{name}.image"] = img

        def enc_info(e):
            return {"rendered": e["texts"], "lengths": [int(m.sum()) for m in e["attention_mask"]],
                    "untruncated_lengths": [len(f) for f in e["full_ids"]],
                    "truncated": [len(f) > L for f in e["full_ids"]],
                    "real_ids": [e["input_ids"][i][:int(m.sum())].tolist()
                                 for i, m in enumerate(e["attention_mask"])],
                    "prompt_embeds_shapes": [list(x.shape) for x in e["embeds"]]}

        info = {"arguments": {"prompt": case["prompt"], "negative_prompt": case["negative_prompt"],
                              "seed": case["seed"],
                              "generator": "torch.Generator('cpu').manual_seed(seed)",
                              "output_type": ["latent", "np"], "dtype": "float32",
                              **{k: case[k] for k in CALL_KEYS}},
                "do_classifier_free_guidance": cfg,
                "encode": enc_info(pos),
                "latent_shape": list(lat.shape), "image_shape": list(img.shape),
                "caller_prompt_list_mutated_by_encode_prompt": mutated}
        if cfg and case["negative_prompt"] is None:
            # prompt_embeds without prompt: no "" default on this path, the pipeline raises
            try:
                call(pipe, case, "latent", prompt_embeds=[e.clone() for e in pos["embeds"]])
                raise AssertionError("expected a ValueError")
            except ValueError as e:
                info["prompt_embeds_without_negative_raises"] = str(e)
        if neg is not None:
            info["negative_prompt_used"] = negp
            info["negative_encode"] = enc_info(neg)
            info["negative_prompt_note"] = (
                "negative_prompt None with guidance_scale > 0: encode_prompt uses "
                "[\"\" for _ in prompt], so \"\" is rendered and encoded like any prompt"
                if case["negative_prompt"] is None else
                "negative_prompt str: encode_prompt wraps it as [negative_prompt]; one per prompt")
        else:
            info["negative_prompt_note"] = (
                "guidance_scale 0: do_classifier_free_guidance is false (guidance_scale > 0), so "
                "no negative prompt is encoded and negative_prompt_embeds stays []")
        if name == "truncated":
            assert info["encode"]["untruncated_lengths"][0] > L and info["encode"]["lengths"][0] == L
            assert int(pos["attention_mask"][0].sum()) == L  # no padding left
        meta[name] = info
        print(f"{name}: lengths {info['encode']['lengths']}"
              f"{' neg ' + str(info['negative_encode']['lengths']) if neg else ''}, untruncated "
              f"{info['encode']['untruncated_lengths']}; alone-vs-padded "
              f"{max(pos['alone_diff'], neg['alone_diff'] if neg else 0):.1e}; latents "
              f"{tuple(lat.shape)} max |.| {lat.abs().max().item():.3f}; image {tuple(img.shape)}; "
              f"strings path == embeds path; caller list mutated: {mutated}")

    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)},
              os.path.join(root, "sample_e2e.safetensors"), metadata={"format": "pt"})
    doc = {"diffusers_version": diffusers.__version__,
           "pipeline": "ZImagePipeline.from_pretrained('tiny_z_image', text_encoder=None, "
                       "tokenizer=None), called with prompt_embeds= / negative_prompt_embeds= "
                       "from the encoding below",
           "text_encoder": "qwen3/text_encoder (hidden_states[-2] at mask == 1)",
           "tokenizer": "tokenizer/ (chat template rendered with add_generation_prompt=True, "
                        "enable_thinking=True; padding='max_length', truncation=True, right side)",
           "pad_token": tok.pad_token, "pad_token_id": tok.pad_id,
           "scheduler_config": {k: v for k, v in sorted(pipe.scheduler.config.items())
                                if not k.startswith("_")},
           "cases": meta}
    with open(os.path.join(root, "sample_e2e.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(json.dumps(doc, ensure_ascii=False, indent=2, sort_keys=True) + "\n")
    print(f"wrote {root}/sample_e2e.safetensors, sample_e2e.json")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_sample_e2e.py OUT_DIR  (writes OUT_DIR/tiny_z_image/sample_e2e.*)")
    main(sys.argv[1])
