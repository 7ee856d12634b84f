"""Reference renderings of chat templates, for difftrain's Jinja engine (chat_template.h).

Renders templates with python3-jinja2 in the environment Transformers' `apply_chat_template`
builds (`_compile_jinja_template`: ImmutableSandboxedEnvironment with trim_blocks and
lstrip_blocks, the loopcontrols extension, a `{% generation %}` tag rendering its body, its own
`tojson` filter and the `raise_exception` / `strftime_now` globals) and with the variables it
passes (`messages`, `tools`, `documents`, `add_generation_prompt`, the special tokens, the extra
keyword arguments). Templates: Qwen3's (the tokenizer fixture's, as ZImagePipeline applies it),
a Qwen2-VL-style one (content lists), and two made to exercise the engine's corners. Also the ids
of the prompts as ZImagePipeline renders them, from make_tokenizer.py's plain-Python BPE.

    ../shared/refstack2/run python3 tests/golden/z_image/make_chat_template.py tests/golden/z_image/chat_template
"""

import json
import os
import sys

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tokenizer  # noqa: E402

QWEN2_VL_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{% if message['content'] is string %}"
    "{{ message['content'] }}<|im_end|>\n{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}{% if add_vision_id %}Picture "
    "{{ image_count.value }}: {% endif %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}{% if add_vision_id %}Video "
    "{{ video_count.value }}: {% endif %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

# Expressions, filters, tests, methods and statements a chat template may use.
FEATURES_TEMPLATE = r"""{# a comment #}
{%- set xs = [3, 1, 2] -%}
len={{ xs|length }} first={{ xs|first }} last={{ xs|last }} rev={{ xs|reverse|list }} sl={{ xs[1:] }} {{ xs[::-1] }} {{ xs[:-1] }} {{ xs[-1] }} {{ xs[5] }}.
{{ "héllo wörld"[1:4] }}|{{ "héllo"[::-1] }}|{{ "héllo"|length }}|{{ "a,b,,c".split(",") }}|{{ "  a  b  ".split() }}|{{ "a b c".split(" ", 1) }}
{{ "xxhixx".strip("x") }}|{{ "\n\nhi\n".lstrip("\n") }}|{{ "hi  ".rstrip() }}|{{ "Hello World".upper() }}|{{ "hello big world"|title }}|{{ "abcabc".replace("b", "B") }}|{{ "abc".find("c") }}
{{ 7 // 2 }} {{ -7 // 2 }} {{ -7 % 3 }} {{ 2 ** 10 }} {{ 10 / 4 }} {{ 1.5 }} {{ 0.1 + 0.2 }} {{ 1e20 }} {{ 1e-7 }} {{ 3.0 }} {{ "ab" * 3 }} {{ 1 ~ "x" ~ none }} {{ -(3) }} {{ true + 1 }}
{{ [1, 'a', none, true, 2.5, {'k': "it's"}] }} {{ {'a': 1, 'b': [1, 2]} }} {{ none }} {{ true }} {{ undefined_name }}.
{{ {'b': 1, 'a': 'é', 'c': [1, 2.0, none, true]}|tojson }} {{ {'b': 1, 'a': {'x': []}}|tojson(indent=2, sort_keys=true) }} {{ "q\"\n"|tojson }}
{{ 'yes' if 1 < 2 < 3 else 'no' }} {{ 'yes' if 3 < 2 else 'no' }} {{ 'a' in 'cat' }} {{ 2 in xs }} {{ 'k' in {'k': 1} }} {{ 5 not in xs }} {{ not 0 }} {{ 0 or 'b' }} {{ 1 and 'c' }}
{{ x is defined }} {{ xs is defined }} {{ none is none }} {{ 's' is string }} {{ 1 is number }} {{ {} is mapping }} {{ 3 is odd }} {{ 9 is divisibleby 3 }} {{ 2 is in xs }} {{ false is false }} {{ 0 is false }} {{ 1 is not none }} {{ 2 is eq 2 }}
{{ missing|default('dflt') }} {{ ''|default('dflt', true) }} {{ xs|join('-') }} {{ '  pad  '|trim }} {{ '42'|int + 1 }} {{ {'a': 1, 'b': 2}|items|list|length }} {{ users|selectattr('admin')|map(attribute='name')|join(',') }} {{ users|rejectattr('admin')|map(attribute='name')|list }} {{ users|selectattr('name', 'equalto', 'bo')|list|length }}
{%- set d = {'a': 1} %} {{ d.a }} {{ d['a'] }} {{ d.get('z', 'none-here') }} {{ d.get('a') }} {{ d.items()|list|first|last }} {{ d.keys()|list }} {{ users[0].name }} {{ users[1]['name'] }}
{%- set ns = namespace(total=0, names='') %}
{%- for u in users if u.name != 'cy' %}
  {{ loop.index }}/{{ loop.length }} {{ loop.index0 }} {{ loop.revindex }} {{ loop.first }} {{ loop.last }} {{ u.name }}
  {%- set ns.total = ns.total + loop.index %}{% set inner = 'set in loop' %}
  {%- if u.name == 'bo' %}{% continue %}{% endif %} after-continue
{%- endfor %}
total={{ ns.total }} inner={{ inner is defined }}
{% for k, v in {'p': 1, 'q': 2}.items() %}{{ k }}={{ v }};{% endfor %}
{% for x in [] %}never{% else %}empty-else{% endfor %}
{% for x in range(5) %}{% if x == 3 %}{% break %}{% endif %}{{ x }}{% endfor %} {{ range(2, 9, 3)|list }}
{% set captured %}cap {{ 1 + 1 }}{% endset %}{{ captured|upper }}
{%- if xs|length > 2 %} if-branch{% elif xs %} elif{% else %} else{% endif %}
{% generation %}gen {{ 'body' }}{% endgeneration %}
    {%+ if true %}kept-indent{% endif %}
  {{- 'no-left-space' -}}
   x   {{ 'spaced' }}   y
end"""

