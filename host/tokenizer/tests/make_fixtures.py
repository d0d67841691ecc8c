#!/usr/bin/env python3
"""Regenerate the tokenizer test fixtures from the SmolLM2 GGUF.

Reference implementation: the HF `tokenizers` Python library (not our code),
built from the GGUF's own vocab and merges with the pre-tokenizer that
SmolLM2's published tokenizer.json declares, and `jinja2` configured the way
`transformers.apply_chat_template` configures it.

    pip install gguf numpy tokenizers jinja2
    python3 host/tokenizer/tests/make_fixtures.py [path/to/model.gguf]

Writes (next to this script):
  fixtures/smollm2_tokenizer.json.gz  the TokenizerParts fields read from the GGUF
  fixtures/smollm2_expected.json      corpus -> expected ids, and rendered chat templates
"""
import gzip
import json
import os
import sys

import gguf
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", "..", ".."))
DEFAULT_GGUF = os.path.join(ROOT, ".cache", "models", "SmolLM2-135M-Instruct.Q4_1.gguf")


def field(reader, key, default=None):
    f = reader.fields.get(key)
    if f is None:
        return default
    return f.contents()


def read_parts(path):
    r = gguf.GGUFReader(path)
    parts = {
        "model": field(r, "tokenizer.ggml.model"),
        "pre": field(r, "tokenizer.ggml.pre"),
        "tokens": list(field(r, "tokenizer.ggml.tokens")),
        "token_types": [int(t) for t in field(r, "tokenizer.ggml.token_type", [])] or None,
        "merges": list(field(r, "tokenizer.ggml.merges", [])),
        "bos_id": field(r, "tokenizer.ggml.bos_token_id"),
        "eos_id": field(r, "tokenizer.ggml.eos_token_id"),
        "unk_id": field(r, "tokenizer.ggml.unknown_token_id"),
        "pad_id": field(r, "tokenizer.ggml.padding_token_id"),
        "eot_ids": [x for x in [field(r, "tokenizer.ggml.eot_token_id"),
                                field(r, "tokenizer.ggml.eom_token_id")] if x is not None],
        "add_bos": bool(field(r, "tokenizer.ggml.add_bos_token", False)),
        "add_eos": bool(field(r, "tokenizer.ggml.add_eos_token", False)),
        "chat_template": field(r, "tokenizer.chat_template"),
    }
    for k in ("bos_id", "eos_id", "unk_id", "pad_id"):
        if parts[k] is not None:
            parts[k] = int(parts[k])
    return parts


