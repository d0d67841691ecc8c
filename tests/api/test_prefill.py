"""Long prompts: prefill split over several forward passes gives the same result as one,
and bounded prefill (chunks capped past a position, a short last piece taken along)
splits as documented."""

from helpers import Server

FILLER = " ".join(f"Item {i} is a plain box." for i in range(40))
PROMPT = ("Remember this: the secret animal is a giraffe. " + FILLER +
          "\nQuestion: what is the secret animal? Answer:")


def chunks(n, batch, long_from=0, long_chunk=1, min_tail=512):
    """The chunk sizes serve's bounded prefill gives an n-token prompt (README), where
    the prompt has each pass to itself (one sequence: its budget is the batch)."""
    out, fed = [], 0
    while fed < n:
        long = long_from and fed >= long_from
        cap = batch
        if long:
            cap = min(cap, max(long_chunk, 1))
        elif long_from:
            cap = min(cap, long_from - fed)
        k = min(n - fed, cap)
        tail = n - fed - k
        crosses = long_from and not long and n > long_from
        if 0 < tail < min(min_tail, batch // 4) and not crosses and n - fed <= batch:
            k = n - fed
        out.append(k)
        fed += k
    return out


def run(batch_tokens, *extra):
    with Server("--parallel", "1", "--batch-tokens", str(batch_tokens), *extra) as s:
        m0 = s.metrics()
        r = s.post("/v1/completions", {"prompt": PROMPT, "max_tokens": 6, "temperature": 0,
                                       "logprobs": 1})
        assert r.status == 200, r.text
        m1 = s.metrics()
        passes = m1["moeserve_forward_passes_total"] - m0["moeserve_forward_passes_total"]
        sampled = (m1["moeserve_generated_tokens_total"]
                   - m0["moeserve_generated_tokens_total"])
        return r.json(), passes, sampled


def test_chunked_prefill_matches_single_pass():
    one, passes_one, sampled = run(1024)
    n_prompt = one["usage"]["prompt_tokens"]
    assert 300 < n_prompt < 1024
    chunked, passes_chunked, sampled_chunked = run(96)
    assert chunked["usage"]["prompt_tokens"] == n_prompt
    assert sampled == sampled_chunked >= one["usage"]["completion_tokens"]
    # one pass for the whole prompt vs its chunks; then one per further sampled token
    assert passes_one == sampled
    assert passes_chunked == len(chunks(n_prompt, 96)) + sampled - 1
    assert chunked["choices"][0]["text"] == one["choices"][0]["text"]
    # Same numbers up to kernel rounding (a wrong position or a lost chunk is far off).
    a = one["choices"][0]["logprobs"]["token_logprobs"]
    b = chunked["choices"][0]["logprobs"]["token_logprobs"]
    assert len(a) == len(b)
    assert all(abs(x - y) < 1e-2 for x, y in zip(a, b)), (a, b)


def test_bounded_prefill_chunks():
    """Past --prefill-long-from the chunks shrink to --prefill-long-chunk (the crossing
    chunk stops at the position), a last piece under --prefill-min-tail rides along; the
    answer is the one-pass answer."""
    one, _, _ = run(1024)
    n = one["usage"]["prompt_tokens"]
    bounded, passes, sampled = run(128, "--prefill-long-from", "200", "--prefill-long-chunk", "48",
                                   "--prefill-min-tail", "20")
    want = chunks(n, 128, 200, 48, 20)
    assert want[:2] == [128, 72] and max(want[2:]) <= 48 + 19, want  # (a tail rides along)
    assert passes == len(want) + sampled - 1
    assert bounded["choices"][0]["text"] == one["choices"][0]["text"]
    a = one["choices"][0]["logprobs"]["token_logprobs"]
    b = bounded["choices"][0]["logprobs"]["token_logprobs"]
    assert all(abs(x - y) < 1e-2 for x, y in zip(a, b)), (a, b)
