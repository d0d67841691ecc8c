"""Legacy text completions (/v1/completions), tokenize/detokenize, models and metrics."""

import math

import pytest

from helpers import assert_openai_error, parse_metrics

PROMPT = "The capital of France is"


def tokenize(server, text, add_special=False):
    r = server.post("/tokenize", {"content": text, "add_special": add_special})
    assert r.status == 200, r.text
    toks = r.json()["tokens"]
    assert isinstance(toks, list) and all(isinstance(t, int) for t in toks)
    return toks


def test_completion_with_prompt_string(server, client):
    r = client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=5,
                                  temperature=0)
    assert r.id.startswith("cmpl-")
    assert r.object == "text_completion"
    assert len(r.choices) == 1
    assert isinstance(r.choices[0].text, str) and r.choices[0].text
    assert r.choices[0].finish_reason in ("stop", "length")
    assert 1 <= r.usage.completion_tokens <= 5
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    # the prompt is encoded like /tokenize with special tokens
    assert r.usage.prompt_tokens == len(tokenize(server, PROMPT, add_special=True))
    assert r.model_extra["timings"]["predicted_n"] == r.usage.completion_tokens


def test_completion_with_token_ids_matches_string(server, client):
    ids = tokenize(server, PROMPT, add_special=True)
    by_ids = client.completions.create(model=server.model_id, prompt=ids, max_tokens=5,
                                       temperature=0)
    assert by_ids.usage.prompt_tokens == len(ids)
    by_text = client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=5,
                                        temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.choices[0].text.strip()


def test_completion_token_id_out_of_vocab_is_400(server):
    r = server.post("/v1/completions", {"prompt": [1, 2, 10_000_000], "max_tokens": 1})
    assert_openai_error(r, 400, param="prompt")
    r = server.post("/v1/completions", {"prompt": "", "max_tokens": 1})
    assert_openai_error(r, 400, param="prompt")


def test_completion_legacy_logprobs(server, client):
    r = client.completions.create(model=server.model_id, prompt=PROMPT, max_tokens=4,
                                  temperature=0, logprobs=2)
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert len(lp.text_offset) == n
    assert "".join(lp.tokens) == r.choices[0].text
    offsets = [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    assert lp.text_offset == offsets
    for tok, tlp, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert tlp <= 0
        assert 1 <= len(top) <= 2  # a dict keyed by token text
        assert all(v <= 0 for v in top.values())
        assert math.isclose(max(top.values()), tlp, abs_tol=1e-5)  # greedy: top choice
        assert tok in top


def test_models_lists_the_model(server, client):
    status, body = server.get_json("/v1/models")
    assert status == 200
    assert body["object"] == "list"
    assert len(body["data"]) == 1
    m = body["data"][0]
    assert m["object"] == "model" and m["id"]
    assert m["meta"]["n_slots"] == 4
    assert m["meta"]["n_ctx"] > 0
    ids = [x.id for x in client.models.list()]
    assert ids == [m["id"]]


def test_tokenize_detokenize_roundtrip(server):
    text = "Hello world, this is a round trip: 1234 + café!"
    toks = tokenize(server, text)
    assert 5 <= len(toks) <= len(text.encode())
    r = server.post("/detokenize", {"tokens": toks})
    assert r.status == 200, r.text
    assert r.json()["content"] == text
    # add_special may only add tokens
    assert len(tokenize(server, text, add_special=True)) >= len(toks)


def test_tokenize_with_pieces(server):
    """llama-server's `with_pieces`: the same ids, each with its text, or its bytes where
    they are not whole UTF-8 alone; the pieces' bytes make the text."""
    text = "Pieces: caf\u00e9 \U0001f980 crab, \u6f22\u5b57!"
    r = server.post("/tokenize", {"content": text, "with_pieces": True})
    assert r.status == 200, r.text
    got = r.json()["tokens"]
    assert [t["id"] for t in got] == tokenize(server, text)
    joined = b"".join(t["piece"].encode() if isinstance(t["piece"], str) else bytes(t["piece"])
                      for t in got)
    assert joined == text.encode()
    # the crab's four bytes do not all sit in one token of this vocabulary
    assert any(isinstance(t["piece"], list) for t in got), got


def test_tokenize_bad_body_is_400(server):
    assert_openai_error(server.post("/tokenize", {"text": "no content field"}), 400)
    assert_openai_error(server.post("/detokenize", {"tokens": ["x"]}), 400)


def test_metrics_is_prometheus_text(server):
    r = server.request("GET", "/metrics")
    assert r.status == 200
    assert r.headers["content-type"].startswith("text/plain")
    assert "# TYPE moeserve_requests_total counter" in r.text
    assert "# HELP moeserve_forward_passes_total" in r.text
    m = parse_metrics(r.text)
    for name in ("moeserve_model_loaded", "moeserve_requests_total",
                 "moeserve_prompt_tokens_total", "moeserve_generated_tokens_total",
                 "moeserve_forward_passes_total", "moeserve_requests_running",
                 "moeserve_requests_waiting"):
        assert name in m, name
    assert m["moeserve_model_loaded"] == 1


def test_health(server):
    status, body = server.get_json("/health")
    assert status == 200
    assert body["status"] == "ok"


def test_legacy_text_offset_counts_characters(server):
    r = server.post("/v1/completions", {"prompt": "La capitale de la France est",
                                        "max_tokens": 8, "temperature": 0, "logprobs": 1})
    assert r.status == 200, r.text
    ch = r.json()["choices"][0]
    lp = ch["logprobs"]
    if all(ord(c) < 128 for c in ch["text"]):
        raise RuntimeError(f"precondition: the completion should hold non-ASCII: {ch}")
    assert "".join(lp["tokens"]) == ch["text"]
    offsets = [len("".join(lp["tokens"][:i])) for i in range(len(lp["tokens"]))]
    assert lp["text_offset"] == offsets
