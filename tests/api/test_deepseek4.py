"""A DeepSeek-V4 model served through the API: the release-format tiny checkpoint
(tests/fixtures/deepseek4/tiny_release, FP8 + MXFP4 + a byte-level BPE tokenizer) converted
with `moeserve convert`, then served on the CPU backend. Greedy answers through the API
equal `moeserve generate` on the same text, concurrent requests (continuous batching
over the per-sequence compressor state) equal the same requests served alone, and
speculative decoding (drafted passes the slot goes back into) changes nothing."""

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


def complete(server, prompt, max_tokens=12):
    r = server.client().completions.create(model=server.model_id, prompt=prompt, temperature=0,
                                           max_tokens=max_tokens)
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
    """The compressed state cannot be rewound (but into a drafted pass), so only a
    prompt that extends all a slot holds reuses it; the answer equals a full prefill's."""
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


def logits(model, tokens, mode):
    """`moeserve logits` of `tokens` in `mode`, as an array [tokens, vocab]."""
    import tempfile

    import numpy as np
    with tempfile.TemporaryDirectory() as d:
        out = f"{d}/{mode}.npy"
        subprocess.run([str(BIN), "--config", str(CONFIG), "logits", "--model", str(model),
                        "--tokens", ",".join(map(str, tokens)), "--mode", mode, "--out", out],
                       check=True, capture_output=True)
        return np.load(out)


@pytest.mark.parametrize("name", ["tiny_release", "tiny_odd", "tiny_mixed", "tiny_release_ratios"])
def test_drafted_passes_give_decode_logits(tmp_path, name):
    """Passes of a token plus drafts, some made up and dropped after (the slot goes back
    into the pass: its window and compressor rings restored), give every position the
    logits of token-by-token decoding on the CPU backend: bit for bit on tiny_release;
    on the others within 5e-5, the order of the gap a batched prefill has too (some
    multi-token ops sum in another order: both gaps reached 1.0 - 1.1e-5 on some fresh
    tokens of tiny_odd; a ring row restored wrong moves logits by ~1-10), with the
    same greedy token everywhere. Fresh random tokens; 40 positions cross several
    compressor windows and wrap the sliding window (5 - 16 rows here) many times."""
    import json

    import numpy as np
    fixture = ROOT / "tests/fixtures/deepseek4" / name
    model = tmp_path / f"{name}.gguf"
    subprocess.run([str(BIN), "--config", str(CONFIG), "convert", str(fixture), "--out", str(model)],
                   check=True, capture_output=True)
    vocab = json.loads((fixture / "config.json").read_text())["vocab_size"]
    tokens = np.random.default_rng().integers(0, vocab, 40).tolist()
    decode, drafted = logits(model, tokens, "decode"), logits(model, tokens, "draft")
    assert drafted.shape == decode.shape == (40, vocab)
    gap = np.abs(drafted - decode).max()
    if name == "tiny_release":
        assert gap == 0, (tokens, gap)
    prefill_gap = np.abs(logits(model, tokens, "prefill") - decode).max()
    assert gap <= 5e-5, (tokens, gap, prefill_gap)
    assert (drafted.argmax(axis=1) == decode.argmax(axis=1)).all(), tokens


@pytest.fixture(scope="module")
def ds4_spec_server(ds4_model):
    # (more than the 7 a pass this model can drop: the scheduler holds each pass to 7)
    s = Server("--parallel", "2", "--draft-max", "12", model=ds4_model)
    s.start()
    yield s
    s.close()


def drafted_equals_plain(spec_server, plain_server, prompt, max_tokens, **sampling):
    """One request (greedy unless `sampling` says otherwise) to both servers: the same
    choice, logprobs included; the drafting server's response (drafting ran there, not
    on the other)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "logprobs": 2,
            **sampling}
    spec, plain = spec_server.post("/v1/completions", body), plain_server.post(
        "/v1/completions", body)
    assert spec.status == plain.status == 200, (spec.text, plain.text)
    s, p = spec.json(), plain.json()
    assert s["choices"][0] == p["choices"][0], prompt
    assert s["usage"]["spec_decode_ran"] is True
    assert p["usage"]["spec_decode_ran"] is False
    return s


def test_speculative_decoding_equals_plain(ds4_spec_server, ds4_server):
    """Greedy answers with prompt-lookup drafts (rejected ones dropped from the
    compressed state) are plain decoding's, logprobs included; drafts were offered."""
    drafted = accepted = 0
    for prompt in ["BETA BETA BETA BETA BETA BETA BETA BETA", *PROMPTS]:
        s = drafted_equals_plain(ds4_spec_server, ds4_server, prompt, 40)
        drafted += s["timings"]["draft_n"]
        accepted += s["timings"]["draft_n_accepted"]
    # both kinds ran: passes whose drafts were kept and passes the slot went back into
    assert 0 < accepted < drafted