# trim_blocks, lstrip_blocks and the -/+ modifiers around every kind of tag.
WHITESPACE_TEMPLATE = (
    "a\n  {% if true %}\n  b\n  {% endif %}\n"
    "\t{% for i in [1, 2] %}\n\t{{ i }}\n\t{% endfor %}\n"
    "c {# note #}\n  {# own line #}\nd\n"
    "e {%- if true -%}   f   {%- endif %} g\n"
    "  {{ 'h' }}  \n"
    "i {%+ if true %}j{% endif %}\r\n"
    "{% if true %}\r\nk\n{%- endif %}\n"
    "  {%- if true %}l{% endif %}\n"
    "{% if true %}{% endif %}\n\nm\n")

SPECIAL_TOKENS = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}


def environment():
    """Transformers' _compile_jinja_template environment, restated."""

    class Generation(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    return env


def variables(messages, add_generation_prompt, tools=None, **extra):
    """apply_chat_template's render(...) arguments, in its order."""
    v = {"messages": messages, "tools": tools, "documents": None,
         "add_generation_prompt": add_generation_prompt}
    v.update(SPECIAL_TOKENS)
    v.update(extra)
    return v


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather now",
          "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                         "required": ["city"]}}}]

PROMPTS = ["a cat", "", "  a red fox, 4k\n\nsnow  ", "一只猫 🐱 on the mat",
           "text with <|im_start|> and <think> inside", "line\tone\r\nline two"]


def cases():
    out = []
    for p in PROMPTS:  # as ZImagePipeline._encode_prompt calls it
        out.append(("qwen3", variables([{"role": "user", "content": p}], True,
                                       enable_thinking=True)))
    user = [{"role": "user", "content": "draw a cat"}]
    out.append(("qwen3", variables(user, True, enable_thinking=False)))
    out.append(("qwen3", variables(user, True)))
    out.append(("qwen3", variables(user, False)))
    out.append(("qwen3", variables([{"role": "system", "content": "Be brief."}] + user, True)))
    out.append(("qwen3", variables([
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "q1"},
        {"role": "assistant", "content": "<think>\nhmm\n</think>\n\na1"},
        {"role": "user", "content": "q2"},
        {"role": "assistant", "content": "a2", "reasoning_content": "because"},
    ], False)))
    out.append(("qwen3", variables([
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": {"city": "Paris"}}},
            {"type": "function", "function": {"name": "get_weather",
                                              "arguments": "{\"city\": \"Lyon\"}"}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Sunny in Paris, rain in Lyon."},
    ], True, tools=TOOLS)))
    out.append(("qwen3", variables([{"role": "system", "content": "tools too"}] + user, True,
                                   tools=TOOLS)))
    out.append(("qwen3", variables([{"role": "user", "content": [{"type": "text", "text": "x"}]}],
                                   True)))
    out.append(("qwen2_vl", variables([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "what is this?"}, {"type": "video"},
        {"type": "image", "image": "x.png"}]}], True, add_vision_id=True)))
    out.append(("qwen2_vl", variables([{"role": "system", "content": "sys"},
                                       {"role": "user", "content": "plain"}], False)))
    users = [{"name": "al", "admin": True}, {"name": "bo", "admin": False},
             {"name": "cy", "admin": True}]
    out.append(("features", {"users": users, "x": 1}))
    out.append(("whitespace", {}))
    return out


