#!/usr/bin/env python3
"""Makes tests/golden/qwen_image/tiny_qwen_image/sample_e2e.safetensors and sample_e2e.json:
end-to-end references of QwenImagePipeline.__call__ from prompt STRINGS, with the tiny fixtures
here: the tokenizer in tokenizer/, the Qwen2.5-VL text encoder in text_encoder/ (make_prompts.py,
make_text_encoder.py) and the pipeline folder tiny_qwen_image/ (transformer, vae, scheduler;
make_transformer.py, make_vae.py). Re-making any of them means re-making this.

Run with refstack2's Python (torch 2.6 CPU, Diffusers 0.40.0.dev0, python3-regex, python3-jinja2):
    ../shared/refstack2/run python3 tests/golden/qwen_image/make_sample_e2e.py tests/golden/qwen_image
Re-running writes byte-identical files (float32 on one CPU thread, fixed seeds, safetensors with
sorted keys and the single metadata entry {"format": "pt"}, JSON with sorted keys).

transformers is not available in refstack2, so the prompt encoding is make_prompts.py's plain
restatement of QwenImagePipeline._get_qwen_prompt_embeds (its functions, imported):
  1. txt = prompt_template_encode.format(p) for each prompt (the pipeline's own system + user
     template; no chat template);
  2. tokenizer(txt, max_length=1024 + 34, padding=True, truncation=True): the byte-level BPE, no
     special tokens added, right truncation, right padding to the batch's longest with
     <|endoftext|> (656), int64 mask;
  3. text_encoder(...).hidden_states[-1] (final-norm output) for the padded batch at once
     (make_text_encoder.text_forward);
  4. per prompt the rows at mask == 1 minus the first drop_idx = 34, re-padded on the right with
     ZEROS to the longest -> prompt_embeds [B, Lk, 64], prompt_embeds_mask int64 [B, Lk].
Negative prompts the same way, only when CFG is on (true_cfg_scale > 1 AND a negative prompt is
given): a str becomes [str] (batch ONE, whatever the number of prompts), a list stays a list.
The real QwenImagePipeline, unmodified, loaded with from_pretrained(tiny_qwen_image,
text_encoder=None, tokenizer=None), is then called with prompt_embeds= / prompt_embeds_mask= (and
negative_prompt_embeds= / negative_prompt_embeds_mask=) built that way; the pipeline's
encode_prompt then cuts them to max_sequence_length, repeats them per image and drops an all-ones
mask (None), as it would have after encoding the strings itself.

Checks (the outputs do not depend on them):
  (a) the stack reproduces prompt_embeds.safetensors (make_prompts.py's case batch2_cut8, same
      tokenizer and text encoder) exactly, and the text encoder folder holds
      make_text_encoder.make_weights() (make_prompts.load_text_encoder);
  (b) the pipeline's OWN encode_prompt path: the same components given the prompt strings (and the
      negative prompt as given), with duck-typed stand-ins for the tokenizer (make_prompts.Tokenizer:
      __call__(txt, max_length, padding=True, truncation=True, return_tensors="pt") -> .input_ids,
      .attention_mask, .to(device)) and the text encoder (make_prompts.TextEncoder: .dtype, returns
      an object with .hidden_states), gives exactly the same latents; the stand-in tokenizer /
      encoder saw exactly the ids and masks recorded here;
  (c) the transformer (forward hook) got exactly the embeddings / masks make_prompts.encode_prompt
      predicts (cut, repeated, None when all ones), in every call;
  (d) each prompt encoded alone (unpadded) gives the batch's embeddings (to 1e-5);
  (e) `two_prompts`: the negative " " is encoded ONCE ([1, L, 64]) and broadcast by the
      transformer against the batch of 2; passing it repeated ([" ", " "], [2, L, 64]) gives the
      same latents (recorded: max abs diff);
  (f) `cut`: the 6 kept embeddings are still inside the system text of the template, so they equal
      the first 6 of any other prompt's (`plain`'s; recorded: max abs diff);
  (g) `odd`: 40 x 56 gives exactly the latents and image of 32 x 48.

Writes, under OUT/tiny_qwen_image/:
  sample_e2e.safetensors  per case <case>.input_ids, .attention_mask int64 [B, S] (tokenizer
                          output), .prompt_embeds [B, Lk, 64] float32, .prompt_embeds_mask int64
                          [B, Lk] (as passed to the pipeline: BEFORE its max_sequence_length cut;
                          stored even when all ones, where the pipeline turns it into None), and
                          for CFG cases .negative_input_ids, .negative_attention_mask,
                          .negative_prompt_embeds, .negative_prompt_embeds_mask (batch 1 for a str
                          negative prompt); .latents [B, N, 64] (output_type "latent": PACKED, as
                          returned); .image [B, H, W, 3] float32 in [0, 1] (output_type "np")
  sample_e2e.json         every argument of every case, the rendered texts, the ids at the real
                          positions, token counts (untruncated, real, kept after drop_idx, after
                          max_sequence_length), whether CFG ran, the shapes the transformer got
"""
import copy
import json
import os
import sys