def test_concurrent_drafting_sequences_equal_plain(ds4_spec_server, ds4_server):
    """Sequences drafting side by side (each slot saving and restoring its own rings in
    the same passes) answer as plain decoding does alone."""
    before = ds4_spec_server.metrics()
    plain = [complete(ds4_server, p, 40) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        together = list(ex.map(lambda p: complete(ds4_spec_server, p, 40), PROMPTS * 2))
    assert together == plain * 2
    after = ds4_spec_server.metrics()
    assert after["moeserve_draft_tokens_total"] > before["moeserve_draft_tokens_total"]


def test_prompt_continuing_a_drafted_pass(ds4_spec_server, ds4_model):
    """A sequence that stops inside a drafted pass (a stop string met on an accepted
    draft) leaves its slot past the tokens it fed: the rest of the pass's drafts are in
    the caches. A prompt that extends what the slot holds goes back into that pass and
    continues; the answer equals a full prefill's."""
    import json
    hits = 0
    for prompt in ["BETA BETA BETA BETA BETA BETA BETA BETA", *PROMPTS]:
        ids = ds4_spec_server.post("/tokenize", {"content": prompt}).json()["tokens"]
        # the served greedy ids (test_served_greedy_equals_generate: the same as generate's)
        out = subprocess.run([str(BIN), "--config", str(CONFIG), "generate", "--model", str(ds4_model),
                              "--prompt-tokens", ",".join(map(str, ids)), "--max-tokens", "40", "--ids"],
                             check=True, capture_output=True, text=True).stdout
        gen = [int(x) for x in out.split(",") if x.strip()]
        text = ds4_spec_server.post("/detokenize", {"tokens": gen}).json()["content"]
        for cut in range(4, len(text) - 1, 3):
            stop = text[cut:cut + 2]
            r = ds4_spec_server.post("/v1/completions", {"prompt": ids, "max_tokens": 40,
                                                         "temperature": 0, "stop": [stop]})
            assert r.status == 200, r.text
            c = r.json()["usage"]["completion_tokens"]
            if r.json()["choices"][0]["finish_reason"] != "stop" or c < 2:
                continue
            # the slot holds the prompt and every generated token but the last
            longer = ids + gen[:c - 1] + ids[:3]
            body = {"prompt": longer, "max_tokens": 4, "temperature": 0, "logprobs": 2}
            hit = ds4_spec_server.post("/v1/completions", body).json()
            full = ds4_spec_server.post("/v1/completions", {**body, "cache_prompt": False}).json()
            assert hit["choices"][0] == full["choices"][0], (prompt, stop)
            hits += hit["usage"]["timings"]["cached_prefix_tokens"] == len(ids) + c - 1
    assert hits > 0


@pytest.fixture(scope="module")
def ds4_mtp_file(tmp_path_factory):
    mtp = tmp_path_factory.mktemp("ds4mtp") / "mtp.gguf"
    subprocess.run([str(BIN), "--config", str(CONFIG), "convert", str(FIXTURE) + "_mtp", "--mtp",
                    "--out", str(mtp)], check=True, capture_output=True)
    return mtp


@pytest.fixture(scope="module")
def ds4_mtp_server(ds4_model, ds4_mtp_file):
    """Drafting with the MTP block of tiny_release_mtp (`convert --mtp`; its parity with
    llama.cpp is tests/parity/test_deepseek4_mtp.py)."""
    s = Server("--parallel", "2", "--draft-max", "4", "--mtp", str(ds4_mtp_file), model=ds4_model)
    s.start()
    yield s
    s.close()


def test_mtp_drafting_equals_plain(ds4_mtp_server, ds4_server):
    """Greedy answers with the MTP block's drafts are plain decoding's, logprobs included;
    every step offered drafts (the block drafts from any text, unlike prompt lookup)."""
    for prompt in PROMPTS:
        s = drafted_equals_plain(ds4_mtp_server, ds4_server, prompt, 24)
        n = s["usage"]["completion_tokens"]
        # a pass per accepted run: at least (tokens - 1) / 5 passes of up to 4 drafts
        assert s["timings"]["draft_n"] >= n // 5, s["timings"]


@pytest.mark.parametrize("sampling", [{"temperature": 0.2, "seed": 5},
                                      {"temperature": 1.0, "top_p": 0.9, "seed": 9}])
def test_sampled_drafting_equals_plain(ds4_spec_server, ds4_mtp_server, ds4_server, sampling):
    """Seeded sampled requests draft too (prompt lookup and the MTP block) and answer as
    plain decoding does, logprobs included: a drafted row is sampled only once every
    draft before it matched, one draw a kept token."""
    offered = kept = 0
    for spec in (ds4_spec_server, ds4_mtp_server):
        for prompt in ["BETA BETA BETA BETA BETA BETA BETA BETA", PROMPTS[0]]:
            t = drafted_equals_plain(spec, ds4_server, prompt, 24, **sampling)["timings"]
            offered, kept = offered + t["draft_n"], kept + t["draft_n_accepted"]
    assert offered > 0
    if sampling["temperature"] < 0.5:
        # rows after a kept draft were sampled too (the random tiny model keeps few)
        assert kept > 0


def test_mtp_drafting_sequences_side_by_side(ds4_mtp_server, ds4_server):
    """Two slots drafting with the block at once (each with its own window and states)
    answer as plain decoding does."""
    plain = [complete(ds4_server, p, 24) for p in PROMPTS]
    with ThreadPoolExecutor(len(PROMPTS)) as ex:
        together = list(ex.map(lambda p: complete(ds4_mtp_server, p, 24), PROMPTS))
    assert together == plain


def test_mtp_draft_p_min_stops_unsure_chains(ds4_model, ds4_mtp_file, ds4_server):
    """`--draft-p-min 1` drafts nothing (no guess is certain): drafting ran, offered no
    drafts, and the answer is plain decoding's."""
    with Server("--parallel", "1", "--draft-max", "4", "--mtp", str(ds4_mtp_file),
                "--draft-p-min", "1", model=ds4_model) as s:
        r = drafted_equals_plain(s, ds4_server, PROMPTS[0], 16)
        assert r["timings"]["draft_n"] == 0, r["timings"]


@pytest.mark.parametrize("drafter", [False, True], ids=["plain", "mtp"])
def test_prompt_mark_serves_prompts_sharing_an_earlier_prompt(ds4_model, ds4_mtp_file, drafter):
    """The prefix cache's other case: a prompt that shares an earlier prompt's tokens
    but not the answer the slot went on to hold (a chat whose template rewrote that
    answer) goes back to the earlier prompt's end, where the slot's rings (and the MTP
    block's window and states) were copied, instead of prefilling from 0; the answer,
    logprobs included, is a full prefill's."""
    extra = ["--draft-max", "3", "--mtp", str(ds4_mtp_file)] if drafter else []
    with Server("--parallel", "1", *extra, model=ds4_model) as s:
        for prompt in PROMPTS:
            ids = s.post("/tokenize", {"content": prompt}).json()["tokens"]
            r = s.post("/v1/completions", {"prompt": ids, "max_tokens": 6, "temperature": 0})
            assert r.status == 200, r.text
            body = {"prompt": ids + ids[:4], "max_tokens": 8, "temperature": 0, "logprobs": 2}
            hit = s.post("/v1/completions", body).json()
            full = s.post("/v1/completions", {**body, "cache_prompt": False}).json()
            assert hit["usage"]["timings"]["cached_prefix_tokens"] == len(ids), prompt
            assert hit["choices"][0] == full["choices"][0], prompt
            # a longer one: the slot's mark is now the full prefill's prompt end
            again = s.post("/v1/completions", {**body, "prompt": ids + ids[:4] + ids[:2]}).json()
            assert again["usage"]["timings"]["cached_prefix_tokens"] == len(ids) + 4, prompt
            # the same prompt sent again: no pass for it, its first token from the
            # logits kept with the mark (a regenerate button), the answer a full prefill's
            twice = [s.post("/v1/completions", {**body, "prompt": ids + ids[:6], "seed": 3,
                                                "temperature": 0.8}).json() for _ in range(2)]
            assert twice[1]["usage"]["timings"]["cached_prefix_tokens"] == len(ids) + 6, prompt
            assert twice[1]["choices"][0] == twice[0]["choices"][0], prompt
            full = s.post("/v1/completions", {**body, "prompt": ids + ids[:6], "seed": 3,
                                              "temperature": 0.8, "cache_prompt": False}).json()
            assert twice[1]["choices"][0] == full["choices"][0], prompt
        # (the drafter, too, starts a sent-again prompt's chain from the mark)
        log = open(s.log_path).read()
        assert "drafting failed" not in log, log[-2000:]
