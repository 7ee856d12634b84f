#!/usr/bin/env python3
"""Makes tests/golden/z_image/tokenizer/: a tiny Qwen2-style byte-level BPE tokenizer folder and
the ids its reference encoding gives for a list of hard cases.

Run with refstack2's Python (python3-regex):
    ../shared/refstack2/run python3 tests/golden/z_image/make_tokenizer.py tests/golden/z_image/tokenizer
Re-running writes byte-identical files.

The folder is what Qwen2TokenizerFast.save_pretrained writes for Qwen3 (Z-Image's `tokenizer/`):
vocab.json, merges.txt, tokenizer.json (model, added tokens, NFC normalizer, the Split
pre-tokenizer with Qwen's pattern, byte-level) and tokenizer_config.json, with a vocabulary
trained here (transformers and tokenizers are not available here, and no hub): BPE merges learnt
from the corpus below, most frequent pair first, ties broken by the pair's text. Qwen3's special
tokens keep their names.

The reference encoding (expected.json) is the slow Qwen2Tokenizer's algorithm in plain Python:
added tokens split out first (longest at each position), NFC on the text between them, Qwen's
pre-tokenizer pattern with the `regex` module, each piece's UTF-8 bytes through GPT-2's
bytes_to_unicode, BPE by merge rank, vocabulary lookup.
"""
import json
import os
import sys
import unicodedata

import regex

# Qwen2's pre-tokenizer pattern (Qwen2Tokenizer's PRETOKENIZE_REGEX, tokenizer.json's Split).
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>",
           "<|object_ref_end|>", "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>",
           "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>", "<|image_pad|>",
           "<|video_pad|>"]
# Added but not special (Qwen3 lists them the same way): matched before BPE too.
ADDED = ["<tool_call>", "</tool_call>", "<think>", "</think>"]

# Qwen3's chat template (the instruct models' tokenizer_config.json "chat_template", which
# Z-Image's tokenizer folder carries): data, rendered by make_chat_template.py with python3-jinja2.
QWEN3_CHAT_TEMPLATE = r"""{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\n\n' }}
    {%- endif %}
    {{- "# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>" }}
    {%- for tool in tools %}
        {{- "\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n" }}
{%- else %}
    {%- if messages[0].role == 'system' %}
        {{- '<|im_start|>system\n' + messages[0].content + '<|im_end|>\n' }}
    {%- endif %}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" and message.content is string and not(message.content.startswith('<tool_response>') and message.content.endswith('</tool_response>')) %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- if message.content is string %}
        {%- set content = message.content %}
    {%- else %}
        {%- set content = '' %}
    {%- endif %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\n' + content + '<|im_end|>' + '\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- else %}
            {%- if '</think>' in content %}
                {%- set reasoning_content = content.split('</think>')[0].rstrip('\n').split('<think>')[-1].lstrip('\n') %}
                {%- set content = content.split('</think>')[-1].lstrip('\n') %}
            {%- endif %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index %}
            {%- if loop.last or (not loop.last and reasoning_content) %}
                {{- '<|im_start|>' + message.role + '\n<think>\n' + reasoning_content.strip('\n') + '\n</think>\n\n' + content.lstrip('\n') }}
            {%- else %}
                {{- '<|im_start|>' + message.role + '\n' + content }}
            {%- endif %}
        {%- else %}
            {{- '<|im_start|>' + message.role + '\n' + content }}
        {%- endif %}
        {%- if message.tool_calls %}
            {%- for tool_call in message.tool_calls %}
                {%- if (loop.first and content) or (not loop.first) %}
                    {{- '\n' }}
                {%- endif %}
                {%- if tool_call.function %}
                    {%- set tool_call = tool_call.function %}
                {%- endif %}
                {{- '<tool_call>\n{"name": "' }}
                {{- tool_call.name }}
                {{- '", "arguments": ' }}
                {%- if tool_call.arguments is string %}
                    {{- tool_call.arguments }}
                {%- else %}
                    {{- tool_call.arguments | tojson }}
                {%- endif %}
                {{- '}\n</tool_call>' }}
            {%- endfor %}
        {%- endif %}
        {{- '<|im_end|>\n' }}
    {%- elif message.role == "tool" %}
        {%- if loop.first or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' }}
        {{- content }}
        {{- '\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}"""

CORPUS = """
A photo of a cat sitting on a red chair, studio lighting, 4k, highly detailed.
The quick brown fox jumps over the lazy dog. It's what they'll say; we've seen it, I'm sure.
Photorealistic portrait of an astronaut riding a horse on Mars, 1985 film grain.
一只可爱的小猫坐在窗台上，阳光明媚。中国山水画，水墨风格，远山和小船。
東京の夜景、ネオンサイン、雨の道。こんにちは世界。
Ünïcödé façade café naïve résumé Straße Ελληνικά русский текст.
Emoji party 🎉🐱🚀 and numbers 12345, 3.14159, 2026-12-06, $19.99 and 100%.
    indented code:\tif x == 1:\n        return y  # comment
Line one.
Line two.

Paragraph after a blank line, with trailing spaces   
and CRLF\r\nline endings.
"""