def main(out_dir):
    os.makedirs(out_dir, exist_ok=True)
    templates = {"qwen3": make_tokenizer.QWEN3_CHAT_TEMPLATE, "qwen2_vl": QWEN2_VL_TEMPLATE,
                 "features": FEATURES_TEMPLATE, "whitespace": WHITESPACE_TEMPLATE}
    env = environment()
    compiled = {name: env.from_string(t) for name, t in templates.items()}
    rendered = [{"template": name, "variables": v, "rendered": compiled[name].render(**v)}
                for name, v in cases()]
    errors = []
    for name, source, v in [
            ("raise", "{{ raise_exception('no system role allowed') }}", {}),
            ("undefined attribute", "{{ a.b.c }}", {}),
            ("bad operand", "{{ 'a' + 1 }}", {}),
            ("not iterable", "{% for x in 3 %}{% endfor %}", {})]:
        try:
            env.from_string(source).render(**v)
            raise SystemExit(f"{name}: expected an error")
        except jinja2.exceptions.TemplateError as e:
            errors.append({"name": name, "template": source, "variables": v, "python": str(e)})
        except TypeError as e:
            errors.append({"name": name, "template": source, "variables": v, "python": str(e)})

    # The token ids of ZImagePipeline's prompts: template applied, then the tokenizer.
    tok_dir = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tokenizer")
    with open(os.path.join(tok_dir, "vocab.json"), encoding="utf-8") as f:
        vocab = json.load(f)
    with open(os.path.join(tok_dir, "merges.txt"), encoding="utf-8") as f:
        merges = [tuple(line.rstrip("\n").split(" ")) for line in f if not line.startswith("#")]
    ranks = {pair: r for r, pair in enumerate(merges)}
    added = {t: len(vocab) + k for k, t in enumerate(make_tokenizer.SPECIAL + make_tokenizer.ADDED)}
    prompts = []
    for p in PROMPTS:
        text = compiled["qwen3"].render(**variables([{"role": "user", "content": p}], True,
                                                    enable_thinking=True))
        prompts.append({"prompt": p, "text": text,
                        "ids": make_tokenizer.encode(text, vocab, ranks, added)})

    with open(os.path.join(out_dir, "expected.json"), "w", encoding="utf-8", newline="\n") as f:
        json.dump({"templates": templates, "cases": rendered, "errors": errors,
                   "pipeline_prompts": prompts}, f, ensure_ascii=False, indent=2)
        f.write("\n")
    print(f"{out_dir}: {len(rendered)} renderings, {len(errors)} errors, "
          f"{len(prompts)} pipeline prompts")


if __name__ == "__main__":
    main(sys.argv[1])
