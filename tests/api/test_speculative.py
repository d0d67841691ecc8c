"""Speculative decoding (prompt-lookup drafts checked in the step's forward pass) gives
exactly the tokens and logprobs of plain decoding: a server that drafts (`--draft-max
3`) against the shared one, which does not (the default, 0)."""

import pytest

from helpers import BIN, CONFIG, LONG_PROMPT, MODEL, Server, chat_body

REPEAT = "Write the word BETA forty times, separated by spaces: BETA BETA BETA BETA"


@pytest.fixture(scope="module")
def spec_server():
    with Server("--parallel", "2", "--draft-max", "3") as s:
        yield s


@pytest.fixture(scope="module")
def plain_server(server):
    return server


@pytest.mark.parametrize("prompt", [REPEAT, LONG_PROMPT], ids=["repeat", "count"])
def test_drafted_greedy_equals_plain_greedy(spec_server, plain_server, prompt):
    body = chat_body(prompt, temperature=0, max_tokens=60, logprobs=True, top_logprobs=2)
    spec, plain = spec_server.post("/v1/chat/completions", body), plain_server.post(
        "/v1/chat/completions", body)
    assert spec.status == plain.status == 200, (spec.text, plain.text)
    s, p = spec.json(), plain.json()
    assert s["choices"][0]["message"] == p["choices"][0]["message"]
    assert s["choices"][0]["logprobs"] == p["choices"][0]["logprobs"]
    assert s["choices"][0]["finish_reason"] == p["choices"][0]["finish_reason"]
    assert s["usage"]["completion_tokens"] == p["usage"]["completion_tokens"]
    assert s["usage"]["spec_decode_ran"] is True
    assert p["usage"]["spec_decode_ran"] is False and p["usage"]["accept_rate"] == 0
    t = s["timings"]
    assert 0 <= t["draft_n_accepted"] <= t["draft_n"]
    assert s["usage"]["accept_rate"] == pytest.approx(
        t["draft_n_accepted"] / t["draft_n"] if t["draft_n"] else 0, abs=1e-3)


def test_repetitive_text_accepts_drafts_and_takes_fewer_passes(spec_server):
    before = spec_server.metrics()
    r = spec_server.post("/v1/chat/completions", chat_body(REPEAT, temperature=0, max_tokens=60))
    after = spec_server.metrics()
    body = r.json()
    n = body["usage"]["completion_tokens"]
    assert body["usage"]["accept_rate"] > 0.3, body["usage"]
    passes = after["moeserve_forward_passes_total"] - before["moeserve_forward_passes_total"]
    # one pass for the prompt, then fewer than one a token
    assert passes < n, (passes, n)
    assert (after["moeserve_draft_tokens_accepted_total"]
            - before["moeserve_draft_tokens_accepted_total"]) == body["timings"]["draft_n_accepted"]


def test_stop_strings_and_length_limits_hold_with_drafts(spec_server, plain_server):
    for body in [
        {"prompt": LONG_PROMPT, "max_tokens": 30, "temperature": 0, "stop": ", 9,"},
        {"prompt": REPEAT, "max_tokens": 7, "temperature": 0},
        {"prompt": REPEAT, "max_tokens": 7, "temperature": 0, "stream": True},
    ]:
        a, b = spec_server.post("/v1/completions", body), plain_server.post("/v1/completions", body)
        assert a.status == b.status == 200
        if body.get("stream"):
            assert a.text.count("data:") > 2
            continue
        assert a.json()["choices"] == b.json()["choices"]
        assert a.json()["usage"]["completion_tokens"] == b.json()["usage"]["completion_tokens"]