HARD_CASES = [
    "",
    "a",
    "A cat",
    "a photo of a cat sitting on a red chair",
    "It's they'LL we've I'M you'd",
    "Numbers: 12345 and 3.14159, 2026-12-06",
    "  leading spaces",
    "trailing spaces   ",
    "tabs\tand\t\ttabs",
    "new\nlines\n\n\nand\r\nCRLF",
    "一只可爱的小猫坐在窗台上",
    "東京の夜景 and English mixed",
    "emoji 🎉🐱🚀 inside",
    "e\u0301 composed by NFC",  # e + combining acute -> é
    "café naïve Straße",
    "<|im_start|>user\nA cat<|im_end|>\n<|im_start|>assistant\n",
    "special tokens<|endoftext|>inside<|im_end|>text",
    "<think>\n\n</think>\n\n",
    "!!! ??? ... ---",
    "$19.99 (100%) #hashtag @user",
    "小狗在山上跑，月亮很圆。",
    "Ünïcödé ÜNÏCÖDÉ",
    "🙂 an unseen emoji",
    "\u00a0no-break\u3000ideographic space\u2003em",
    "tab\t\n\tmixed \n \n",
    "x" * 300,
    "word " * 40,
]


def bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


BYTE_ENCODER = bytes_to_unicode()


def pieces(text):
    return regex.findall(PATTERN, text)


def to_symbols(piece):
    return "".join(BYTE_ENCODER[b] for b in piece.encode("utf-8"))


def train_merges(corpus, count):
    words = {}
    for piece in pieces(unicodedata.normalize("NFC", corpus)):
        w = tuple(to_symbols(piece))
        words[w] = words.get(w, 0) + 1
    merges = []
    for _ in range(count):
        pairs = {}
        for w, n in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] = pairs.get((a, b), 0) + n
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        merges.append(best)
        merged = {}
        for w, n in words.items():
            out = []
            i = 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == best:
                    out.append(w[i] + w[i + 1])
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] = merged.get(tuple(out), 0) + n
        words = merged
    return merges


def bpe(symbols, ranks):
    word = list(symbols)
    while len(word) > 1:
        best = None
        for i, pair in enumerate(zip(word, word[1:])):
            r = ranks.get(pair)
            if r is not None and (best is None or r < best[0]):
                best = (r, pair)
        if best is None:
            break
        first, second = best[1]
        out = []
        i = 0
        while i < len(word):
            if i + 1 < len(word) and word[i] == first and word[i + 1] == second:
                out.append(first + second)
                i += 2
            else:
                out.append(word[i])
                i += 1
        word = out
    return word


def encode(text, vocab, ranks, added):
    ids = []
    i = 0
    plain = ""

    def flush(segment):
        for piece in pieces(unicodedata.normalize("NFC", segment)):
            ids.extend(vocab[s] for s in bpe(to_symbols(piece), ranks))

    longest_first = sorted(added, key=lambda t: (-len(t), t))
    while i < len(text):
        match = next((t for t in longest_first if text.startswith(t, i)), None)
        if match is not None:
            flush(plain)
            plain = ""
            ids.append(added[match])
            i += len(match)
        else:
            plain += text[i]
            i += 1
    flush(plain)
    return ids


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    merges = train_merges(CORPUS, 400)
    vocab = {}
    for b in range(256):  # every byte symbol, in byte order
        vocab[BYTE_ENCODER[b]] = len(vocab)
    for a, b in merges:
        if a + b not in vocab:
            vocab[a + b] = len(vocab)
    ranks = {pair: r for r, pair in enumerate(merges)}
    added = {}
    for t in SPECIAL + ADDED:
        added[t] = len(vocab) + len(added)

    def dump(name, value):
        with open(os.path.join(out_dir, name), "w", encoding="utf-8", newline="\n") as f:
            json.dump(value, f, ensure_ascii=False, indent=2)
            f.write("\n")

    dump("vocab.json", vocab)
    with open(os.path.join(out_dir, "merges.txt"), "w", encoding="utf-8", newline="\n") as f:
        f.write("#version: 0.2\n")
        for a, b in merges:
            f.write(a + " " + b + "\n")
    added_list = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                   "normalized": False, "special": t in SPECIAL} for t, i in added.items()]
    dump("tokenizer.json", {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": added_list,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PATTERN}, "behavior": "Isolated",
             "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
             "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                           "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False,
                    "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None,
                  "continuing_subword_prefix": "", "end_of_word_suffix": "",
                  "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    })
    dump("tokenizer_config.json", {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": {str(i): {k: v for k, v in e.items() if k != "id"}
                                 for e in added_list for i in [e["id"]]},
        "bos_token": None,
        "chat_template": QWEN3_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": 131072,
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    })
    cases = [{"text": t, "ids": encode(t, vocab, ranks, added)} for t in HARD_CASES]
    dump("expected.json", {"pattern": PATTERN, "cases": cases})
    print(f"{out_dir}: {len(vocab)} tokens, {len(merges)} merges, {len(added)} added, "
          f"{len(cases)} cases")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "tokenizer"))