import torch
from safetensors.torch import load_file, save_file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
# make_prompts flips Diffusers' transformers-availability flag before diffusers.loaders is
# imported (refstack2's transformers is a stub; nothing of it runs) and imports the pipeline.
import make_prompts  # noqa: E402
import diffusers  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline  # noqa: E402

LONG = make_prompts.LONG  # the 131-character prompt of make_prompts.py's cut8
# true_cfg_scale None: not passed (the pipeline's default 4.0, CFG off without a negative prompt)
CASES = [
    dict(name="plain", prompt="a photo of a cat", negative_prompt=None, true_cfg_scale=None,
         height=48, width=64, num_inference_steps=3, num_images_per_prompt=1,
         max_sequence_length=None, seed=1),
    dict(name="cfg", prompt="a red fox in the snow", negative_prompt="blurry", true_cfg_scale=3.5,
         height=32, width=32, num_inference_steps=2, num_images_per_prompt=1,
         max_sequence_length=None, seed=2),
    # a str negative prompt with two prompts: encoded once (batch 1), broadcast by the transformer
    dict(name="two_prompts", prompt=["a cat", "a dog on a hill"], negative_prompt=" ",
         true_cfg_scale=2.0, height=32, width=48, num_inference_steps=2, num_images_per_prompt=1,
         max_sequence_length=None, seed=3),
    # max_sequence_length 6 keeps 6 embeddings, all inside the template's system text
    dict(name="cut", prompt=LONG, negative_prompt=None, true_cfg_scale=1.0,
         height=32, width=32, num_inference_steps=2, num_images_per_prompt=1,
         max_sequence_length=6, seed=4),
    # 40 x 56 is not a multiple of 16: a warning, then floored to 32 x 48
    dict(name="odd", prompt="odd size", negative_prompt=None, true_cfg_scale=None,
         height=40, width=56, num_inference_steps=3, num_images_per_prompt=1,
         max_sequence_length=None, seed=5),
]
DEFAULT_TRUE_CFG, DEFAULT_MAX_SEQ = 4.0, 512  # QwenImagePipeline.__call__'s defaults


def call_kwargs(case):
    kw = {k: case[k] for k in ("height", "width", "num_inference_steps", "num_images_per_prompt")}
    for k in ("true_cfg_scale", "max_sequence_length"):
        if case[k] is not None:
            kw[k] = case[k]
    return kw


def call(pipe, case, output_type, **kw):
    with torch.no_grad():
        return pipe(generator=torch.Generator("cpu").manual_seed(case["seed"]),
                    output_type=output_type, return_dict=False, **call_kwargs(case), **kw)[0]