def hf_tokenizer(parts):
    """SmolLM2's tokenizer as its tokenizer.json describes it, from GGUF data."""
    assert parts["model"] == "gpt2" and parts["pre"] == "smollm", parts["pre"]
    vocab = {t: i for i, t in enumerate(parts["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in parts["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(t, special=True, normalized=False)
                for t, ty in zip(parts["tokens"], parts["token_types"]) if ty == 3]
    tok.add_special_tokens(specials)
    return tok


CORPUS = [
    "Hello world",
    "Hello, world! How are you today?",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure they'll say it's fine, we've done it, you'd agree, he's DONE'S",
    "fn main() {\n    println!(\"{}\", 1 + 2);\n}\n",
    "def f(x):\n\treturn x ** 2  # square\n",
    "if (a && b || !c) { return arr[i++]; } // done",
    "12345",
    "3.14159",
    "Pi is 3.14159265358979, e is 2.71828, and 1,000,000 is a million; 0x1F = 31.",
    "Version 2.0.1-beta released on 2024-12-31 at 23:59:59.",
    "Café, naïve, résumé, à la crème brûlée; Übergrößenträger müssen Straße überqueren.",
    "Les élèves étudient l'économie à l'université.",
    "你好，世界！今天天气很好。",
    "日本語のテキストです。カタカナとひらがな、漢字。",
    "Привет, мир! Как дела?",
    "مرحبا بالعالم",
    "שלום עולם",
    "नमस्ते दुनिया",
    "안녕하세요 세계",
    "สวัสดีชาวโลก",
    "Emoji: 🎉🚀👍🏽 and 👨‍👩‍👧‍👦 family, flag 🇫🇷.",
    "Combining: e\u0301 a\u0300 n\u0303 and zero\u200bwidth",
    "   leading spaces",
    "trailing spaces   ",
    "multiple     internal      spaces",
    "\n",
    "\n\n\nthree newlines before",
    "line one\nline two\r\nline three\n\n",
    "\ttab\tseparated\tvalues\t",
    " \t \n mixed whitespace \n\t ",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "<|endoftext|>",
    "text<|im_end|>more text",
    "<|im_start partial special <|im_end",
    "<repo_name>my/repo<file_sep>main.rs",
    "Mixed: Hello 世界 🌍 Привет 123 café!",
    "ALL CAPS SHOUTING AND lowercase whispering",
    "Special chars: ~`!@#$%^&*()_+-={}[]|\\:;\"'<>,.?/",
    "URL: https://example.com/path?query=1&x=y#frag",
    "email@example.org",
    "a",
    " ",
    "",
]


EXTRA_TEMPLATES = [
    # Python string methods and a namespace carried out of a loop.
    """{{ bos_token }}
{% set ns = namespace(system='', count=0) %}
{% for m in messages %}
    {% if m['role'] == 'system' %}
        {% set ns.system = m['content'].strip() %}
        {% continue %}
    {% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if m.role == 'assistant' and '</think>' in m.content %}
        {% set content = m.content.split('</think>')[-1].lstrip() %}
    {% else %}
        {% set content = m.content %}
    {% endif %}
<{{ m.role.upper() }}{{ loop.index0 }}>{{ content.replace('{name}', 'World') }}{% if not loop.last %}|{% endif %}

{% endfor %}
{% if ns.system.startswith('Answer') and ns.system.endswith('.') %}[sys:{{ ns.system|length }}:{{ ns.system.lower() }}]{% endif %}
{% if add_generation_prompt %}<ASSISTANT>{% endif %}{{ ns.count }}""",
    # Whitespace control, tojson, raise_exception in a branch not taken, dict items.
    """{%- for message in messages -%}
    {%- if message.role not in ['system', 'user', 'assistant'] -%}
        {{- raise_exception('bad role ' + message.role) -}}
    {%- endif -%}
    {{- message | tojson -}}
    {%- if loop.first %} first{% endif %}

{% endfor -%}
{%- for k, v in {'a': 1, 'b': [1, 2.5, none, true]}.items() %}
{{ k }}={{ v | tojson }} {{ v | tojson(indent=2) }}
{%- endfor %}
{{ eos_token }}{% if messages | length > 3 %}{{ messages[-1]['content'] | trim }}{% endif %}
""",
]


def random_corpus(n, seed=20240601):
    """Random strings over a pool that stresses the split rules: mixed scripts,
    digit runs, whitespace runs, contractions, punctuation, special-token text."""
    import random
    rng = random.Random(seed)
    pool = (list("abcXYZ019'.,!?-_ ") + [" ", "  ", "\n", "\t", "\r\n", "\u00a0"]
            + list("éüßçñ") + list("中文日本語") + list("кирилица") + list("العربية")
            + ["🎉", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷"]
            + ["'s", "'ll", "'RE", "123", "3.14", "<|im_start|>", "<|im_end|>", "<|endoftext|>",
               "<|im_", "|>"])
    return ["".join(rng.choice(pool) for _ in range(rng.randint(1, 30))) for _ in range(n)]


def render_chat(template, messages, add_generation_prompt, bos, eos):
    """The template rendered the way transformers renders chat templates."""
    def raise_exception(message):
        raise RuntimeError(message)

    def tojson(x, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=False, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.globals["raise_exception"] = raise_exception
    env.filters["tojson"] = tojson
    return env.from_string(template).render(
        messages=messages, add_generation_prompt=add_generation_prompt,
        bos_token=bos, eos_token=eos)


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_GGUF
    parts = read_parts(path)
    tok = hf_tokenizer(parts)

    cases = []
    for text in CORPUS + random_corpus(200):
        tok.encode_special_tokens = False
        with_special = tok.encode(text, add_special_tokens=False).ids
        tok.encode_special_tokens = True
        without_special = tok.encode(text, add_special_tokens=False).ids
        tok.encode_special_tokens = False
        cases.append({"text": text, "ids": with_special, "ids_no_special": without_special})

    bos = parts["tokens"][parts["bos_id"]]
    eos = parts["tokens"][parts["eos_id"]]
    chats = []
    conversations = [
        ([{"role": "system", "content": "You are a concise assistant."},
          {"role": "user", "content": "What is the capital of France?"}], True),
        ([{"role": "user", "content": "Hi there! 👋"}], True),
        ([{"role": "system", "content": "Be brief."},
          {"role": "user", "content": "Hello"},
          {"role": "assistant", "content": "Hi! How can I help?"},
          {"role": "user", "content": "Tell me a joke."}], False),
    ]
    for messages, agp in conversations:
        chats.append({
            "messages": messages,
            "add_generation_prompt": agp,
            "expected": render_chat(parts["chat_template"], messages, agp, bos, eos),
        })

    # Templates that use what real chat templates use: Python string methods,
    # namespace, loop controls, whitespace control, tojson, raise_exception.
    templates = []
    for template in EXTRA_TEMPLATES:
        messages = [{"role": "system", "content": "  Answer in French.  "},
                    {"role": "user", "content": "Hello, {name}! ünïcödé 你好"},
                    {"role": "assistant", "content": "<think>hmm</think>Bonjour !"},
                    {"role": "user", "content": "Quote: \"x\"\tand\nnewline"}]
        templates.append({
            "template": template,
            "messages": messages,
            "add_generation_prompt": True,
            "expected": render_chat(template, messages, True, bos, eos),
        })

    os.makedirs(os.path.join(HERE, "fixtures"), exist_ok=True)
    with gzip.GzipFile(os.path.join(HERE, "fixtures", "smollm2_tokenizer.json.gz"), "wb",
                       mtime=0) as f:
        f.write(json.dumps(parts, ensure_ascii=False, separators=(",", ":")).encode("utf-8"))
    # One case per line: readable diffs without one id per line.
    def line(obj):
        return json.dumps(obj, ensure_ascii=False)

    with open(os.path.join(HERE, "fixtures", "smollm2_expected.json"), "w", encoding="utf-8") as f:
        f.write('{"source": %s,\n "cases": [\n  ' % line(os.path.basename(path)))
        f.write(",\n  ".join(line(c) for c in cases))
        f.write('\n ],\n "chats": [\n  ')
        f.write(",\n  ".join(line(c) for c in chats))
        f.write('\n ],\n "templates": [\n  ')
        f.write(",\n  ".join(line(c) for c in templates))
        f.write("\n ]\n}\n")
    print(f"wrote {len(cases)} encode cases, {len(chats)} chat cases, "
          f"{len(templates)} template cases")


if __name__ == "__main__":
    main()