# Seeded sampling settings: temperature alone, with each cut, with penalties (which count
# the tokens taken so far, drafted ones included) and with logit bias and logprobs.
SAMPLED = [
    {"temperature": 0.7, "seed": 3},
    {"temperature": 1.0, "top_p": 0.9, "seed": 5},
    {"temperature": 0.9, "top_k": 20, "presence_penalty": 0.4, "frequency_penalty": 0.3,
     "seed": 7, "logprobs": True, "top_logprobs": 3},
    {"temperature": 1.3, "min_p": 0.05, "logit_bias": {"13": 2.0}, "seed": 11},
]


@pytest.mark.parametrize("sampling", SAMPLED, ids=["t0.7", "top_p", "penalties", "min_p"])
def test_drafted_sampling_equals_plain_sampling(spec_server, plain_server, sampling):
    """Sampled requests draft too: each drafted row is sampled only while every draft
    before it matched, one draw a kept token, so a seeded request gives plain decoding's
    tokens and logprobs; on the repetitive text some drafts are kept."""
    body = chat_body(REPEAT, max_tokens=60, **sampling)
    spec, plain = spec_server.post("/v1/chat/completions", body), plain_server.post(
        "/v1/chat/completions", body)
    assert spec.status == plain.status == 200, (spec.text, plain.text)
    s, p = spec.json(), plain.json()
    assert s["choices"][0] == p["choices"][0], sampling
    assert s["usage"]["completion_tokens"] == p["usage"]["completion_tokens"]
    assert s["usage"]["spec_decode_ran"] is True
    assert p["usage"]["spec_decode_ran"] is False
    assert s["timings"]["draft_n"] > 0, s["timings"]
    if sampling["temperature"] <= 1.0:
        assert s["timings"]["draft_n_accepted"] > 0, s["timings"]


def test_drafted_passes_give_decode_logits(tmp_path):
    """`moeserve logits --mode draft` (passes of a token and 7 drafts, some made up and
    dropped after) gives every position token-by-token decoding's logits, bit for bit,
    on fresh random tokens."""
    import random
    import subprocess

    import numpy as np
    tokens = ",".join(str(random.randrange(1000, 20000)) for _ in range(30))
    got = {}
    for mode in ("decode", "draft"):
        out = tmp_path / f"{mode}.npy"
        subprocess.run([str(BIN), "--config", str(CONFIG), "logits", "--model", str(MODEL),
                        "--tokens", tokens, "--mode", mode, "--out", str(out)],
                       check=True, capture_output=True)
        got[mode] = np.load(out)
    assert got["draft"].shape == got["decode"].shape == (30, 49152)
    assert np.array_equal(got["draft"], got["decode"]), tokens


def test_default_temperature_makes_requests_without_one_greedy():
    """`--default-temperature 0` makes a request that leaves `temperature` out greedy
    (the same answer as temperature 0); drafting runs whatever the temperature."""
    with Server("--parallel", "1", "--draft-max", "3", "--default-temperature", "0") as s:
        omitted = s.post("/v1/chat/completions", chat_body(REPEAT, max_tokens=30)).json()
        greedy = s.post("/v1/chat/completions",
                        chat_body(REPEAT, temperature=0, max_tokens=30)).json()
        hot = s.post("/v1/chat/completions",
                     chat_body(REPEAT, temperature=1.0, seed=1, max_tokens=30)).json()
    assert omitted["usage"]["spec_decode_ran"] is True
    assert omitted["choices"][0]["message"] == greedy["choices"][0]["message"]
    assert hot["usage"]["spec_decode_ran"] is True


def test_requests_without_temperature_sample_and_draft(spec_server, plain_server):
    """Upstream's pain point: a request that leaves `temperature` out samples at OpenAI's
    1.0, and there drafted nothing. Here it drafts, and a seeded one gives plain
    decoding's answer."""
    body = chat_body(REPEAT, max_tokens=30, seed=21)
    assert "temperature" not in body
    s = spec_server.post("/v1/chat/completions", body).json()
    p = plain_server.post("/v1/chat/completions", body).json()
    assert s["usage"]["spec_decode_ran"] is True
    assert s["choices"][0] == p["choices"][0]