def encode(tok, te, prompts):
    """make_prompts.get_qwen_prompt_embeds, plus (d): each prompt alone equals the batch."""
    txt, enc, e, m = make_prompts.get_qwen_prompt_embeds(tok, te, prompts)
    d = 0.0
    for i, p in enumerate(prompts):
        _, _, a_e, _ = make_prompts.get_qwen_prompt_embeds(tok, te, [p])
        k = int(m[i].sum())
        assert a_e.shape[1] == k and bool((e[i, k:] == 0).all())
        d = max(d, (a_e[0] - e[i, :k]).abs().max().item())
    assert d < 1e-5, d
    full = [tok.encode(t) for t in txt]
    return dict(texts=txt, input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                embeds=e, mask=m, full=full, alone_diff=d)


def enc_info(tok, e, n, msl):
    real = [int(r.sum()) for r in e["attention_mask"]]
    fe, fm = make_prompts.encode_prompt(e["embeds"], e["mask"], n, msl)
    return {"rendered": e["texts"],
            "ids": [r[:k].tolist() for r, k in zip(e["input_ids"], real)],
            "untruncated_lengths": [len(f) for f in e["full"]],
            "real_lengths": real,
            "kept_lengths": [k - make_prompts.DROP_IDX for k in real],
            "first_kept_text": [tok.decode(r[make_prompts.DROP_IDX:make_prompts.DROP_IDX + 8].tolist())
                                for r in e["input_ids"]],
            "tokenizer_output_shape": list(e["input_ids"].shape),
            "prompt_embeds_shape": list(e["embeds"].shape),
            "prompt_embeds_mask_lengths": [int(r.sum()) for r in e["mask"]],
            "transformer_embeds_shape": list(fe.shape),
            "transformer_mask_lengths": None if fm is None else [int(r.sum()) for r in fm],
            "transformer_mask_is_none": fm is None}, fe, fm


