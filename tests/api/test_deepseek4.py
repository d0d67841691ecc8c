"""A DeepSeek-V4 model served through the API: the release-format tiny checkpoint
(tests/fixtures/deepseek4/tiny_release, FP8 + MXFP4 + a byte-level BPE tokenizer) converted
with `moeserve convert`, then served on the CPU backend. Greedy answers through the API
equal `moeserve generate` on the same text, and concurrent requests (continuous batching
over the per-sequence compressor state) equal the same requests served alone."""

import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import BIN, CONFIG, ROOT, Server

FIXTURE = ROOT / "tests/fixtures/deepseek4/tiny_release"
PROMPTS = ["The router scores", "A compressor pools", "Small numbers make", "attention layers"]


@pytest.fixture(scope="module")
def ds4_model(tmp_path_factory):
    out = tmp_path_factory.mktemp("ds4") / "tiny_release.gguf"
    subprocess.run([str(BIN), "--config", str(CONFIG), "convert", str(FIXTURE), "--out", str(out)],
                   check=True, capture_output=True)
    return out


@pytest.fixture(scope="module")
def ds4_server(ds4_model):
    s = Server("--parallel", "4", model=ds4_model)
    s.start()
    yield s
    s.close()


def complete(server, prompt):
    r = server.client().completions.create(model=server.model_id, prompt=prompt, temperature=0,
                                           max_tokens=12)
    return r.choices[0].text


def test_served_greedy_equals_generate(ds4_server, ds4_model):
    for p in PROMPTS[:2]:
        cli = subprocess.run([str(BIN), "--config", str(CONFIG), "generate", "--model", str(ds4_model),
                              "--prompt", p, "--raw", "--max-tokens", "12"],
                             check=True, capture_output=True, text=True).stdout
        assert complete(ds4_server, p) == cli.rstrip("\n")


def test_concurrent_requests_equal_served_alone(ds4_server):
    alone = [complete(ds4_server, p) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        together = list(ex.map(lambda p: complete(ds4_server, p), PROMPTS))
    assert together == alone


def test_prompt_extending_a_slot_continues_its_state(ds4_server):
    """The compressed state cannot be rewound, so only a prompt that extends all a
    slot holds reuses it; the answer equals a full prefill's."""
    def run(prompt, **kw):
        r = ds4_server.post("/v1/completions", {"prompt": prompt, "max_tokens": 6,
                                                "temperature": 0, "logprobs": 2, **kw})
        assert r.status == 200, r.text
        body = r.json()
        return body["usage"]["timings"]["cached_prefix_tokens"], body["choices"][0]

    ids = ds4_server.post("/tokenize", {"content": "The router scores the experts and"}).json()["tokens"]
    # one token generated: the slot holds exactly the prompt
    r = ds4_server.post("/v1/completions", {"prompt": ids, "max_tokens": 1, "temperature": 0})
    assert r.status == 200, r.text
    longer = ids + ids[:5]
    got, ans = run(longer)
    assert got == len(ids)
    full_cached, full = run(longer, cache_prompt=False)
    assert full_cached == 0
    assert ans == full
    # a prompt that diverges inside what a slot holds starts over
    got, _ = run(ids[:-2] + ids[:3])
    assert got == 0