def main(out):
    torch.manual_seed(0)
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    root = os.path.join(out, "tiny_qwen_image")

    tok = make_prompts.Tokenizer(os.path.join(out, "tokenizer"))
    w, te_cfg = make_prompts.load_text_encoder(os.path.join(out, "text_encoder"))  # (a) weights
    te = make_prompts.TextEncoder(w, te_cfg)
    # (a) prompt_embeds.safetensors' batch2_cut8 (["a cat", "a red fox in the snow"]), exactly
    ref = load_file(os.path.join(out, "prompt_embeds.safetensors"))
    _, enc, g_e, g_m = make_prompts.get_qwen_prompt_embeds(tok, te, ["a cat", "a red fox in the snow"])
    assert torch.equal(enc.input_ids, ref["batch2_cut8.input_ids"])
    assert torch.equal(g_e, ref["batch2_cut8.get.prompt_embeds"])
    assert torch.equal(g_m, ref["batch2_cut8.get.prompt_embeds_mask"])
    print("(a) prompt_embeds.safetensors batch2_cut8 reproduced exactly; text_encoder/ holds "
          "make_text_encoder.make_weights()")

    pipe = QwenImagePipeline.from_pretrained(root, text_encoder=None, tokenizer=None)
    pipe.set_progress_bar_config(disable=True)
    assert pipe.text_encoder is None and pipe.tokenizer is None and pipe.vae_scale_factor == 8
    assert (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx,
            pipe.tokenizer_max_length) == (make_prompts.TEMPLATE, make_prompts.DROP_IDX,
                                           make_prompts.TOKENIZER_MAX_LENGTH)
    # (b) the same components with the duck-typed tokenizer / text encoder: Diffusers' encode_prompt
    shim = QwenImagePipeline(scheduler=pipe.scheduler, vae=pipe.vae, text_encoder=te, tokenizer=tok,
                             transformer=pipe.transformer)
    shim.set_progress_bar_config(disable=True)

    calls = []

    def hook(mod, args, kwargs, o):  # (c) what the transformer gets
        m = kwargs["encoder_hidden_states_mask"]
        calls.append(dict(ehs=kwargs["encoder_hidden_states"].clone(),
                          mask=None if m is None else m.clone(),
                          hs_shape=list(kwargs["hidden_states"].shape),
                          img_shapes=[[list(s) for s in smp] for smp in kwargs["img_shapes"]]))
    pipe.transformer.register_forward_hook(hook, with_kwargs=True)

    tensors, meta, embeds_of = {}, {}, {}
    for case in CASES:
        name, n = case["name"], case["num_images_per_prompt"]
        prompts = [case["prompt"]] if isinstance(case["prompt"], str) else list(case["prompt"])
        msl = case["max_sequence_length"] or DEFAULT_MAX_SEQ
        tcfg = DEFAULT_TRUE_CFG if case["true_cfg_scale"] is None else case["true_cfg_scale"]
        negp = case["negative_prompt"]
        cfg = tcfg > 1 and negp is not None  # QwenImagePipeline's do_true_cfg
        B = len(prompts) * n

        pos = encode(tok, te, prompts)
        embeds_of[name] = pos["embeds"]
        neg = None
        if cfg:  # encode_prompt(prompt=negative_prompt): a str becomes [str], batch 1
            neg_list = [negp] if isinstance(negp, str) else list(negp)
            neg = encode(tok, te, neg_list)

        kw = dict(prompt_embeds=pos["embeds"], prompt_embeds_mask=pos["mask"])
        if neg is not None:
            kw.update(negative_prompt_embeds=neg["embeds"], negative_prompt_embeds_mask=neg["mask"])
        calls.clear()
        lat = call(pipe, case, "latent", **copy.deepcopy(kw))
        steps_calls = list(calls)
        img = torch.from_numpy(call(pipe, case, "np", **copy.deepcopy(kw)))
        hl, wl = 2 * (case["height"] // 16), 2 * (case["width"] // 16)
        assert lat.dtype == torch.float32 and lat.shape == (B, hl * wl // 4, 64)
        assert img.dtype == torch.float32 and img.shape == (B, 8 * hl, 8 * wl, 3)
        assert img.min() >= 0 and img.max() <= 1

        # (c) the transformer got what make_prompts.encode_prompt predicts, in every call
        info_pos, fe, fm = enc_info(tok, pos, n, msl)
        expect = [(fe, fm)]
        info_neg = None
        if neg is not None:
            info_neg, nfe, nfm = enc_info(tok, neg, n, msl)
            expect.append((nfe, nfm))
        assert len(steps_calls) == case["num_inference_steps"] * len(expect)
        for j, c in enumerate(steps_calls):
            e_, m_ = expect[j % len(expect)]
            assert torch.equal(c["ehs"], e_), (name, j)
            assert (m_ is None and c["mask"] is None) or torch.equal(c["mask"], m_), (name, j)

        # (b) Diffusers' own encode_prompt from the strings, through the stand-ins
        prompt_arg = copy.deepcopy(case["prompt"])
        te.calls.clear()
        lat_b = call(shim, case, "latent", prompt=prompt_arg, negative_prompt=negp)
        assert torch.equal(lat_b, lat), (name, (lat_b - lat).abs().max().item())
        seen = [(pos["input_ids"], pos["attention_mask"])] + \
            ([(neg["input_ids"], neg["attention_mask"])] if neg is not None else [])
        assert len(te.calls) == len(seen) and all(
            torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(te.calls, seen))
        assert prompt_arg == case["prompt"]  # not written into (unlike ZImagePipeline)

        for key, e in (("", pos), ("negative_", neg)):
            if e is None:
                continue
            tensors[f"{name}.{key}input_ids"] = e["input_ids"]
            tensors[f"{name}.{key}attention_mask"] = e["attention_mask"]
            tensors[f"{name}.{key}prompt_embeds"] = e["embeds"]
            tensors[f"{name}.{key}prompt_embeds_mask"] = e["mask"]
        tensors[f"{name}.latents"] = lat
        tensors[f"{name}.image"] = img

        info = {
            "arguments": {"prompt": case["prompt"], "negative_prompt": negp,
                          "true_cfg_scale": tcfg, "true_cfg_scale_passed": case["true_cfg_scale"] is not None,
                          "max_sequence_length": msl,
                          "max_sequence_length_passed": case["max_sequence_length"] is not None,
                          "height": case["height"], "width": case["width"],
                          "num_inference_steps": case["num_inference_steps"],
                          "num_images_per_prompt": n, "seed": case["seed"],
                          "generator": "torch.Generator('cpu').manual_seed(seed)",
                          "guidance_scale": None, "sigmas": None, "dtype": "float32",
                          "output_type": ["latent", "np"]},
            "do_true_cfg": cfg,
            "batch": B,
            "latent_hw": [hl, wl],
            "latents_shape": list(lat.shape),
            "image_shape": list(img.shape),
            "encode": info_pos,
            "transformer_calls_per_step": len(expect),
            "transformer_first_calls": [
                {"kind": "neg" if j % len(expect) else "cond", "encoder_hidden_states_shape":
                 list(c["ehs"].shape), "mask_passed": c["mask"] is not None,
                 "hidden_states_shape": c["hs_shape"], "img_shapes": c["img_shapes"]}
                for j, c in enumerate(steps_calls[:len(expect)])],
            "alone_vs_batch_max_abs_diff": max(pos["alone_diff"], neg["alone_diff"] if neg else 0.0),
        }
        if neg is not None:
            info["negative_encode"] = info_neg
            info["negative_prompt_used"] = neg_list
        elif negp is None and tcfg > 1:
            info["cfg_note"] = (f"true_cfg_scale {tcfg} without a negative prompt: the pipeline "
                                "warns and runs WITHOUT CFG (do_true_cfg needs a negative)")
        else:
            info["cfg_note"] = "true_cfg_scale <= 1: no CFG, no negative encoded"

        if name == "two_prompts":  # (e) the str negative is broadcast, not repeated
            assert neg["embeds"].shape[0] == 1 and B == 2
            assert steps_calls[1]["ehs"].shape[0] == 1 and steps_calls[1]["hs_shape"][0] == 2
            kw_rep = copy.deepcopy(kw)
            kw_rep["negative_prompt_embeds"] = neg["embeds"].repeat(2, 1, 1)
            kw_rep["negative_prompt_embeds_mask"] = neg["mask"].repeat(2, 1)
            lat_rep = call(pipe, case, "latent", **kw_rep)
            d = (lat_rep - lat).abs().max().item()
            assert d < 1e-5, d
            info["negative_broadcast_note"] = (
                "negative_prompt is a str: encode_prompt makes it [str] and batch_size = 1, so the "
                "negative embeddings are [1, L, 64] while the latents are [2, N, 64]; the "
                "transformer broadcasts them (text stream [1, L, D] modulated by temb [2, D]). "
                "Repeating them to [2, L, 64] gives the same latents up to "
                "negative_repeated_max_abs_diff (batched GEMMs round differently)")
            info["negative_repeated_max_abs_diff"] = d
            info["negative_repeated_equal"] = bool(torch.equal(lat_rep, lat))
        if name == "cut":  # (f) the 6 kept embeddings are template text: prompt-independent
            assert info_pos["untruncated_lengths"][0] - make_prompts.DROP_IDX > msl
            d = (pos["embeds"][:, :msl] - embeds_of["plain"][:, :msl]).abs().max().item()
            assert d < 1e-5, d
            info["cut_vs_plain_first6_max_abs_diff"] = d
            info["cut_note"] = ("max_sequence_length 6 keeps embeddings 34..39 of the tokenizer "
                                "output; with the tiny vocabulary the template's system prefix is "
                                f"{len(tok.encode(make_prompts.TEMPLATE.split('{}')[0]))} ids, so "
                                "they are system text and equal any prompt's (plain's: "
                                "cut_vs_plain_first6_max_abs_diff)")
        if name == "odd":  # (g) floored to 32 x 48
            c2 = dict(case, height=8 * hl, width=8 * wl)
            assert torch.equal(call(pipe, c2, "latent", **copy.deepcopy(kw)), lat)
            assert torch.equal(torch.from_numpy(call(pipe, c2, "np", **copy.deepcopy(kw))), img)
            info["floored_to"] = [8 * hl, 8 * wl]
        meta[name] = info
        print(f"{name}: prompts {len(prompts)} real {info_pos['real_lengths']} kept "
              f"{info_pos['kept_lengths']} -> transformer {info_pos['transformer_embeds_shape']} mask "
              f"{info_pos['transformer_mask_lengths']}"
              f"{'; neg ' + str(info_neg['kept_lengths']) + ' -> ' + str(info_neg['transformer_embeds_shape']) if neg else ''}"
              f"; cfg {cfg}; latents {tuple(lat.shape)} max|.| {lat.abs().max().item():.3f}; image "
              f"{tuple(img.shape)}; alone {info['alone_vs_batch_max_abs_diff']:.1e}; strings path == "
              "embeds path")
    print(f"(e) two_prompts negative repeated vs broadcast: {meta['two_prompts']['negative_repeated_max_abs_diff']:.2e}"
          f" (equal: {meta['two_prompts']['negative_repeated_equal']}); (f) cut vs plain first 6: "
          f"{meta['cut']['cut_vs_plain_first6_max_abs_diff']:.2e}; (g) odd == 32 x 48")

    save_file({k: tensors[k].detach().clone().contiguous() for k in sorted(tensors)},
              os.path.join(root, "sample_e2e.safetensors"), metadata={"format": "pt"})
    doc = {"diffusers_version": diffusers.__version__,
           "pipeline": "QwenImagePipeline.from_pretrained('tiny_qwen_image', text_encoder=None, "
                       "tokenizer=None), called with prompt_embeds= / prompt_embeds_mask= (and the "
                       "negative ones) from the encoding below; the same latents from the prompt "
                       "strings through Diffusers' own encode_prompt with tokenizer / text encoder "
                       "stand-ins (checked)",
           "prompt_template_encode": make_prompts.TEMPLATE,
           "prompt_template_encode_start_idx": make_prompts.DROP_IDX,
           "tokenizer_max_length": make_prompts.TOKENIZER_MAX_LENGTH,
           "tokenizer": "tokenizer/ (txt, max_length=1058, padding=True, truncation=True: right "
                        "truncation, right padding to the batch's longest)",
           "text_encoder": "text_encoder/ (hidden_states[-1] at mask == 1, minus the first 34)",
           "pad_token": tok.pad_token, "pad_token_id": tok.pad_id,
           "defaults": {"true_cfg_scale": DEFAULT_TRUE_CFG, "max_sequence_length": DEFAULT_MAX_SEQ},
           "scheduler_config": {k: v for k, v in sorted(pipe.scheduler.config.items())
                                if not k.startswith("_")},
           "storage_note": "<case>.prompt_embeds / _mask are what the pipeline was given (before "
                           "its max_sequence_length cut and per-image repeat; the mask is stored "
                           "even when all ones, where the pipeline passes None to the transformer)",
           "cases": meta}
    with open(os.path.join(root, "sample_e2e.json"), "w", encoding="utf-8", newline="\n") as f:
        f.write(make_prompts.compact_scalar_lists(
            json.dumps(doc, ensure_ascii=False, indent=2, sort_keys=True)) + "\n")
    print(f"wrote {root}/sample_e2e.safetensors, sample_e2e.json")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit("usage: make_sample_e2e.py OUT_DIR  (tests/golden/qwen_image; writes "
                 "OUT_DIR/tiny_qwen_image/sample_e2e.*)")
    main(sys.argv[1])
